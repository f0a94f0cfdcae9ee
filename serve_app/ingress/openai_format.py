"""OpenAI response bodies and SSE events, built as plain dicts (cheap on the hot path)."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"


def usage(
    prompt_tokens: int, completion_tokens: int, truncated: int | None = None
) -> dict[str, int]:
    """OpenAI's usage; with how many prompt tokens head + tail truncation cut, when asked for."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if truncated is not None:
        out["truncated_prompt_tokens"] = truncated
    return out


def _object(kind: Kind, stream: bool) -> str:
    if kind is Kind.CHAT:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


def _choice(
    kind: Kind, text: str, finish_reason: str | None, stream: bool, first: bool = False
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if kind is Kind.COMPLETION:
        choice["text"] = text
    elif stream:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["message"] = {"role": "assistant", "content": text}
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    return choice


def full_response(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    truncated: int | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": _object(kind, stream=False),
        "created": created,
        "model": model,
        "choices": [_choice(kind, text, finish_reason, stream=False)],
        "usage": usage(prompt_tokens, completion_tokens, truncated),
    }


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def _stream_event(kind: Kind, request_id: str, created: int, model: str, **rest: Any) -> bytes:
    envelope = {"id": request_id, "object": _object(kind, stream=True), "created": created}
    return sse({**envelope, "model": model, **rest})


def chunk_event(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    first: bool,
) -> bytes:
    choice = _choice(kind, text, finish_reason, stream=True, first=first)
    return _stream_event(kind, request_id, created, model, choices=[choice])


def usage_event(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    completion: int,
    server_timing: dict[str, float] | None = None,
    truncated: int | None = None,
) -> bytes:
    """The stream's usage; with the first token's breakdown (ms per stage) as an extension."""
    final: dict[str, Any] = usage(prompt_tokens, completion, truncated)
    if server_timing is not None:
        final["server_timing"] = {name: round(ms, 3) for name, ms in server_timing.items()}
    return _stream_event(kind, request_id, created, model, choices=[], usage=final)
