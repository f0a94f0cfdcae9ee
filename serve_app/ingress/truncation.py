"""Head + tail prompt truncation: keep a long prompt's first and last tokens, drop the middle.

The ERNIE-4.5 deployment guides cut long pasted prompts this way before they reach the model
(the first 384 and the last 128 tokens): the head keeps the instructions and the start of the
document, the tail keeps the question and, for chat, the turn the model must answer. vLLM's own
`truncate_prompt_tokens` keeps only the last N tokens, which loses the instructions.

It runs at the ingress on the prompt's token ids, before routing, so the router predicts and
checks the length the engine will really see.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_HEAD_TOKENS = 384
DEFAULT_TAIL_TOKENS = 128
MAX_TOKENS = 1 << 20
TRUNCATED_HEADER = "x-serve-truncated-tokens"


class HeadTail(BaseModel):
    """How many tokens of a prompt to keep from its start and from its end."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    head_tokens: int = Field(
        DEFAULT_HEAD_TOKENS, ge=0, le=MAX_TOKENS, description="Kept from the start."
    )
    tail_tokens: int = Field(
        DEFAULT_TAIL_TOKENS, ge=0, le=MAX_TOKENS, description="Kept from the end."
    )

    @model_validator(mode="after")
    def _keeps_something(self) -> HeadTail:
        if self.head_tokens + self.tail_tokens < 1:
            raise ValueError("head_tokens + tail_tokens must keep at least 1 token")
        return self

    def apply(self, ids: list[int]) -> tuple[list[int], int]:
        """(the ids kept, how many were cut). A prompt no longer than head + tail is kept whole."""
        keep = self.head_tokens + self.tail_tokens
        if len(ids) <= keep:
            return ids, 0
        tail = ids[len(ids) - self.tail_tokens :] if self.tail_tokens else []
        return ids[: self.head_tokens] + tail, len(ids) - keep
