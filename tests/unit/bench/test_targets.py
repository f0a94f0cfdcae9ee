"""The HTTP target against a real HTTP server on 127.0.0.1 (aiohttp's)."""

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from serve_app.bench.targets import HTTPTarget
from serve_app.bench.workload import RequestSpec

HELD_S = 0.2


@pytest.fixture
async def refusing_server() -> AsyncIterator[str]:
    """An OpenAI-style server that holds each completion, then refuses it as the app does."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(_: web.Request) -> web.Response:
        await asyncio.sleep(HELD_S)
        error = {"error": {"code": "protects-running", "message": "held, then refused"}}
        return web.json_response(error, status=429)

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_refusal_is_recorded_with_its_reason_and_how_long_it_took(
    refusing_server: str,
) -> None:
    target = HTTPTarget(refusing_server, "app", send_slo_class=True)
    await target.start()
    try:
        sample = await target.run_one(RequestSpec(0, [5, 6, 7], 4, "interactive", 0.0))
    finally:
        await target.stop()
    assert not sample.ok and sample.status == 429
    assert sample.error == "HTTP 429 protects-running"
    assert sample.ttft_ms is None and sample.tpot_ms is None
    assert sample.e2e_ms is not None and sample.e2e_ms >= HELD_S * 1e3
