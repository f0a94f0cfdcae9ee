"""The deployed app end to end: OpenAI endpoints, streaming, probes, Serve and Ray state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Any

import httpx
import psutil
import pytest

from serve_app.timing import Stage, parse_server_timing, parse_stream_timing
from tests.integration.conftest import AppServer, stream_then_leave

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "ernie-4.5-tiny"


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The data events, and the timing comment as {"server_timing": {stage: ms}}."""
    events = []
    for line in response.iter_lines():
        if (timing := parse_stream_timing(line.encode())) is not None:
            events.append({"server_timing": timing})
            continue
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            events.append({"done": True})
            break
        events.append(json.loads(data))
    return events


def test_ready_said_loading_before_it_said_ready(app_server: AppServer) -> None:
    statuses = [s for s, _, _ in app_server.ready_seen]
    assert statuses[-1] == 200
    loading = [(h, body) for s, h, body in app_server.ready_seen if s == 503 and "loading" in body]
    assert loading, f"never saw the ingress report loading engines: {statuses}"
    headers, body = loading[0]
    assert int(headers["retry-after"]) > 0
    assert json.loads(body)["pools_not_ready"]


def test_health_and_ready(app_server: AppServer) -> None:
    with app_server.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        ready = c.get("/ready")
        assert ready.status_code == 200
        assert ready.json()["replicas"] == {"low-latency": 1, "throughput": 1}


def test_models_lists_the_served_model(app_server: AppServer) -> None:
    with app_server.client() as c:
        body = c.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]


def test_completion(app_server: AppServer) -> None:
    with app_server.client() as c:
        r = c.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "Hello, my name is",
                "max_tokens": 12,
                "ignore_eos": True,
            },
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str) and choice["text"]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] > 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 12
    assert r.headers["x-serve-pool"] in ("low-latency", "throughput")
    assert r.headers["x-route-reason"]


def test_chat_completion(app_server: AppServer) -> None:
    with app_server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "你好，请介绍一下你自己。"}],
                "max_tokens": 8,
                "ignore_eos": True,
            },
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert len(r.headers.get_list("x-request-id")) == 1
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 8


def test_stream_deltas_equal_the_non_streamed_text(app_server: AppServer) -> None:
    request = {
        "model": MODEL,
        "prompt": "The weather today is",
        "max_tokens": 24,
        "temperature": 0.9,
        "seed": 1234,
        "ignore_eos": True,
    }
    with app_server.client() as c:
        full = c.post("/v1/completions", json=request).json()
        with c.stream(
            "POST",
            "/v1/completions",
            json={**request, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
    assert events[-1] == {"done": True}
    timing = events[-2]["server_timing"]
    usage = events[-3]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert usage["choices"] == []
    assert {k: usage["usage"][k] for k in counts} == {k: full["usage"][k] for k in counts}
    assert timing["emit"] >= 0 and timing["ttft"] > 0
    chunks = events[:-3]
    assert "".join(e["choices"][0]["text"] for e in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_streams_share_the_ingress_channel_each_whole(app_server: AppServer) -> None:
    pools = ["low-latency", "throughput"]
    base = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True}
    requests = [{**base, "temperature": 0.9, "seed": seed} for seed in range(6)]

    def pinned(i: int) -> dict[str, str]:
        return {"x-route-policy": f"single:{pools[i % 2]}"}

    async def streamed(c: httpx.AsyncClient, i: int) -> str:
        text = ""
        body = {**requests[i], "stream": True}
        async with c.stream("POST", "/v1/completions", json=body, headers=pinned(i)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def channelled(c: httpx.AsyncClient, done: asyncio.Event) -> set[str]:
        seen: set[str] = set()
        while not done.is_set():
            for name, pool in (await c.get("/pools")).json().items():
                if any(p["stream_channel"] for p in pool["placement"]):
                    seen.add(name)
            await asyncio.sleep(0.05)
        return seen

    async def run() -> tuple[list[str], list[str], set[str]]:
        async with httpx.AsyncClient(base_url=app_server.url, timeout=120) as c:
            whole = [
                (await c.post("/v1/completions", json=r, headers=pinned(i))).json()
                for i, r in enumerate(requests)
            ]
            done = asyncio.Event()
            watch = asyncio.create_task(channelled(c, done))
            # the non-streamed requests just opened each pool's channel (it stays while used)
            texts = await asyncio.gather(*(streamed(c, i) for i in range(len(requests))))
            done.set()
            seen = await watch
        return [w["choices"][0]["text"] for w in whole], list(texts), seen

    whole, texts, seen = asyncio.run(run())
    assert texts == whole
    assert len(set(texts)) > 1  # different seeds: the streams did not get each other's text
    assert seen == set(pools), seen  # each pool's streams had a channel to go on


def _frontend_cpu_s() -> dict[int, float]:
    """CPU seconds used so far by each engine frontend process of this test session's Ray."""
    out: dict[int, float] = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineFrontend" in " ".join(p.cmdline()):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
    return out


def _frontend_dispatch_sockets() -> list[int]:
    """For each engine frontend process: how many of its sockets bear its dispatch socket's
    name (the one listening, and one per connection accepted there: its replica's)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineFrontend" in " ".join(p.cmdline()):
                names = [c.laddr for c in p.net_connections(kind="unix")]
                out.append(sum("serve-app-frontend-" in str(n) for n in names))
    return out


def test_an_engines_streams_spread_over_its_frontends_each_whole(app_server: AppServer) -> None:
    """The throughput pool runs 2 processes per engine on CPU (pool.frontends): the replica and
    an engine frontend, which gets its share of the streams from the replica over its socket
    and sends their chunks on its own channel to the ingress (over another socket of its: the
    ingress is on its node). Each stream is whole and is the answer its request gets
    unstreamed."""
    pinned = {"x-route-policy": "single:throughput"}
    base = {"model": MODEL, "prompt": "Far away", "max_tokens": 48, "ignore_eos": True}
    requests = [{**base, "temperature": 0.8, "seed": seed} for seed in range(8)]
    before = _frontend_cpu_s()
    assert before, "no engine frontend process"

    async def streamed(c: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, int]:
        text, events = "", 0
        async with c.stream("POST", "/v1/completions", json=body, headers=pinned) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    events += 1
        return text, events

    async def frontend_channels(c: httpx.AsyncClient, done: asyncio.Event) -> tuple[int, int]:
        """The most channels to the frontends seen open, and the most of them over a socket."""
        most, by_socket = 0, 0
        while not done.is_set():
            placement = (await c.get("/pools")).json()["throughput"]["placement"]
            most = max(most, *(p["frontend_channels"] for p in placement))
            by_socket = max(by_socket, *(p["frontend_channels_by_socket"] for p in placement))
            await asyncio.sleep(0.05)
        return most, by_socket

    async def run() -> tuple[list[str], list[tuple[str, int]], tuple[int, int]]:
        async with httpx.AsyncClient(base_url=app_server.url, timeout=120) as c:
            whole = [
                (await c.post("/v1/completions", json=r, headers=pinned)).json() for r in requests
            ]
            done = asyncio.Event()
            watch = asyncio.create_task(frontend_channels(c, done))
            results = []
            for _ in range(3):  # the frontend's channel opens with the first dispatches
                bodies = [{**r, "stream": True} for r in requests]
                results = await asyncio.gather(*(streamed(c, b) for b in bodies))
            done.set()
            most = await watch
        return [w["choices"][0]["text"] for w in whole], list(results), most

    whole, results, (most, by_socket) = asyncio.run(run())
    assert [text for text, _ in results] == whole
    assert len(set(whole)) > 1
    assert all(events >= 1 for _, events in results)
    assert most >= 1  # the ingress had a channel to the frontend
    assert by_socket >= 1  # over the frontend's socket: one node, direct dispatch on
    # the replica reaches each frontend on its dispatch socket (listening, and connected)
    assert _frontend_dispatch_sockets() and min(_frontend_dispatch_sockets()) >= 2
    after = _frontend_cpu_s()
    # the frontend served streams: an idle one uses next to no CPU
    assert max(after.get(pid, 0.0) - t for pid, t in before.items()) > 0.1, (before, after)


def test_on_cpu_the_engines_keep_their_replicas_priority_by_default(app_server: AppServer) -> None:
    """Unless SERVE_APP_CPU_ENGINE_NICENESS says otherwise, the engine processes a replica
    started (vLLM's engine core and worker, every thread) run at the replica's niceness (Ray's
    15): at 0, two engines on two cores starved the replicas under a burst."""
    assert "SERVE_APP_CPU_ENGINE_NICENESS" not in os.environ
    engines: dict[int, list[int]] = {}
    replicas: dict[int, int] = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = " ".join(p.cmdline())
            if title.startswith("VLLM::"):
                engines[p.pid] = [os.getpriority(os.PRIO_PROCESS, t.id) for t in p.threads()]
            elif "ServeReplica:llm:pool-" in title:
                replicas[p.pid] = p.nice()
    assert len(engines) >= 4, engines  # an engine core and a worker per pool
    assert set(replicas.values()) == {15}, replicas
    assert all(n == [15] * len(n) for n in engines.values()), engines


def test_every_response_says_where_its_first_token_went(app_server: AppServer) -> None:
    """Server-Timing on the real stack: Serve's proxy (stamped by the proxy hook), the ingress,
    the Ray hops and vLLM's own timestamps; the stages add up to the measured TTFT."""
    request = {"model": MODEL, "prompt": "Where does time go?", "max_tokens": 8}
    with app_server.client() as c:
        full = c.post("/v1/completions", json=request)
        with c.stream("POST", "/v1/completions", json={**request, "stream": True}) as r:
            streamed = r.headers["server-timing"]
            sse_events(r)
    assert full.status_code == 200
    for header in (full.headers["server-timing"], streamed):
        timing = parse_server_timing(header)
        stages = [s.value for s in Stage if s is not Stage.EMIT]
        assert [name for name in timing if name in stages] == stages, header
        between = sum(timing[s] for s in stages if s != Stage.PROXY)
        # the stages between the ingress's arrival and the first chunk tile the TTFT
        assert abs(between - timing["ttft"]) <= 0.05 * timing["ttft"] + 2.0, header
        assert timing["prefill"] > 0, header
    assert parse_server_timing(full.headers["server-timing"])["total"] >= timing["ttft"]


def test_stop_sequence_truncates(app_server: AppServer) -> None:
    request = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "seed": 7}
    request |= {"temperature": 0.8, "ignore_eos": True}
    with app_server.client() as c:
        text = c.post("/v1/completions", json=request).json()["choices"][0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip(), text
        stopped = c.post("/v1/completions", json={**request, "stop": [stop]}).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.index(stop)]


def test_openai_client_streams_a_chat_completion(app_server: AppServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{app_server.url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(content) >= 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_client_disconnect_aborts_the_engine_request(app_server: AppServer) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 3000}
    body |= {"ignore_eos": True, "stream": True}
    with app_server.client() as c:
        running, state = stream_then_leave(c, body)
    assert running >= 1
    assert (state["running"], state["waiting"]) == (0, 0)


def test_serve_reports_every_deployment_healthy(app_server: AppServer) -> None:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    details = ServeSubmissionClient(app_server.dashboard_url).get_serve_details()
    app = details["applications"]["llm"]
    assert app["status"] == "RUNNING"
    statuses = {name: d["status"] for name, d in app["deployments"].items()}
    assert statuses == {
        "Ingress": "HEALTHY",
        "pool-state": "HEALTHY",
        "pool-low-latency": "HEALTHY",
        "pool-throughput": "HEALTHY",
    }
    assert details["http_options"]["host"] == "127.0.0.1"


def test_ray_runs_on_loopback(app_server: AppServer) -> None:
    import ray

    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert addresses == {"127.0.0.1"}


def test_truncate_prompt_keeps_the_head_and_tail_of_a_long_prompt(app_server: AppServer) -> None:
    """A prompt longer than every pool is refused; with truncate_prompt it is cut to the first
    384 and last 128 tokens before routing, and the response says how many were cut."""
    pasted = "The quick brown fox jumps over the lazy dog. " * 700  # ~7,000 tokens
    messages = [{"role": "user", "content": pasted}]
    with app_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": pasted, "max_tokens": 2})
        assert r.status_code == 400, r.text  # longer than every pool's context
        r = c.post(
            "/v1/completions",
            json={"prompt": pasted, "max_tokens": 2, "ignore_eos": True, "truncate_prompt": True},
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == 384 + 128
        assert usage["truncated_prompt_tokens"] > 5000
        assert r.headers["x-serve-truncated-tokens"] == str(usage["truncated_prompt_tokens"])
        # a chat, streamed, with its own head and tail: the usage event says the same
        body = {
            "messages": messages,
            "max_tokens": 2,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "truncate_prompt": {"head_tokens": 100, "tail_tokens": 50},
        }
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            cut = int(s.headers["x-serve-truncated-tokens"])
            (usage,) = [e["usage"] for e in sse_events(s) if e.get("usage")]
        assert usage["prompt_tokens"] == 150 and usage["truncated_prompt_tokens"] == cut > 5000
        # vLLM's own field keeps the tail only; a short prompt is not cut, and says so
        r = c.post(
            "/v1/completions",
            json={"prompt": pasted, "max_tokens": 2, "truncate_prompt_tokens": 300},
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 300
        short = {"prompt": "hi", "max_tokens": 2, "truncate_prompt": True}
        r = c.post("/v1/completions", json=short)
        assert r.json()["usage"]["truncated_prompt_tokens"] == 0
        assert r.headers["x-serve-truncated-tokens"] == "0"
        r = c.post("/v1/completions", json={"prompt": "hi", "truncate_prompt": "yes"})
        assert r.status_code == 400 and "truncate_prompt" in r.json()["error"]["param"]
