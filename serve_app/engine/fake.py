"""A stand-in engine and renderer without vLLM, for tests of everything around the engine.

Selected by `engine: fake` in serve_config.yaml's args (AppArgs): replicas run FakeEngine and the
ingress FakeRenderer, so an app starts in seconds, with or without Ray. It is not a model: the
prompt's tokens are its UTF-8 bytes, the answer cycles through a fixed list of words, one word
per FAKE_STEP_S, and the bodies have the shape of vLLM's OpenAI responses (ids, choices, usage,
SSE events ending with [DONE]) without vLLM's fields beyond OpenAI's. Everything the app is
shown working on runs on the real engine; this is for the HTTP, auth, streaming, disconnect and
pipeline logic.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_app.engine.protocol import (
    ApiCall,
    ApiKind,
    Engine,
    EngineStats,
    GenerationRequest,
    StreamChunk,
)
from serve_app.profiles import ResolvedProfile

FAKE_STEP_S = 0.005  # one "token" per step
WORDS = ("lorem", " ipsum", " dolor", " sit", " amet", ",", " consectetur", " adipiscing")
DEFAULT_COMPLETION_TOKENS = 16  # as vLLM's completions without max_tokens


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(str(p.get("text", "")) for p in self.content)


class FakeRequest(BaseModel):
    """The fields the fake engine reads; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[_Message] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)


class FakeRenderer:
    """The ingress's renderer for the fake engine: a prompt's tokens are its UTF-8 bytes."""

    def __init__(self, served_model_name: str) -> None:
        self.model = served_model_name

    @staticmethod
    def schema(kind: ApiKind, ref_template: str) -> dict[str, Any]:
        return FakeRequest.model_json_schema(ref_template=ref_template)

    def parse(self, kind: ApiKind, body: dict[str, Any]) -> FakeRequest:
        request = FakeRequest.model_validate(body)
        field = "messages" if kind is ApiKind.CHAT else "prompt"
        if getattr(request, field) is None:
            error = {"type": "missing", "loc": (field,), "input": body}
            raise ValidationError.from_exception_data("FakeRequest", [error])  # type: ignore[list-item]
        return request

    async def render(self, kind: ApiKind, request: FakeRequest) -> ApiCall | tuple[int, str]:
        if kind is ApiKind.CHAT:
            assert request.messages is not None
            text = "".join(f"{m.role}: {m.text()}\n" for m in request.messages)
            ids = list(text.encode())
            conversation = [{"role": m.role, "content": m.text()} for m in request.messages]
            return ApiCall(kind, request, [{"prompt_token_ids": ids, "prompt": text}], conversation)
        if isinstance(request.prompt, list):
            return ApiCall(kind, request, [{"prompt_token_ids": list(request.prompt)}])
        text = request.prompt or ""
        return ApiCall(kind, request, [{"prompt_token_ids": list(text.encode()), "prompt": text}])


class FakeEngine(Engine):
    """Answers every request with WORDS, one per FAKE_STEP_S; counts what runs."""

    def __init__(self, profile: ResolvedProfile) -> None:
        self._profile = profile
        self.running = 0
        self.started = 0  # requests begun, ever
        self.alive = False

    async def start(self) -> None:
        self.alive = True

    async def check_health(self) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running)

    def shutdown(self) -> None:
        self.alive = False

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        self.running += 1
        self.started += 1
        try:
            if request.api is None:
                async for chunk in self._plain(request):
                    yield chunk
            else:
                async for chunk in _Answer(request.api, self._profile).chunks():
                    yield chunk
        finally:
            self.running -= 1

    async def _plain(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        prompt = len(request.prompt_token_ids)
        for i in range(request.max_tokens):
            await asyncio.sleep(FAKE_STEP_S)
            last = i + 1 == request.max_tokens
            yield StreamChunk(WORDS[i % len(WORDS)], 1, i + 1, prompt, "length" if last else None)


class _Answer:
    """One API request's answer, in the shape of vLLM's OpenAI responses."""

    def __init__(self, call: ApiCall, profile: ResolvedProfile) -> None:
        request: FakeRequest = call.request
        self.chat = call.kind is ApiKind.CHAT
        self.stream = request.stream
        self.usage_wanted = bool((request.stream_options or {}).get("include_usage"))
        self.prompt_tokens = sum(len(i["prompt_token_ids"]) for i in call.inputs)
        asked = request.max_completion_tokens or request.max_tokens
        room = profile.max_model_len - self.prompt_tokens
        self.max_tokens = asked or (room if self.chat else DEFAULT_COMPLETION_TOKENS)
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{request.request_id}"
        self.created = int(time.time())
        self.model = request.model or profile.api_model_name

    def _envelope(self, streamed: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        obj = kind + (".chunk" if streamed and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _usage(self, completion: int) -> dict[str, int]:
        total = self.prompt_tokens + completion
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": total,
            "completion_tokens": completion,
        }

    def _event(self, text: str, first: bool, finish: str | None) -> str:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": finish}
        return _sse({**self._envelope(True), "choices": [choice]})

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        words: list[str] = []
        for i in range(self.max_tokens):
            await asyncio.sleep(FAKE_STEP_S)
            words.append(WORDS[i % len(WORDS)])
            done = i + 1 == self.max_tokens
            finish = "length" if done else None
            if self.stream:
                yield self._chunk(self._event(words[-1], i == 0, finish), 1, i + 1, finish)
            elif i == 0 and not done:
                yield self._chunk(None, 1, 1, None)  # the first token is out
        n = len(words)
        if self.stream:
            if self.usage_wanted:
                usage = {**self._envelope(True), "choices": [], "usage": self._usage(n)}
                yield self._chunk(_sse(usage), 0, n, "length")
            yield self._chunk("data: [DONE]\n\n", 0, n, "length")
            return
        text = "".join(words)
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, **({"message": message} if self.chat else {"text": text})}
        choice |= {"logprobs": None, "finish_reason": "length"}
        body = {**self._envelope(False), "choices": [choice], "usage": self._usage(n)}
        new = n - 1 if n > 1 else n  # after the first token's chunk, when there was one
        yield self._chunk(json.dumps(body), new, n, "length")

    def _chunk(self, data: str | None, new: int, total: int, finish: str | None) -> StreamChunk:
        return StreamChunk("", new, total, self.prompt_tokens, finish, sent_at=0.0, data=data)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
