"""Prompt rendering and token counting at the ingress, with the served model's own tokenizer.

The ingress tokenizes so that routing knows the prompt length before choosing a pool; engines
then receive token ids and never tokenize again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serve_app.engine.builtin_model import resolve_model
from serve_app.ingress.errors import BadRequest
from serve_app.ingress.schemas import ChatMessage


class PromptRenderer:
    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self._tokenizer: Any = AutoTokenizer.from_pretrained(resolve_model(model))
        self.vocab_size: int = len(self._tokenizer)

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self._tokenizer.encode(prompt, add_special_tokens=False))
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequest(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
            )
        return list(prompt)

    def chat_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        as_dicts = [{"role": m.role, "content": m.content} for m in messages]
        try:
            ids = self._tokenizer.apply_chat_template(
                as_dicts, tokenize=True, add_generation_prompt=True
            )
        except Exception as e:  # template errors are the caller's message structure
            raise BadRequest(f"messages cannot be rendered: {e}", param="messages") from None
        # transformers 5 returns a BatchEncoding-like mapping, 4.x a list
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
