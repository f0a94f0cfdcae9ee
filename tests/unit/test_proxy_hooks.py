"""The proxy middleware stamps arrival and drops the headers a client must not set."""

import json
import time
from typing import Any

import pytest

from serve_app.proxy_hooks import ProxyStamp, proxy_middlewares
from serve_app.timing import PROXY_START_HEADER, proxy_ms


async def test_stamps_and_strips_client_controls() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update(scope)

    headers = [
        (b"x-request-timeout-seconds", b"0"),
        (b"x-request-disconnect-disabled", b"?1"),
        (PROXY_START_HEADER.encode(), b"1.0"),  # a client's forged stamp
        (b"x-slo-class", b"interactive"),
    ]
    await ProxyStamp(app)({"type": "http", "headers": headers}, None, None)
    names = [k for k, _ in seen["headers"]]
    assert names == [b"x-slo-class", PROXY_START_HEADER.encode()]
    stamp = dict(seen["headers"])[PROXY_START_HEADER.encode()].decode()
    assert proxy_ms(stamp, time.time()) is not None


async def test_other_scopes_pass_untouched() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update(scope)

    scope = {"type": "lifespan"}
    await ProxyStamp(app)(scope, None, None)
    assert seen == {"type": "lifespan"}


def test_hook_returns_starlette_middleware_ray_accepts() -> None:
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    assert len(validate_http_proxy_callback_return(proxy_middlewares())) == 1


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        (b"abc-123", True),
        (b"\xff\xfe", False),  # not ASCII: Serve's proxy failed decoding it (500)
        (b"x" * 6000, False),  # echoed back whole in Serve's 408
        (b"a\x00b", False),
    ],
)
async def test_unusable_request_ids_are_dropped(value: bytes, kept: bool) -> None:
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update(scope)

    await ProxyStamp(app)({"type": "http", "headers": [(b"x-request-id", value)]}, None, None)
    assert ((b"x-request-id", value) in seen["headers"]) is kept


async def test_plain_text_errors_of_the_proxy_become_openai_errors() -> None:
    async def timeout(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 408,
                "headers": [(b"content-type", b"text/plain"), (b"x-request-id", b"r1")],
            }
        )
        await send(
            {"type": "http.response.body", "body": b"Request r1 timed out", "more_body": True}
        )
        await send({"type": "http.response.body", "body": b" after 0.5s." + b"x" * 5000})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await ProxyStamp(timeout)({"type": "http", "headers": []}, None, send)
    start, body = sent
    assert start["status"] == 408
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json" and headers[b"x-request-id"] == b"r1"
    error = json.loads(body["body"])["error"]
    assert error["type"] == "timeout_error" and error["code"] == "http_408"
    assert error["message"].startswith("Request r1 timed out after 0.5s.")
    assert len(body["body"]) <= 2048


async def test_json_and_successful_responses_pass_untouched() -> None:
    messages = [
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        },
        {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True},
        {"type": "http.response.body", "body": b""},
    ]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        for m in messages:
            await send(m)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await ProxyStamp(app)({"type": "http", "headers": []}, None, send)
    assert sent == messages
