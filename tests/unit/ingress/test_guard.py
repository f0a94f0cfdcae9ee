import json
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import AuthConfig, LimitsConfig
from serve_app.ingress.guard import (
    Guard,
    GuardMiddleware,
    key_matches,
    load_api_keys,
)


def test_keys_from_env_and_file(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# rotated 2026-11\nk-file-1\n\n  k-file-2  \n")
    config = AuthConfig(api_keys_env="KEYS", api_keys_file=str(keyfile))
    assert load_api_keys(config, {"KEYS": "k1, k2,,"}) == ["k1", "k2", "k-file-1", "k-file-2"]
    assert load_api_keys(AuthConfig(), {}) == []


def test_key_matching_compares_whole_keys() -> None:
    keys = [b"alpha-key", b"beta-key"]
    assert key_matches(b"beta-key", keys)
    assert not key_matches(b"beta", keys)
    assert not key_matches(b"beta-key2", keys)
    assert not key_matches(b"", keys)


def headers(**kv: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in kv.items()]


@pytest.mark.parametrize(
    ("path", "hdrs", "status"),
    [
        ("/v1/completions", {}, 401),
        ("/v1/completions", {"authorization": "Bearer wrong"}, 401),
        ("/v1/completions", {"authorization": "Basic k1"}, 401),
        ("/v1/completions", {"authorization": "Bearer k1"}, None),
        ("/v1/models", {"authorization": "bearer  k2"}, None),
        ("/pools", {}, 401),
        ("/health", {}, None),
        ("/ready", {}, None),
        ("/v1/completions", {"authorization": "Bearer k1", "content_length": "2000000"}, 413),
        ("/v1/completions", {"authorization": "Bearer k1", "x_big": "x" * 20_000}, 431),
    ],
)
def test_check(path: str, hdrs: dict[str, str], status: int | None) -> None:
    guard = Guard(LimitsConfig(), AuthConfig(api_keys_env="K"), {"K": "k1,k2"})
    refusal = guard.check(path, headers(**hdrs))
    assert (refusal.status_code if refusal else None) == status


def test_without_keys_everything_is_open() -> None:
    guard = Guard(LimitsConfig(), AuthConfig(), {})
    assert guard.key_count == 0
    assert guard.check("/v1/completions", []) is None


class _App:
    """A stand-in ASGI app that reads the whole body."""

    def __init__(self) -> None:
        self.body = b""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _call(
    app: _App,
    guard: Guard,
    scope_headers: list[tuple[bytes, bytes]],
    chunks: list[bytes],
    admit: Any = None,
) -> Any:
    sent: list[dict[str, Any]] = []
    queue = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": scope_headers}
    await GuardMiddleware(app, guard, admit)(scope, receive, send)
    return sent


async def test_middleware_refuses_with_an_openai_body() -> None:
    app = _App()
    guard = Guard(LimitsConfig(), AuthConfig(api_keys_env="K"), {"K": "k1"})
    sent = await _call(app, guard, [], [b"{}"])
    assert sent[0]["status"] == 401
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    body = json.loads(sent[1]["body"])
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "authentication_error"
    assert app.body == b""  # the app never ran


async def test_middleware_bounds_chunked_bodies() -> None:
    from serve_app.ingress.errors import PayloadTooLarge

    app = _App()
    guard = Guard(LimitsConfig(max_body_bytes=1024), AuthConfig(), {})
    with pytest.raises(PayloadTooLarge):
        await _call(app, guard, [], [b"x" * 600, b"x" * 600])
    ok = await _call(app, guard, [], [b"x" * 600, b"x" * 400])
    assert ok[0]["status"] == 200


async def test_a_body_that_stalls_times_out_but_a_complete_one_waits_for_disconnect() -> None:
    import asyncio

    from serve_app.ingress.errors import RequestTimeout

    limits = LimitsConfig(body_timeout_s=0.05)
    guard = Guard(limits, AuthConfig(), {})
    parts = [{"type": "http.request", "body": b"x", "more_body": True}]

    async def stalling() -> dict[str, Any]:
        if parts:
            return parts.pop(0)
        await asyncio.sleep(10)  # the client stopped sending mid-body
        return {}

    app = _App()
    scope = {"type": "http", "path": "/v1/completions", "headers": []}
    with pytest.raises(RequestTimeout):
        await GuardMiddleware(app, guard)(scope, stalling, lambda m: asyncio.sleep(0))

    # the body is complete: waiting for the disconnect afterwards is not a timeout
    from serve_app.ingress.guard import _bounded

    done = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def then_disconnect() -> dict[str, Any]:
        if done:
            return done.pop(0)
        await asyncio.sleep(0.2)
        return {"type": "http.disconnect"}

    receive = _bounded(then_disconnect, 1024, 0.05)
    assert (await receive())["type"] == "http.request"
    assert (await receive())["type"] == "http.disconnect"


def test_key_file_rotates_without_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from serve_app.ingress import guard as guard_module

    keyfile = tmp_path / "keys"
    keyfile.write_text("")
    guard = Guard(LimitsConfig(), AuthConfig(api_keys_file=str(keyfile)), {})
    assert guard.check("/v1/models", []) is None  # empty file: open
    monkeypatch.setattr(guard_module, "KEY_FILE_CHECK_S", 0.0)
    keyfile.write_text("new-key\n")
    os.utime(keyfile, ns=(1, 10**18))  # a distinct mtime whatever the clock resolution
    refusal = guard.check("/v1/models", [])
    assert refusal is not None and refusal.status_code == 401
    assert guard.check("/v1/models", headers(authorization="Bearer new-key")) is None
    keyfile.unlink()  # gone: the keys last read stay in force
    refusal = guard.check("/v1/models", [])
    assert refusal is not None and refusal.status_code == 401


@pytest.mark.parametrize(
    "content", ["", "# all comments\n# no key\n", "\n   \n", b"\xff\xfe not text"]
)
def test_keys_fail_closed_when_the_file_loses_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | bytes
) -> None:
    """Emptied, all comments, blank (a half-written rotation) or unreadable: the last keys
    stay in force, never an open API."""
    import os

    from serve_app.ingress import guard as guard_module

    keyfile = tmp_path / "keys"
    keyfile.write_text("good-key\n")
    guard = Guard(LimitsConfig(), AuthConfig(api_keys_file=str(keyfile)), {})
    monkeypatch.setattr(guard_module, "KEY_FILE_CHECK_S", 0.0)
    if isinstance(content, bytes):
        keyfile.write_bytes(content)
    else:
        keyfile.write_text(content)
    os.utime(keyfile, ns=(1, 10**18))
    refusal = guard.check("/v1/models", [])
    assert refusal is not None and refusal.status_code == 401
    assert guard.check("/v1/models", headers(authorization="Bearer good-key")) is None


def test_missing_key_file_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="api_keys_file"):
        Guard(LimitsConfig(), AuthConfig(api_keys_file=str(tmp_path / "nope")), {})


async def test_early_check_answers_before_the_body_is_read() -> None:
    from serve_app.ingress.errors import SLOUnmeetable

    app = _App()
    seen: list[str] = []

    def early(scope: dict[str, object]) -> SLOUnmeetable | None:
        seen.append(str(scope["path"]))
        return SLOUnmeetable("busy", code="saturated", retry_after_s=1.5)

    sent = await _call(
        app, Guard(LimitsConfig(), AuthConfig(), {}), [], [b'{"prompt": "hi"}'], early
    )
    assert seen == ["/v1/completions"]
    assert sent[0]["status"] == 429
    assert (b"retry-after", b"2") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "saturated"
    assert app.body == b""
