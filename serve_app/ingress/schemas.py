"""OpenAI request bodies the ingress accepts (the subset the engine honours, and checks)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from serve_app.ingress.truncation import HeadTail

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
    truncate_prompt: StrictBool | HeadTail | None = Field(
        None,
        description=(
            "serve-app extension: when the prompt is longer, keep its first head_tokens and "
            "last tail_tokens and drop the middle. true: the endpoint's defaults (384 + 128 "
            "unless serve_config.yaml sets `truncation`); an object: its own. usage reports "
            "truncated_prompt_tokens, the header x-serve-truncated-tokens the same."
        ),
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="vLLM's: keep only the last N prompt tokens (truncate_prompt keeps both ends).",
    )

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

    @model_validator(mode="after")
    def _one_truncation(self) -> Self:
        if self.truncate_prompt not in (None, False) and self.truncate_prompt_tokens is not None:
            raise ValueError("send truncate_prompt or truncate_prompt_tokens, not both")
        return self

    def truncation(self, default: HeadTail) -> HeadTail | None:
        """The head + tail truncation asked for, if any (vLLM's field is a tail-only one)."""
        if self.truncate_prompt_tokens is not None:
            return HeadTail(head_tokens=0, tail_tokens=self.truncate_prompt_tokens)
        if self.truncate_prompt is None or self.truncate_prompt is False:
            return None
        return default if self.truncate_prompt is True else self.truncate_prompt

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
