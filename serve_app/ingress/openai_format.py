"""OpenAI response bodies and SSE events, built as plain dicts (cheap on the hot path)."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    if kind is Kind.CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def chunk_event(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    first: bool,
) -> bytes:
    if kind is Kind.CHAT:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return sse(
        {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    )


def usage_event(
    kind: Kind, request_id: str, created: int, model: str, prompt_tokens: int, completion: int
) -> bytes:
    obj = "chat.completion.chunk" if kind is Kind.CHAT else "text_completion"
    return sse(
        {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage(prompt_tokens, completion),
        }
    )
