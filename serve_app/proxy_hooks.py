"""Middleware for Serve's HTTP proxy, installed through Ray's supported hook.

Ray calls `proxy_middlewares()` in every proxy actor when the nodes' environment names it in
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (`serve-app run` and cluster/ set it). Per request it:

- stamps the proxy's arrival time (`x-serve-app-proxy-start`), so the ingress can report the
  time spent in the proxy (serve_app/timing.py); a stamp sent by the client is replaced;
- removes the headers with which a client could switch off Serve's own protections for its
  request (`x-request-timeout-seconds: 0` disables the request timeout,
  `x-request-disconnect-disabled: ?1` keeps generating after the client left), and an
  `x-request-id` that is not short printable ASCII (Serve would fail decoding it, or echo
  kilobytes of it back), so Serve assigns its own;
- answers in the API's OpenAI error shape where Serve's proxy itself answers with plain text
  (its 408 request timeout, 500, 503), with a bounded message.
"""

from __future__ import annotations

import json
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
_REQUEST_ID = b"x-request-id"
MAX_REQUEST_ID_BYTES = 128
_MAX_MESSAGE_CHARS = 200
_ERROR_TYPES = {408: "timeout_error", 503: "service_unavailable"}

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def _usable_request_id(value: bytes) -> bool:
    return len(value) <= MAX_REQUEST_ID_BYTES and value.isascii() and value.decode().isprintable()


def without_client_controls(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers minus those a client must not set (names are lower case in ASGI)."""
    return [
        (k, v)
        for k, v in headers
        if k not in _DROPPED and (k != _REQUEST_ID or _usable_request_id(v))
    ]


def openai_error(status: int, text: bytes) -> bytes:
    """A plain-text error of Serve's proxy as an OpenAI error body (message bounded)."""
    message = text.decode("utf-8", "replace").strip()[:_MAX_MESSAGE_CHARS] or f"HTTP {status}"
    kind = _ERROR_TYPES.get(
        status, "internal_server_error" if status >= 500 else "invalid_request_error"
    )
    body = {"error": {"message": message, "type": kind, "param": None, "code": f"http_{status}"}}
    return json.dumps(body, separators=(",", ":")).encode("ascii")


def _json_errors(send: Any) -> Any:
    """send() that turns an error response that is not JSON into the API's error shape."""
    held: dict[str, Any] | None = None
    body = b""

    async def send_json_errors(message: MutableMapping[str, Any]) -> None:
        nonlocal held, body
        if message["type"] == "http.response.start":
            ctype = next((v for k, v in message.get("headers", []) if k == b"content-type"), b"")
            if message["status"] >= 400 and not ctype.startswith(b"application/json"):
                held = dict(message)  # answered once its body is complete
                return
        elif message["type"] == "http.response.body" and held is not None:
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            payload = openai_error(held["status"], body)
            kept = [
                (k, v)
                for k, v in held.get("headers", [])
                if k not in (b"content-type", b"content-length")
            ]
            held["headers"] = [
                *kept,
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ]
            await send(held)
            await send({"type": "http.response.body", "body": payload})
            return
        await send(message)

    return send_json_errors


class ProxyStamp:
    """Pure ASGI: rewrites the scope's headers, nothing else (no per-request task or copy)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = without_client_controls(scope["headers"])
        headers.append((_STAMP, f"{time.time():.6f}".encode()))
        scope["headers"] = headers
        await self.app(scope, receive, _json_errors(send))


def proxy_middlewares() -> list[Middleware]:
    return [Middleware(ProxyStamp)]
