"""What the ingress checks of a request body beyond vLLM's own request models.

vLLM's models (serve_app/engine/vllm_engine.py, `RenderTier.parse`) validate everything vLLM's
server accepts. Here: serve-app's extension (`truncate_prompt`, taken out of the body before
vLLM sees it) and the inputs that made the engine fail (500) instead of answering 400.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from serve_app.ingress.truncation import HeadTail

_MAX_STOP_CHARS = 256
TRUNCATE_PROMPT = "truncate_prompt"


def _text(value: str) -> str:
    """Text the model can see: JSON may carry lone surrogates ("\\ud800"), which no tokenizer
    or stop-string matcher can encode; they are a client error, not an engine failure."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


class Extensions(BaseModel):
    """serve-app's own fields of a completion or chat request, and the checks vLLM lacks."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    truncate_prompt: StrictBool | HeadTail | None = Field(
        None,
        description=(
            "serve-app extension: when the prompt is longer, keep its first head_tokens and "
            "last tail_tokens and drop the middle. true: the endpoint's defaults (384 + 128 "
            "unless serve_config.yaml sets `truncation`); an object: its own. usage reports "
            "truncated_prompt_tokens, the header x-serve-truncated-tokens the same."
        ),
    )
    # vLLM's own tail-only truncation (vLLM applies it); read here to refuse both at once
    truncate_prompt_tokens: int | None = None
    stop: str | list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _usable_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        # An empty stop string made the engine fail (500): found by schemathesis.
        for seq in [v] if isinstance(v, str) else v or []:
            if isinstance(seq, str) and (not seq or len(seq) > _MAX_STOP_CHARS):
                raise ValueError(f"stop sequences must have 1 to {_MAX_STOP_CHARS} characters")
            if isinstance(seq, str):
                _text(seq)
        return v

    @model_validator(mode="after")
    def _one_truncation(self) -> Self:
        if self.truncate_prompt not in (None, False) and self.truncate_prompt_tokens is not None:
            raise ValueError("send truncate_prompt or truncate_prompt_tokens, not both")
        return self

    @classmethod
    def take(cls, body: dict[str, Any]) -> Extensions:
        """The extensions of `body`, removed from it (vLLM's models would log them as unknown);
        raises pydantic's ValidationError."""
        found = cls.model_validate(body)
        body.pop(TRUNCATE_PROMPT, None)
        return found

    def truncation(self, default: HeadTail) -> HeadTail | None:
        """The head + tail truncation asked for, if any."""
        if self.truncate_prompt is None or self.truncate_prompt is False:
            return None
        return default if self.truncate_prompt is True else self.truncate_prompt
