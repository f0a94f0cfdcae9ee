"""The proxy middleware stamps arrival and drops the headers a client must not set."""

import time
from typing import Any

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
