"""Does the app answer as `vllm serve` does? The same requests to both, compared.

    python -m serve_app.bench.parity --profile throughput --out docs/results/api-parity/cpu

starts `vllm serve` and the app (`serve-app run`) from one profile (bench.servers), sends every
request of CASES to both (completions and chat, streamed and not, the sampling, logprobs,
structured-output and tool fields, and requests both must refuse), at temperature 0 or with a
seed, and writes the table (parity.md) and every pair of answers (parity.json). The integration
test (tests/integration/test_api_parity.py) runs the same comparison against the shared app.

Compared: status; for a 200 the whole body with `id`, `created` and `system_fingerprint` left
out (generated token ids, text, logprobs, finish reasons, usage, every key); a stream by what its
events carry, merged per choice (vLLM's own server merges engine steps into one event when its
reader is behind, so event boundaries vary from run to run), plus the keys each choice's events
had, the events' envelopes and the events without choices (usage, [DONE]).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

IGNORED = {"id", "created", "system_fingerprint"}
PROMPT = "The quick brown fox jumps over the lazy dog. 春眠不觉晓，处处闻啼鸟。"
CHAT = [{"role": "user", "content": PROMPT}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _c(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}


def _chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0, **fields}


NEAR_LIMIT = "a prompt that leaves ROOM tokens of the context"
ROOM = 6
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion": _c(),
    "completion default max_tokens": _c(max_tokens=None),
    "completion token-id prompt": _c(prompt=[76, 292, 346, 1725, 5, 6, 7]),
    "completion two prompts": _c(prompt=[PROMPT, "Hello"]),
    "completion logprobs 2": _c(logprobs=2),
    "completion echo": _c(echo=True),
    "completion echo + logprobs": _c(echo=True, logprobs=1),
    "completion prompt_logprobs": _c(prompt_logprobs=1),
    "completion stop_token_ids": _c(stop_token_ids=[1, 2], max_tokens=16),
    "completion min_tokens + stop": _c(min_tokens=4, stop=["有"], max_tokens=12),
    "completion stop string": _c(stop=["a", "的"], max_tokens=16),
    "completion presence/frequency": _c(presence_penalty=1.5, frequency_penalty=0.5),
    "completion repetition_penalty": _c(repetition_penalty=1.3),
    "completion logit_bias": _c(logit_bias={"100": 100}),
    "completion seed sampled": _c(temperature=1.0, seed=7, max_tokens=12),
    "completion top_k/top_p seed": _c(temperature=0.8, top_k=5, top_p=0.9, seed=3),
    "completion n=2 seed": _c(temperature=1.0, seed=11, n=2),
    "completion return_token_ids": _c(return_token_ids=True),
    "completion ignore_eos": _c(ignore_eos=True, max_tokens=10),
    "completion json_schema": _c(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        max_tokens=40,
    ),
    "completion structured choice": _c(structured_outputs={"choice": ["yes", "no"]}),
    "completion stream": _c(**STREAM),
    "completion stream logprobs": _c(logprobs=1, **STREAM),
    "completion stream echo": _c(echo=True, **STREAM),
    "chat": _chat(),
    # a prompt a few tokens short of the context, no max_tokens: vLLM generates to the end
    "chat default max_tokens (rest of context)": _chat(
        messages=NEAR_LIMIT, max_tokens=None, ignore_eos=True
    ),
    "chat content parts": _chat(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": PROMPT}],
            }
        ]
    ),
    "chat system + developer": _chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Answer in English."},
            *CHAT,
        ]
    ),
    "chat multi-turn": _chat(
        messages=[
            *CHAT,
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Why?"},
        ]
    ),
    "chat continue_final_message": _chat(
        messages=[*CHAT, {"role": "assistant", "content": "The"}],
        continue_final_message=True,
        add_generation_prompt=False,
    ),
    "chat echo": _chat(
        messages=[*CHAT, {"role": "assistant", "content": "The"}],
        echo=True,
        continue_final_message=True,
        add_generation_prompt=False,
    ),
    "chat logprobs top 3": _chat(logprobs=True, top_logprobs=3),
    "chat max_completion_tokens": _chat(max_tokens=None, max_completion_tokens=5),
    "chat stop_token_ids + min_tokens": _chat(stop_token_ids=[1, 2], min_tokens=3),
    "chat penalties": _chat(presence_penalty=0.7, frequency_penalty=0.7, repetition_penalty=1.1),
    "chat logit_bias": _chat(logit_bias={"300": 50, "301": 50}),
    "chat seed sampled": _chat(temperature=1.0, seed=5, max_tokens=12),
    "chat n=2 seed": _chat(temperature=1.0, seed=9, n=2),
    "chat json_object": _chat(response_format={"type": "json_object"}, max_tokens=24),
    "chat json_schema": _chat(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        max_tokens=40,
    ),
    "chat tools, tool_choice none": _chat(tools=[TOOL], tool_choice="none"),
    "chat tools, tool_choice auto (no parser)": _chat(tools=[TOOL], tool_choice="auto"),
    "chat tools, named (no parser)": _chat(
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    ),
    "chat stream": _chat(**STREAM),
    "chat stream logprobs": _chat(logprobs=True, top_logprobs=2, **STREAM),
    "chat stream n=2": _chat(temperature=1.0, seed=4, n=2, **STREAM),
    "chat too many top_logprobs": _chat(logprobs=True, top_logprobs=100),
    "chat empty messages": _chat(messages=[]),
    "completion negative max_tokens": _c(max_tokens=-1),
}


def _normal(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if k not in IGNORED}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _merge(into: Any, new: Any) -> Any:
    """Two successive pieces of one choice of a stream as one: text and lists (tokens,
    logprobs) concatenated, objects merged, a null leaving the value before it."""
    if new is None:
        return into
    if isinstance(new, dict) and isinstance(into, dict):
        return {k: _merge(into.get(k), new.get(k)) for k in {**into, **new}}
    if isinstance(new, str) and isinstance(into, str):
        return into + new
    if isinstance(new, list) and isinstance(into, list):
        return into + new
    return new


def _events(response: httpx.Response) -> dict[str, Any]:
    """A stream as what it carries: each choice's pieces merged in order (vLLM's own server
    merges engine steps into one event when its reader is behind, so event boundaries vary
    from run to run), the keys each choice's events had, the events' envelopes, and the
    events without choices (usage, [DONE]) in order."""
    choices: dict[int, Any] = {}
    keys: dict[int, set[str]] = {}
    envelopes: set[str] = set()
    rest: list[Any] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        event = data if data == "[DONE]" else _normal(json.loads(data))
        if not isinstance(event, dict) or not event.get("choices"):
            rest.append(event)
            continue
        for choice in event["choices"]:
            index = choice["index"]
            choices[index] = _merge(choices.get(index), choice)
            keys.setdefault(index, set()).update(choice)
        envelope = {k: v for k, v in event.items() if k != "choices"}
        envelopes.add(json.dumps(envelope, sort_keys=True))
    shapes = {index: sorted(k) for index, k in keys.items()}
    return {"choices": choices, "keys": shapes, "envelopes": sorted(envelopes), "rest": rest}


def _send(client: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    body = {k: v for k, v in body.items() if v is not None}
    if body.get("stream"):
        with client.stream("POST", path, json=body, headers=headers) as r:
            return r.status_code, _events(r) if r.status_code == 200 else r.read()
    r = client.post(path, json=body, headers=headers)
    return r.status_code, _normal(r.json()) if r.status_code == 200 else r.json()


def _near_the_limit(ref: httpx.Client, max_model_len: int) -> list[dict[str, str]]:
    """A user message whose chat prompt is ROOM tokens short of max_model_len (by vLLM's own
    /tokenize)."""
    unit = "alpha beta "

    def count(k: int) -> int:
        body = {"messages": [{"role": "user", "content": unit * k}]}
        return int(ref.post("/tokenize", json=body).json()["count"])

    per_unit = (count(200) - count(100)) / 100
    k = int(100 + (max_model_len - ROOM - count(100)) / per_unit)
    while count(k) > max_model_len - ROOM:
        k -= 1
    return [{"role": "user", "content": unit * k}]


def _closing_bias(ref: httpx.Client) -> dict[str, int]:
    """A logit bias toward the tokens that end JSON values and objects (by vLLM's /tokenize).
    A random-weight model never closes a JSON string or object by itself (it writes whitespace
    or string characters until max_tokens); with the bias it tends to, while the grammar of
    response_format still decides which tokens are allowed at all."""
    ids = [ref.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in '":}']
    return {str(i): 30 for token_ids in ids for i in token_ids}


def json_content(answer: dict[str, Any]) -> Any:
    choice = answer["choices"][0]
    return json.loads(choice["message"]["content"] if "message" in choice else choice["text"])


@dataclass
class Row:
    name: str
    path: str
    vllm_status: int
    app_status: int
    tokens: int  # generated by vllm serve
    identical: bool
    vllm: Any = None
    app: Any = None


def compare(
    ref: httpx.Client, app: httpx.Client, max_model_len: int, app_headers: dict[str, str]
) -> list[Row]:
    """Every request of CASES to `vllm serve` (ref) and to the app; one row per request."""
    near_limit = _near_the_limit(ref, max_model_len)
    bias = _closing_bias(ref)
    rows = []
    for name, (path, body) in CASES.items():
        if body.get("messages") == NEAR_LIMIT:
            body = {**body, "messages": near_limit}
        if "response_format" in body:
            body = {**body, "logit_bias": bias}
        want_status, want = _send(ref, path, body, {})
        got_status, got = _send(app, path, body, app_headers)
        same = want_status == got_status and (want_status != 200 or want == got)
        rows.append(
            Row(name, path, want_status, got_status, _generated_tokens(want), same, want, got)
        )
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| request | endpoint | vllm serve | app | tokens | identical |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.name} | {r.path} | {r.vllm_status} | {r.app_status} | {r.tokens} | "
        f"{'yes' if r.identical else 'NO'} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def _generated_tokens(answer: Any) -> int:
    events = answer.get("rest", [answer])
    usages = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    return int(usages[-1]["completion_tokens"]) if usages else 0


def main(argv: list[str] | None = None) -> int:
    from serve_app.bench.servers import servers

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="throughput")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ports", default="18101,18102,18365,18180")
    args = parser.parse_args(argv)
    vllm_port, app_port, dashboard_port, metrics_port = (int(p) for p in args.ports.split(","))
    ports = (vllm_port, app_port, dashboard_port, metrics_port)
    args.out.mkdir(parents=True, exist_ok=True)
    with servers(args.profile, ports, args.out / "logs", {}, {}, []) as (targets, profile):
        ref, app = (httpx.Client(base_url=t.url, timeout=600) for t in targets[:2])
        with ref, app:
            rows = compare(ref, app, profile.max_model_len, {"x-slo-class": "batch"})
    (args.out / "parity.md").write_text(table(rows))
    (args.out / "parity.json").write_text(json.dumps([asdict(r) for r in rows], ensure_ascii=False))
    print(table(rows))
    same = sum(r.identical for r in rows)
    print(f"{same} of {len(rows)} identical")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
