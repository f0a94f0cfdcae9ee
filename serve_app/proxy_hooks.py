"""Middleware for Serve's HTTP proxy, installed through Ray's supported hook.

Ray calls `proxy_middlewares()` in every proxy actor when the nodes' environment names it in
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (`serve-app run` and cluster/ set it). Per request it:

- stamps the proxy's arrival time (`x-serve-app-proxy-start`), so the ingress can report the
  time spent in the proxy (serve_app/timing.py); a stamp sent by the client is replaced;
- removes the headers with which a client could switch off Serve's own protections for its
  request (`x-request-timeout-seconds: 0` disables the request timeout,
  `x-request-disconnect-disabled: ?1` keeps generating after the client left).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.middleware import Middleware

from serve_app.timing import PROXY_START_HEADER

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "serve_app.proxy_hooks.proxy_middlewares"

# Headers Ray Serve honours from clients that no client of this app may set.
CLIENT_CONTROL_HEADERS = frozenset({b"x-request-timeout-seconds", b"x-request-disconnect-disabled"})
_STAMP = PROXY_START_HEADER.encode()
_DROPPED = CLIENT_CONTROL_HEADERS | {_STAMP}

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def without_client_controls(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers minus those a client must not set (names are lower case in ASGI)."""
    return [(k, v) for k, v in headers if k not in _DROPPED]


class ProxyStamp:
    """Pure ASGI: rewrites the scope's headers, nothing else (no per-request task or copy)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = without_client_controls(scope["headers"])
            headers.append((_STAMP, f"{time.time():.6f}".encode()))
            scope["headers"] = headers
        await self.app(scope, receive, send)


def proxy_middlewares() -> list[Middleware]:
    return [Middleware(ProxyStamp)]
