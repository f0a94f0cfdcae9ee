"""Hostile input, disconnects, a dying engine, overload and API keys, on the real stack."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.engine.watchdog import wait_ended
from tests.integration.conftest import (
    AppServer,
    engine_core_of,
    reached_directly,
    redeploy,
    stream_then_leave,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = "ernie-4.5-tiny"
LEAKS = re.compile(r"Traceback|site-packages|/work/|/home/|File \"")


def assert_openai_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert len(r.content) <= 2048, len(r.content)
    assert not LEAKS.search(r.text), r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param, error
    return error


def _longest_context(c: httpx.Client) -> int:
    return int(c.get("/v1/models").json()["data"][0]["max_model_len"])


C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# (path, body: dict or raw bytes, headers, status, param): 39 cases, written by hand.
BAD_REQUESTS: list[tuple[str, Any, dict[str, str], int, str | None]] = [
    (C, b'{"prompt": ', {}, 400, None),  # truncated JSON
    (C, b"", {}, 400, None),  # empty body
    (C, b"[1, 2]", {}, 400, None),  # JSON, but not an object
    (C, b"\xff\xfe not utf-8", {}, 400, None),
    (C, {"max_tokens": 4}, {}, 400, "prompt"),  # missing prompt
    (C, {"prompt": ""}, {}, 400, "prompt"),
    (C, {"prompt": 5}, {}, 400, "prompt"),
    (C, {"prompt": [1, 2, 10**9]}, {}, 400, "prompt"),  # token id outside the vocabulary
    (C, {"prompt": [-1]}, {}, 400, "prompt"),
    (C, {"prompt": "hi", "max_tokens": 0}, {}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": -3}, {}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "ten"}, {}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 10**12}, {}, 400, "max_tokens"),  # beyond any context
    (C, {"prompt": "hi", "temperature": -1}, {}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": "hot"}, {}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, {}, 400, "top_p"),
    (C, {"prompt": "hi", "n": "two"}, {}, 400, "n"),
    (C, {"prompt": "hi", "logprobs": 21}, {}, 400, "logprobs"),
    (C, {"prompt": "hi", "stop": ""}, {}, 400, "stop"),  # the engine failed on it (was a 500)
    (C, {"prompt": "hi", "stop": ["ok", ""]}, {}, 400, "stop"),
    (C, {"prompt": "hi", "seed": 2**70}, {}, 400, "seed"),
    (C, {"prompt": "hi", "stream": [1]}, {}, 400, "stream"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": "x"}}, {}, 400, "stream_options"),
    (C, {"prompt": "hi", "model": "gpt-4"}, {}, 404, "model"),
    (C, b'{"prompt": "hi", "model": "\\ud981x"}', {}, 404, "model"),  # lone surrogate (was a 500)
    (C, {"prompt": "hi"}, {"x-slo-ttft-ms": "soon"}, 400, "x-slo-ttft-ms"),
    (C, {"prompt": "hi"}, {"x-slo-tpot-ms": "-5"}, 400, "x-slo-tpot-ms"),
    (C, {"prompt": "hi"}, {"x-slo-class": "gold"}, 400, "x-slo-class"),
    (C, {"prompt": "word " * 5000, "max_tokens": 4}, {}, 400, "input_tokens"),
    (C, {"prompt": "x" * (2 << 20)}, {}, 413, None),  # body over the 1 MiB limit
    (C, {"prompt": "hi"}, {"x-filler": "y" * 10_000}, 431, None),  # headers over 8 KiB
    (CH, {"max_tokens": 4}, {}, 400, "messages"),
    (CH, {"messages": []}, {}, 400, "messages"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, {}, 400, "messages"),
    (CH, {"messages": [{"content": "hi"}]}, {}, 400, "messages"),  # no role
    (CH, {"messages": "hi"}, {}, 400, "messages"),
    # vLLM names the field it maps max_completion_tokens to
    (CH, {"messages": MSG, "max_completion_tokens": 0}, {}, 400, "max_tokens"),
    (CH, {"messages": MSG, "model": "nope"}, {}, 404, "model"),
    ("/v1/embeddings", {"input": "hi"}, {}, 404, None),  # not served here
]


def test_bad_requests_get_bounded_openai_errors(app_server: AppServer) -> None:
    assert len(BAD_REQUESTS) >= 25
    with app_server.client() as c:
        longest = _longest_context(c)
        for path, body, headers, status, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(path, json=body, headers=headers)
            assert_openai_error(r, status, param)
        # prompt fits, prompt + max_tokens does not
        r = c.post(C, json={"prompt": [5] * (longest - 10), "max_tokens": 100})
        assert_openai_error(r, 400, "max_tokens")
        r = c.get(C)  # wrong method
        assert_openai_error(r, 405, None)
        # nothing else broke: a good request is served
        ok = c.post(C, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_hostile_headers_and_bodies_through_serve_s_proxy(app_server: AppServer) -> None:
    """The cases of the hardening issue's table, each through Serve's proxy (with the app's
    proxy hook) as a client would send them: a 4xx naming what is wrong, or handled, never a
    5xx or a plain-text body, and the app serves a normal request afterwards."""
    ok_body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    with app_server.client() as c:
        for name, value in (
            ("x-slo-ttft-ms", "²".encode()),  # a non-ASCII digit
            ("x-slo-tpot-ms", b"9" * 4301),
        ):
            r = c.post(C, json=ok_body, headers={name: value})  # type: ignore[dict-item]
            assert_openai_error(r, 400, name)
        twice = [("x-slo-ttft-ms", "100"), ("x-slo-ttft-ms", "abc")]
        assert_openai_error(c.post(C, json=ok_body, headers=twice), 400, "x-slo-ttft-ms")
        for raw, param in (
            (b'{"prompt": "\\ud800"}', "prompt"),
            (b'{"prompt": "hi", "stop": ["\\udfff"]}', "stop"),
        ):
            r = c.post(C, content=raw, headers={"content-type": "application/json"})
            assert_openai_error(r, 400, param)
        # an x-request-id Serve cannot use is dropped (Serve assigns one), not a 500
        r = c.post(C, json=ok_body, headers={"x-request-id": b"\xff\xfe"})  # type: ignore[dict-item]
        assert r.status_code == 200, r.text
        # a client cannot set Serve's request timeout (nor get its id echoed 6,000 bytes long)
        slow = {**ok_body, "max_tokens": 48}
        r = c.post(
            C,
            json=slow,
            headers={"x-request-timeout-seconds": "0.000001", "x-request-id": "x" * 6000},
        )
        assert r.status_code == 200, r.text
        assert all(len(v) <= 128 for k, v in r.headers.multi_items() if k == "x-request-id")
        # a chunked body past max_body_bytes is 413, as a declared one is
        limit = (
            app_server.config["applications"][0]["args"]
            .get("limits", {})
            .get("max_body_bytes", 1 << 20)
        )
        chunks = (b'{"prompt": "' + b"a" * 65536 for _ in range(limit // 65536 + 2))
        r = c.post(C, content=chunks, headers={"content-type": "application/json"})
        assert_openai_error(r, 413, None)
        # a client cannot keep its generation running after it leaves
        running, idle = stream_then_leave(
            c, {**ok_body, "max_tokens": 2000, "stream": True},
            headers={"x-request-disconnect-disabled": "?1"},
        )  # fmt: skip
        assert running >= 1 and idle["running"] == 0 and idle["waiting"] == 0
        assert c.post(C, json=ok_body).status_code == 200


# a header value as a client can send it: HTTP strips the whitespace around a field value, and
# h11 (httpx) refuses to send a value that starts or ends with a space
_HEADER_TEXT = st.text(
    st.characters(min_codepoint=32, max_codepoint=0x2FFF, exclude_characters="\x7f"), max_size=40
).map(lambda v: v.strip(" "))
_JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
_FIELDS = ["prompt", "max_tokens", "stop", "temperature", "top_p", "seed", "stream", "n", "model"]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    headers=st.dictionaries(
        st.sampled_from(
            [
                "x-slo-ttft-ms",
                "x-slo-tpot-ms",
                "x-slo-class",
                "x-slo-policy",
                "x-route-policy",
                "x-request-id",
                "x-request-timeout-seconds",
            ]
        ),
        _HEADER_TEXT,
        max_size=3,
    ),
    body=st.dictionaries(st.sampled_from(_FIELDS), _JSON_VALUE, max_size=5),
)
def test_random_headers_and_bodies_never_get_a_server_error(
    app_server: AppServer, headers: dict[str, str], body: dict[str, Any]
) -> None:
    """Property: whatever a client puts in the routing headers and the body's fields, the answer
    is a success or an OpenAI-shaped 4xx under 2 KB; never a 5xx."""
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = max(-1, min(body["max_tokens"], 8))  # bound generation
    raw = json.dumps(body).encode()  # lone surrogates travel escaped, as a JSON client sends them
    encoded = {k: v.encode() for k, v in headers.items()}  # UTF-8 bytes, as on the wire
    with app_server.client() as c:
        r = c.post(C, content=raw, headers={"content-type": "application/json", **encoded})  # type: ignore[dict-item]
        assert r.status_code < 500, (headers, body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert len(r.content) <= 2048 and set(r.json()["error"]) >= {"message", "type"}
        elif body.get("stream") is True:
            assert r.headers["content-type"].startswith("text/event-stream")


def test_the_app_serves_after_the_property_tests(app_server: AppServer) -> None:
    with app_server.client() as c:
        r = c.post(C, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_schemathesis_finds_no_server_error(app_server: AppServer) -> None:
    """Property-based requests from the app's own OpenAPI schema, for a bounded time."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{app_server.url}/openapi.json")
    deadline = time.monotonic() + 150
    failures: list[str] = []
    calls = 0
    client = httpx.Client(timeout=120)
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(
            max_examples=40,
            deadline=None,
            derandomize=True,  # the same requests on every run
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            nonlocal calls
            if time.monotonic() > deadline:
                return
            calls += 1
            # bound generation: a random valid request may ask for thousands of tokens
            if isinstance(case.body, dict):
                for field in ("max_tokens", "max_completion_tokens"):
                    value = case.body.get(field)
                    if isinstance(value, int) and not isinstance(value, bool) and value > 64:
                        case.body[field] = 64
            # (schemathesis' own transport does not run with this urllib3; send it with httpx)
            kw = case.as_transport_kwargs(base_url=app_server.url)
            headers = {k: v for k, v in kw["headers"].items() if k.lower() != "connection"}
            try:
                response = client.request(
                    kw["method"],
                    kw["url"],
                    headers=headers,
                    params=kw.get("params"),
                    json=kw.get("json"),
                    content=kw.get("data"),
                )
            except (httpx.LocalProtocolError, UnicodeEncodeError, TypeError):
                return  # not sendable as HTTP (e.g. a header value with control characters)
            if response.status_code >= 500:
                sent = json.dumps(kw.get("json"))[:400]
                answer = f"{response.status_code} {response.text[:300]}"
                failures.append(f"{case.method} {case.path} {sent} -> {answer}")
            elif response.status_code >= 400 and len(response.content) > 2048:
                failures.append(f"{case.method} {case.path}: {len(response.content)} B error")

        check()
    client.close()
    print(f"\nschemathesis: {calls} requests, {len(failures)} failures")
    assert calls >= 50
    assert not failures, failures[:10]


def _status_soon(c: httpx.Client, path: str, want: int, **kw: Any) -> int:
    """The key file is re-read within ~1 s of a change."""
    deadline = time.monotonic() + 10
    status = c.get(path, **kw).status_code
    while status != want and time.monotonic() < deadline:
        time.sleep(0.2)
        status = c.get(path, **kw).status_code
    return status


def test_open_api_is_announced_at_start(app_server: AppServer) -> None:
    import glob

    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    logs = glob.glob(f"{session}/logs/serve/replica_llm_Ingress_*.log")
    assert logs
    text = "".join(Path(p).read_text(errors="replace") for p in logs)
    assert "API keys: none configured" in text


async def _stream(
    session: aiohttp.ClientSession, url: str, max_tokens: int, cancel_after: int | None
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "Tell me about the sea", "max_tokens": max_tokens}
    body |= {"stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"x-slo-class": "batch"}
    for _ in range(100):  # refusals (429) are retried after a pause, as a client would
        async with session.post(url + C, json=body, headers=headers) as r:
            if r.status == 429:
                await asyncio.sleep(0.2)
                continue
            assert r.status == 200, await r.text()
            chunks, usage = 0, None
            async for line in r.content:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                event = json.loads(text.removeprefix("data: "))
                if event.get("usage"):
                    usage = event["usage"]
                elif event.get("choices"):
                    chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    return {"cancelled": True, "pool": r.headers["x-serve-pool"]}
            return {"cancelled": False, "usage": usage}
    raise AssertionError("refused 100 times")


def _metric(server: AppServer, name: str, **labels: str) -> dict[str, float]:
    """Each series of the metric with these labels (one per replica and worker), by its labels."""
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    series = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            key, value = line.rsplit(" ", 1)
            series[key] = float(value)
    return series


def _increase(before: dict[str, float], after: dict[str, float]) -> float:
    """What a counter's series added between two scrapes. A series whose replica has gone
    since is no longer exported: the sum over the series then falls, though nothing was
    uncounted, so each series is compared with itself."""
    return sum(value - before.get(key, 0.0) for key, value in after.items())


def _engines_idle(c: httpx.Client) -> bool:
    return all(p["running"] == 0 and p["waiting"] == 0 for p in c.get("/pools").json().values())


def test_hundred_streams_ten_cancelled(app_server: AppServer) -> None:
    disconnected_before = _metric(
        app_server, "ray_serve_app_requests_total", outcome="disconnected"
    )

    async def run() -> list[dict[str, Any]]:
        timeout = aiohttp.ClientTimeout(total=240)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            tasks = []
            for i in range(100):
                cancel = i % 10 == 0
                tasks.append(
                    _stream(session, app_server.url, 2000 if cancel else 32, 3 if cancel else None)
                )
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    cancelled = [r for r in results if r["cancelled"]]
    completed = [r for r in results if not r["cancelled"]]
    assert len(cancelled) == 10 and len(completed) == 90
    assert all(r["usage"]["completion_tokens"] == 32 for r in completed)
    with app_server.client() as c:
        ended = time.monotonic()
        deadline = ended + 5
        while not _engines_idle(c) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert _engines_idle(c), c.get("/pools").json()
        idle_after_s = time.monotonic() - ended
    # Ray exports metrics every few seconds: wait for the count to show the 10 disconnects.
    deadline = time.monotonic() + 30
    seen = 0.0
    while time.monotonic() < deadline:
        now = _metric(app_server, "ray_serve_app_requests_total", outcome="disconnected")
        seen = _increase(disconnected_before, now)
        if seen >= 10:
            break
        time.sleep(1)
    print(
        f"\n100 streams: {len(completed)} completed with 32 tokens each, {len(cancelled)} "
        f"cancelled; engines idle {idle_after_s:.2f} s after the last stream ended; "
        f"disconnected counter +{seen:.0f}"
    )
    assert seen >= 10


async def _load_request(
    session: aiohttp.ClientSession, url: str, stream: bool = True, pool: str | None = None
) -> dict[str, Any]:
    """One request (to `pool` only, if named); when it started and ended, where it went,
    whether it was whole."""
    body = {"model": MODEL, "prompt": "Count slowly", "max_tokens": 48, "ignore_eos": True}
    if stream:  # (vLLM refuses stream_options without a stream, as OpenAI does)
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    out: dict[str, Any] = {"started": time.monotonic(), "ok": False, "pool": None}
    out["stream"] = stream
    headers = {"x-slo-class": "batch"}
    if pool is not None:
        headers["x-route-policy"] = f"single:{pool}"
    async with session.post(url + C, json=body, headers=headers) as r:
        out["status"] = r.status
        out["pool"] = r.headers.get("x-serve-pool")
        out["request_id"] = r.headers.get("x-request-id")
        out["retry_after"] = r.headers.get("retry-after")
        if r.status == 200 and not stream:
            out["ok"] = (await r.json())["usage"]["completion_tokens"] == 48
        elif r.status == 200:
            async for line in r.content:
                text = line.decode().strip()
                if not text.startswith("data: {"):
                    continue
                event = json.loads(text.removeprefix("data: "))
                if "error" in event:
                    out["error"] = event["error"]
                    break
                if event.get("usage"):
                    out["ok"] = event["usage"]["completion_tokens"] == 48
        else:
            out["error"] = await r.text()
            out["bytes"] = len(out["error"])
    out["ended"] = time.monotonic()
    return out


def test_engine_core_killed_under_load(app_server: AppServer) -> None:
    outcomes: list[dict[str, Any]] = []
    killed_at: list[float] = []
    # The victim: the engine core of the pool running the most of the load when the kill comes
    # (class batch goes to the pool predicted fastest, which depends on what routing learned).
    victims: list[tuple[str, psutil.Process]] = []
    # Streams sent to that pool alone at the kill, before the replica can know its engine died:
    # nothing of them has reached the client, so each must get a status, not a 200 stream that
    # carries only an error.
    pinned: list[asyncio.Task[dict[str, Any]]] = []

    async def run() -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            deadline = time.monotonic() + 40
            pending: set[asyncio.Task[dict[str, Any]]] = set()
            i = 0
            while time.monotonic() < deadline:  # ~10 requests/s for 40 s, bounded
                i += 1
                request = _load_request(session, app_server.url, stream=i % 2 == 0)
                pending.add(asyncio.create_task(request))
                if i == 30:
                    async with session.get(app_server.url + "/pools") as r:
                        pools = await r.json()
                    pool = max(sorted(pools), key=lambda name: pools[name]["running"])
                    victims.append((pool, engine_core_of(pool)))
                    killed_at.append(time.monotonic())
                    os.kill(victims[0][1].pid, signal.SIGKILL)
                    for _ in range(4):
                        pinned.append(
                            asyncio.create_task(_load_request(session, app_server.url, pool=pool))
                        )
                await asyncio.sleep(0.1)
                done = {t for t in pending if t.done()}
                outcomes.extend(t.result() for t in done)
                pending -= done
            outcomes.extend(await asyncio.gather(*pending))
            await asyncio.gather(*pinned)

    asyncio.run(run())
    kill = killed_at[0]
    ((pool, victim),) = victims
    before = [o for o in outcomes if o["started"] < kill]
    after = [o for o in outcomes if o["started"] >= kill]
    failed_before = [o for o in before if not o["ok"]]
    failed_after = [o for o in after if not o["ok"]]
    on_victim = [o for o in before if o["pool"] == pool and o["ended"] > kill]
    fail_s = [round(o["ended"] - kill, 2) for o in failed_before]
    print(
        f"\nengine kill: {len(before)} requests started before ({len(on_victim)} in flight on "
        f"{pool}), {len(failed_before)} failed, ended {fail_s} s after the kill; "
        f"{len(after)} started after, {len(failed_after)} failed"
    )
    assert on_victim, "the load never reached the pool whose engine was killed"
    # Started after the kill: served, or (while the load that pool carried falls on what is
    # left) shed before any engine with an honest 429 saying the pools are saturated and when
    # to retry; never a server error, a broken stream or a request lost on the dead engine.
    shed = [o for o in failed_after if _shed_as_saturated(o)]
    print(f"{len(shed)} of those refused up front as saturated")
    assert len(shed) == len(failed_after), [_told(o) for o in failed_after if o not in shed][:3]
    assert len(after) - len(shed) >= len(after) / 2, "most of the load after the kill was shed"
    assert all(o["pool"] == pool for o in failed_before), [_told(o) for o in failed_before]
    # failed fast, not at a timeout; what each slow one was, to find it in the replicas' logs
    slow = [o | {"after_s": round(o["ended"] - kill, 2)} for o in failed_before]
    assert not [o for o in slow if o["after_s"] >= 5], [_told(o) for o in slow]
    # a non-streamed request whose engine died mid-generation gets 503, OpenAI-shaped, not 500
    failed_whole = [o for o in failed_before if not o["stream"]]
    print(
        f"{len(failed_whole)} of them not streamed: statuses {[o['status'] for o in failed_whole]}"
    )
    assert all(o["status"] == 503 and o["bytes"] <= 2048 for o in failed_whole), failed_whole
    assert all(json.loads(o["error"])["error"]["type"] for o in failed_whole)
    at_kill = [t.result() for t in pinned]
    print(f"streams sent to {pool} alone at the kill: statuses {[o['status'] for o in at_kill]}")
    assert all(o["status"] == 503 and json.loads(o["error"])["error"]["type"] for o in at_kill)
    # The pool comes back to full strength: a new engine core, serving again.
    recovered = _serving_again(pool, victim.pid, kill)
    print(f"{pool} pool back at full strength {recovered} s after the kill")
    assert recovered is not None


def _shed_as_saturated(outcome: dict[str, Any]) -> bool:
    """A 429 load-shedding refusal: no pool placed, Retry-After set, OpenAI-shaped body whose
    code says the pools are saturated."""
    if outcome["status"] != 429 or outcome["pool"] is not None or not outcome["retry_after"]:
        return False
    error = json.loads(outcome["error"])["error"]
    return bool(error["code"] == "saturated" and error["type"] == "rate_limit_error")


def _told(outcome: dict[str, Any]) -> str:
    """One load request's outcome, whole, for an assertion's message (pytest cuts dicts)."""
    return json.dumps(outcome, default=str)


def _serving_again(pool: str, old_engine_pid: int, since: float) -> float | None:
    """Seconds from `since` until the pool serves from an engine core other than the old one."""
    from ray import serve

    from serve_app.engine.protocol import GenerationRequest

    handle = serve.get_deployment_handle(f"pool-{pool}", app_name="llm")
    while time.monotonic() - since < 180:
        with contextlib.suppress(Exception):
            engine_pid = engine_core_of(pool).pid
            request = GenerationRequest("probe", [5, 6, 7], max_tokens=2)
            chunks = list(handle.options(stream=True).generate.remote(request))
            if engine_pid != old_engine_pid and chunks and chunks[-1].finish_reason:
                return time.monotonic() - since
        time.sleep(1)
    return None


def test_a_killed_replica_takes_its_engine_with_it(app_server: AppServer) -> None:
    """A replica process that dies without shutting its engine down (SIGKILL: what Serve's
    force-stop, `ray stop` after its grace period and the OOM killer send) must not leave the
    engine core running: on a GPU it holds the memory the replacement needs."""
    pool = "throughput"
    # from a whole pool, whatever the tests before left of it (an engine killed, a redeploy)
    assert _serving_again(pool, -1, time.monotonic()) is not None
    engine = engine_core_of(pool)
    replica = next(p for p in engine.parents() if "ServeReplica" in " ".join(p.cmdline()))
    killed, wall = time.monotonic(), time.time()
    replica.kill()
    alive = wait_ended([engine], timeout_s=15)
    ended_s = time.monotonic() - killed
    # the replacement's engine core had not started when the old one was gone
    newer = [
        p for p in psutil.process_iter(["cmdline", "create_time"])
        if "EngineCore" in " ".join(p.info["cmdline"] or []) and p.info["create_time"] > wall
    ]  # fmt: skip
    recovered = _serving_again(pool, engine.pid, killed)
    print(
        f"\nreplica killed: its engine core ended {ended_s:.1f} s later "
        f"({'still running' if alive else 'gone'}); {len(newer)} engine core(s) started by then; "
        f"pool back {recovered} s after the kill"
    )
    assert not alive, "the engine core outlived its replica"
    assert not newer, "the replacement started its engine before the old one ended"
    assert recovered is not None


# The last tests of the module share one redeploy (each restarts every engine): in flight
# across it, a stream; after it, API keys on. The shipped config comes back after them.


@dataclass
class Redeployed:
    keys: list[str]
    keyfile: Path
    stream: dict[str, Any]  # the stream in flight when the redeploy began: how it ended
    redeploy_started: float


@pytest.fixture(scope="module")
def redeployed_with_keys(app_server: AppServer) -> Iterator[Redeployed]:
    """The app redeployed (a new version: every replica replaced) with a key file holding two
    keys, while a stream of 1500 tokens was in flight, read to its end; afterwards redeployed
    as it was (once configured, keys cannot be turned off by emptying the file: they fail
    closed)."""
    import threading

    keys = ["sk-test-one-" + "a" * 24, "sk-test-two-" + "b" * 24]
    keyfile = app_server.api_keys_file.with_name("api-keys-on")
    keyfile.write_text("# test keys\n" + "\n".join(keys) + "\n")
    changed = copy.deepcopy(app_server.config)
    changed["applications"][0]["args"]["auth"] = {"api_keys_file": str(keyfile)}

    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 1500}
    body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result: dict[str, Any] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        with (
            httpx.Client(base_url=app_server.url, timeout=300) as c,
            c.stream("POST", C, json=body, headers={"x-slo-class": "batch"}) as r,
        ):
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_chunk.set()
                    event = json.loads(line.removeprefix("data: "))
                    result["usage"] = event.get("usage") or result.get("usage")
                    result["error"] = event.get("error") or result.get("error")
        result["ended"] = time.monotonic()

    with app_server.client() as c:  # the stream goes over a replica's socket, not by Serve:
        replicas = reached_directly(c)  # its drain at the stop is the app's (engine/direct.py)
    assert all(r["direct_dispatch"] for r in replicas), replicas
    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert first_chunk.wait(60)
        redeploy_started = time.monotonic()
        redeploy(app_server, changed)
        worker.join(300)
        assert not worker.is_alive()
        yield Redeployed(keys, keyfile, result, redeploy_started)
    finally:
        worker.join(300)
        redeploy(app_server, app_server.config)
        with app_server.client() as c:
            assert _status_soon(c, "/v1/models", 200) == 200


def test_redeploy_lets_in_flight_streams_finish(redeployed_with_keys: Redeployed) -> None:
    """A redeploy replaces every replica; the ones being stopped finish their streams first."""
    result = redeployed_with_keys.stream
    print(
        f"\nstream of 1500 tokens across a redeploy: status {result['status']}, "
        f"{result['usage']}, ended {result['ended'] - redeployed_with_keys.redeploy_started:.1f} "
        "s after the redeploy began"
    )
    assert result["status"] == 200 and not result.get("error")
    assert result["usage"]["completion_tokens"] == 1500


def test_api_keys(app_server: AppServer, redeployed_with_keys: Redeployed) -> None:
    keys, keyfile = redeployed_with_keys.keys, redeployed_with_keys.keyfile
    with app_server.client() as c:
        assert _status_soon(c, "/v1/models", 401) == 401
        error = assert_openai_error(c.get("/v1/models"), 401, None)
        assert error["code"] == "invalid_api_key"
        wrong = {"authorization": "Bearer sk-test-one-" + "a" * 23 + "x"}
        assert_openai_error(c.post(C, json={"prompt": "hi"}, headers=wrong), 401, None)
        no_scheme = {"authorization": keys[0]}
        assert_openai_error(c.get("/pools", headers=no_scheme), 401, None)
        for key in keys:
            r = c.post(
                C,
                json={"prompt": "hi", "max_tokens": 2},
                headers={"authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
        assert c.get("/health").status_code == 200  # probes need no key
        assert c.get("/ready").status_code == 200
        # a rotation that empties the file (or leaves only comments) must not open the API
        keyfile.write_text("# rotating\n")
        time.sleep(2.5)  # the file is re-read within a second of a change
        assert_openai_error(c.get("/v1/models"), 401, None)
        ok = c.get("/v1/models", headers={"authorization": f"Bearer {keys[1]}"})
        assert ok.status_code == 200
