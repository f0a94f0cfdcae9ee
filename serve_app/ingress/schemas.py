"""OpenAI request bodies the ingress accepts (the subset the engine honours, and checks)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_MAX_STOP = 4
_MAX_STOP_CHARS = 256


def _text(value: str) -> str:
    """Text the model can see: JSON may carry lone surrogates ("\\ud800"), which no tokenizer
    or stop-string matcher can encode; they are a client error, not an engine failure."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown OpenAI fields (user, metadata, ...) are ignored as OpenAI's own server does;
    # fields we know but cannot honour are refused by name below.
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name; defaults to the only one.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    ignore_eos: bool = Field(False, description="vLLM extension: generate past end-of-sequence.")

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > _MAX_STOP:
            raise ValueError(f"at most {_MAX_STOP} stop sequences")
        # An empty stop string made the engine fail (500): found by schemathesis.
        for seq in [v] if isinstance(v, str) else v or []:
            if not seq or len(seq) > _MAX_STOP_CHARS:
                raise ValueError(f"stop sequences must have 1 to {_MAX_STOP_CHARS} characters")
            _text(seq)
        return v

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(description="Text, or token ids, to complete.")
    max_tokens: int | None = Field(16, ge=1, description="OpenAI's default for completions is 16.")

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return _text(v) if isinstance(v, str) else v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str

    @field_validator("content")
    @classmethod
    def _valid_text(cls, v: str) -> str:
        return _text(v)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens.")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
