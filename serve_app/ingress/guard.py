"""What every request passes before the API sees it: header and body size limits, API keys.

A pure ASGI middleware (no per-request task or body copy), so the cost on the streaming path is a
few comparisons. Refusals are OpenAI-shaped like every other error (errors.py).

API keys come from an environment variable (comma-separated) and/or a mounted file (one key per
line, `#` comments), named in serve_config.yaml; the config names where keys live, never the keys.
Keys are compared in constant time against every configured key. Probes (/health, /ready) stay
open so orchestrators need no key.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from serve_app.config import AuthConfig, LimitsConfig
from serve_app.ingress.errors import (
    HeadersTooLarge,
    PayloadTooLarge,
    RequestTimeout,
    ServeError,
    Unauthorized,
    error_response,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("ray.serve")

KEY_FILE_CHECK_S = 1.0
OPEN_PATHS = frozenset({"/health", "/ready", "/-/healthz", "/-/routes"})


def load_api_keys(config: AuthConfig, environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Every configured key, stripped; empty when none is configured."""
    keys: list[str] = []
    if config.api_keys_env and environ.get(config.api_keys_env):
        keys += [k.strip() for k in environ[config.api_keys_env].split(",")]
    if config.api_keys_file:
        for line in Path(config.api_keys_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return [k for k in keys if k]


def key_matches(presented: bytes, keys: list[bytes]) -> bool:
    """Constant time in the presented key; every configured key is compared (no early exit)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


class Guard:
    """The limits and keys in force; `check` is the whole per-request decision.

    A key file is read again when it changes (checked at most once a second), so keys rotate
    without a redeploy; if it disappears, becomes unreadable or holds no key (emptied, all
    comments, half-written), the keys last read stay in force and a warning is logged: once
    keys are configured, the API never opens.
    """

    def __init__(
        self,
        limits: LimitsConfig,
        auth: AuthConfig,
        environ: MutableMapping[str, str] = os.environ,
    ) -> None:
        self.limits = limits
        self._auth = auth
        self._environ = environ
        self._file = Path(auth.api_keys_file) if auth.api_keys_file else None
        if self._file is not None and not self._file.is_file():
            raise FileNotFoundError(f"auth.api_keys_file {auth.api_keys_file} does not exist")
        self._mtime = self._file_mtime()
        self._checked_at = time.monotonic()
        self._keys = [k.encode() for k in load_api_keys(auth, environ)]

    @property
    def key_count(self) -> int:
        return len(self._keys)

    def _file_mtime(self) -> int | None:
        try:
            return self._file.stat().st_mtime_ns if self._file else None
        except OSError:
            return None

    def _refresh(self) -> None:
        now = time.monotonic()
        if self._file is None or now - self._checked_at < KEY_FILE_CHECK_S:
            return
        self._checked_at = now
        mtime = self._file_mtime()
        if mtime is None or mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            keys = [k.encode() for k in load_api_keys(self._auth, self._environ)]
        except (OSError, UnicodeDecodeError) as e:
            logger.warning("API key file unreadable (%s): the keys last read stay in force", e)
            return
        if self._keys and not keys:
            # An emptied or half-written file must not open the API: keys fail closed.
            logger.warning(
                "API key file has no keys now: the %d keys last read stay in force", len(self._keys)
            )
            return
        self._keys = keys
        logger.info("API keys reloaded from the key file: %d configured", len(self._keys))

    def check(self, path: str, headers: list[tuple[bytes, bytes]]) -> ServeError | None:
        self._refresh()
        if sum(len(k) + len(v) for k, v in headers) > self.limits.max_header_bytes:
            return HeadersTooLarge(
                f"request headers exceed {self.limits.max_header_bytes} bytes",
                code="headers_too_large",
            )
        if self._keys and path not in OPEN_PATHS:
            auth = next((v for k, v in headers if k == b"authorization"), b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not key_matches(token.strip(), self._keys):
                return Unauthorized(
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            return _too_large(self.limits.max_body_bytes)
        return None


# Before the body is read: the request's ASGI scope -> an error to answer now, or None to go on
# (it may leave what it parsed in scope["state"] for the route to reuse).
EarlyCheck = Callable[[Scope], ServeError | None]


class GuardMiddleware:
    """ASGI middleware applying the Guard before routing and body parsing, then `admit` (the
    request pipeline's early admission: it refuses what no prompt could change, without
    reading the body)."""

    def __init__(self, app: ASGIApp, guard: Guard, admit: EarlyCheck | None = None) -> None:
        self.app = app
        self.guard = guard
        self.admit = admit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.guard.check(scope["path"], scope["headers"])
        if refusal is None and self.admit is not None:
            refusal = self.admit(scope)
        if refusal is not None:
            await _respond(scope, receive, send, refusal)
            return
        limits = self.guard.limits
        await self.app(scope, _bounded(receive, limits.max_body_bytes, limits.body_timeout_s), send)


def _bounded(receive: Receive, limit: int, timeout_s: float) -> Receive:
    """receive() that fails once the body read so far passes the limit (chunked bodies), or
    when the next part of the body takes longer than timeout_s to arrive. Once the body is
    complete, receive() waits as long as it must (it then reports the client's disconnect)."""
    seen = 0
    complete = False

    async def bounded_receive() -> Message:
        nonlocal seen, complete
        if complete:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), timeout_s)
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {timeout_s:g} s", code="body_timeout"
            ) from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large(limit)
            complete = not message.get("more_body", False)
        return message

    return bounded_receive


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body exceeds {limit} bytes", code="body_too_large")


async def _respond(scope: Scope, receive: Receive, send: Send, err: ServeError) -> None:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(err, Unauthorized) else None
    await error_response(err, headers)(scope, receive, send)
