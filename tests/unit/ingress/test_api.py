"""The HTTP API over the request pipeline, in one process and in seconds: the fake engine's
replicas and a pool-state board behind in-process handles, a real HTTP server on 127.0.0.1.

The same API on the real stack (Ray, Serve, vLLM) is tested in tests/integration.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from serve_app.app import ingress_config, resolve_profiles
from serve_app.config import AppArgs, IngressConfig
from serve_app.engine.fake import FakeEngine, FakeRenderer
from serve_app.engine.replica import EngineReplica
from serve_app.ingress.api import create_app
from serve_app.ingress.pipeline import RequestPipeline
from serve_app.local import LocalHandle
from serve_app.pool_state import PoolStateBoard
from serve_app.profiles import Platform

KEYS_ENV = "SERVE_APP_TEST_API_KEYS"


@dataclass
class LocalApp:
    url: str
    engines: dict[str, FakeEngine]

    def running(self) -> int:
        return sum(e.running for e in self.engines.values())


@asynccontextmanager
async def fake_pools(
    **raw: Any,
) -> AsyncIterator[tuple[IngressConfig, PoolStateBoard, dict[str, EngineReplica]]]:
    """The fake engine's pool replicas, reporting to a board, behind in-process handles."""
    args = AppArgs.model_validate(
        {"profiles": ["low-latency", "throughput"], "engine": "fake", **raw}
    )
    profiles = [
        p.model_copy(update={"served_model_name": "fake-model"})
        for p in resolve_profiles(args, Platform.CPU)
    ]
    board = PoolStateBoard([p.name for p in profiles])
    replicas: dict[str, EngineReplica] = {}
    for profile in profiles:
        replica = EngineReplica.__new__(EngineReplica)
        await replica.__init__(profile, LocalHandle(board), FakeEngine)  # type: ignore[misc]
        replicas[profile.name] = replica
    await asyncio.sleep(0.05)  # the replicas' first reports reach the board
    try:
        yield ingress_config(args, profiles), board, replicas
    finally:
        for replica in replicas.values():
            replica.__del__()


@asynccontextmanager
async def local_app(**raw: Any) -> AsyncIterator[LocalApp]:
    async with fake_pools(**raw) as (config, board, replicas):
        handles = {name: LocalHandle(r) for name, r in replicas.items()}
        pipeline = RequestPipeline(config, handles, LocalHandle(board), FakeRenderer("fake-model"))
        await pipeline.start()
        async with _served(pipeline) as url:
            yield LocalApp(url, {name: r._engine for name, r in replicas.items()})  # type: ignore[misc]


@asynccontextmanager
async def _served(pipeline: RequestPipeline) -> AsyncIterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(create_app(pipeline), host="127.0.0.1", port=0, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn says so by a flag only)
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving
        pipeline.stop()


class _SilentBoard:
    async def exchange(self, post: Any) -> Any:
        await asyncio.sleep(3600)


async def test_an_ingress_knows_the_pools_once_started() -> None:
    """Serve routes to a replica as soon as it runs: its start takes the board's first answer,
    or a new ingress beside others refuses its first requests (503, no pool ready). A board
    that does not answer does not hold the start."""
    async with fake_pools() as (config, board, replicas):
        handles = {name: LocalHandle(r) for name, r in replicas.items()}
        pipeline = RequestPipeline(config, handles, LocalHandle(board), FakeRenderer("m"))
        await pipeline.start()
        ready = pipeline.ready()  # nothing has run since start: no refresh of the loop's
        pipeline.stop()
        assert ready.status_code == 200, ready.body
        silent = RequestPipeline(config, handles, LocalHandle(_SilentBoard()), FakeRenderer("m"))
        await asyncio.wait_for(silent.start(), timeout=10)
        silent.stop()
        assert silent.ready().status_code == 503


async def test_a_completion_and_a_chat_completion() -> None:
    async with local_app() as app, httpx.AsyncClient(base_url=app.url) as c:
        r = await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 10, "completion_tokens": 5}
        assert r.headers["x-serve-pool"] in app.engines
        assert "ttft" in r.headers["server-timing"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = await c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "lorem ipsum dolor"


async def test_a_stream_ends_with_usage_timing_and_done() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        local_app() as app,
        httpx.AsyncClient(base_url=app.url) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == (
        "lorem ipsum dolor sit"
    )
    assert events[-1]["usage"]["completion_tokens"] == 4
    assert lines[-2].startswith(": server-timing ") and "emit;dur=" in lines[-2]
    assert lines[-1] == "data: [DONE]"


async def test_a_client_that_leaves_mid_stream_ends_its_engine_request() -> None:
    body = {"prompt": "Hello", "max_tokens": 2000, "stream": True}  # 10 s of fake tokens
    async with local_app() as app, httpx.AsyncClient(base_url=app.url) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            for _ in range(3):
                await anext(lines)
            assert app.running() == 1
        for _ in range(100):  # the server notices the disconnect and the pipeline cancels
            if app.running() == 0:
                break
            await asyncio.sleep(0.02)
        assert app.running() == 0


async def test_a_stream_with_a_tpot_target_is_protected_while_it_decodes() -> None:
    body = {"prompt": "Hello", "max_tokens": 200, "stream": True}
    interactive = {"x-slo-class": "interactive"}  # TPOT target 50 ms; the fake takes ~5
    async with local_app() as app, httpx.AsyncClient(base_url=app.url) as c:
        async with c.stream("POST", "/v1/completions", json=body, headers=interactive) as r:
            pool = r.headers["x-serve-pool"]
            lines = r.aiter_lines()
            for _ in range(5):
                await anext(lines)
            slack = (await c.get("/pools")).json()[pool]["decode_slack_ms"]
            assert 0 < slack < 200 * 50
            async for _ in lines:
                pass
        assert (await c.get("/pools")).json()[pool]["decode_slack_ms"] is None


@pytest.mark.parametrize("max_held", [64, 0])
async def test_a_request_its_pool_cannot_take_yet_waits_while_its_ttft_target_allows(
    max_held: int,
) -> None:
    """A document whose prefill would make the stream decoding on the only pool miss its TPOT
    target waits for it and is served; with holding off it is refused at once."""
    # prefill at 10 ms per token: the 300-token document stalls a decode for 3 s, more than
    # the stream's slack (40 tokens at a 50 ms target, the fake taking ~5 ms each: < 2 s)
    routing = {"priors": {"low-latency": {"ttft_ms_per_prompt_token": 10}}, "max_held": max_held}
    stream = {"prompt": "Hello", "max_tokens": 40, "stream": True}
    doc = {"prompt": "x" * 300, "max_tokens": 4}
    patient = {"x-slo-ttft-ms": "20000", "x-slo-tpot-ms": "1000"}
    async with (
        local_app(profiles=["low-latency"], routing=routing) as app,
        httpx.AsyncClient(base_url=app.url) as c,
    ):
        async with c.stream(
            "POST", "/v1/completions", json=stream, headers={"x-slo-class": "interactive"}
        ) as r:
            lines = r.aiter_lines()
            await anext(lines)
            waiting = asyncio.create_task(c.post("/v1/completions", json=doc, headers=patient))
            async for _ in lines:
                pass
            stream_ended = asyncio.get_running_loop().time()
        answer = await waiting
        answered = asyncio.get_running_loop().time()
    if max_held:
        assert answer.status_code == 200, answer.text
        assert answered > stream_ended  # it went in once the stream no longer needed the room
    else:
        assert answer.status_code == 429
        assert answer.json()["error"]["code"] == "protects-running"


async def test_api_keys_are_required_when_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEYS_ENV, "k1,k2")
    async with (
        local_app(auth={"api_keys_env": KEYS_ENV}) as app,
        httpx.AsyncClient(base_url=app.url) as c,
    ):
        body = {"prompt": "Hello", "max_tokens": 2}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert app.engines and all(e.started == 0 for e in app.engines.values())
        r = await c.post("/v1/completions", json=body, headers={"authorization": "Bearer k2"})
        assert r.status_code == 200
        assert (await c.get("/health")).status_code == 200  # probes stay open


async def test_an_unmeetable_slo_is_refused_before_the_engines() -> None:
    async with local_app() as app, httpx.AsyncClient(base_url=app.url) as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 2},
            headers={"x-slo-ttft-ms": "1"},  # the pools' prior alone predicts 20 ms
        )
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] and "retry-after" in r.headers
        assert all(e.started == 0 for e in app.engines.values())


@pytest.mark.parametrize(
    ("path", "content", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b'{"max_tokens": 2}', 400, "prompt"),
        ("/v1/chat/completions", b'{"prompt": "x"}', 400, "messages"),
        ("/v1/completions", b'{"prompt": "x", "model": "other"}', 404, "model"),
        ("/v1/completions", b'{"prompt": "x", "stop": [""]}', 400, "stop"),
        ("/v1/completions", b'{"prompt": "x"}', 400, "x-slo-ttft-ms"),
    ],
)
async def test_bad_requests_get_an_openai_error_naming_the_parameter(
    path: str, content: bytes, status: int, param: str | None
) -> None:
    headers = {"content-type": "application/json"}
    if param == "x-slo-ttft-ms":
        headers["x-slo-ttft-ms"] = "soon"
    async with local_app() as app, httpx.AsyncClient(base_url=app.url) as c:
        r = await c.post(path, content=content, headers=headers)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["message"] and error["param"] == param
        ok = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200  # nothing else broke


async def test_the_openapi_document_describes_the_request_bodies() -> None:
    async with local_app() as app, httpx.AsyncClient(base_url=app.url) as c:
        doc = (await c.get("/openapi.json")).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = ref["$ref"].rsplit("/", 1)[1]
        assert "max_tokens" in doc["components"]["schemas"][name]["properties"]


async def test_probes_and_models() -> None:
    async with local_app() as app, httpx.AsyncClient(base_url=app.url) as c:
        ready = await c.get("/ready")
        assert ready.status_code == 200 and ready.json()["replicas"] == dict.fromkeys(
            app.engines, 1
        )
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == "fake-model"
        assert set((await c.get("/pools")).json()) == set(app.engines)
