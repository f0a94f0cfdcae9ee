"""One chat turn, as plain data: what the settings panel asks of the app, and what the page
says under the answer (or instead of it). No Chainlit here: unit-tested on its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLO_CLASSES = ("interactive", "standard", "batch")


def _positive_int(value: object) -> int | None:
    """A number typed into a text field: None when empty or not a positive integer."""
    try:
        number = int(str(value).strip())
    except ValueError:
        return None
    return number if number > 0 else None


@dataclass(frozen=True)
class Settings:
    """The settings panel's values."""

    slo_class: str = "interactive"
    ttft_ms: int | None = None
    tpot_ms: int | None = None
    max_tokens: int = 256
    temperature: float = 0.7
    truncate: bool = True

    @classmethod
    def from_panel(cls, values: dict[str, Any]) -> Settings:
        slo_class = str(values.get("slo_class", cls.slo_class))
        return cls(
            slo_class=slo_class if slo_class in SLO_CLASSES else cls.slo_class,
            ttft_ms=_positive_int(values.get("ttft_ms", "")),
            tpot_ms=_positive_int(values.get("tpot_ms", "")),
            max_tokens=int(values.get("max_tokens", cls.max_tokens)),
            temperature=float(values.get("temperature", cls.temperature)),
            truncate=bool(values.get("truncate", cls.truncate)),
        )

    def headers(self) -> dict[str, str]:
        """The SLO the app routes by (README: "SLO headers")."""
        headers = {"x-slo-class": self.slo_class}
        if self.ttft_ms is not None:
            headers["x-slo-ttft-ms"] = str(self.ttft_ms)
        if self.tpot_ms is not None:
            headers["x-slo-tpot-ms"] = str(self.tpot_ms)
        return headers

    def request(self) -> dict[str, Any]:
        """Keyword arguments of the OpenAI client's chat.completions.create."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "extra_headers": self.headers(),
            "extra_body": {"truncate_prompt": True} if self.truncate else {},
            "stream": True,
            "stream_options": {"include_usage": True},
        }


@dataclass
class TurnStats:
    """What one answer cost and where it ran, from the response headers and the stream."""

    pool: str = "?"
    route_reason: str = "?"
    sent_at: float = 0.0  # time.monotonic() when the request left
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    truncated_tokens: int | None = None
    server_ttft_ms: float | None = None  # the app's own measure (Server-Timing `ttft`)
    chunks: list[float] = field(default_factory=list)

    def read_headers(self, headers: Any) -> None:
        self.pool = headers.get("x-serve-pool", self.pool)
        self.route_reason = headers.get("x-route-reason", self.route_reason)
        timing = headers.get("server-timing", "")
        for part in timing.split(","):
            name, _, rest = part.strip().partition(";dur=")
            if name == "ttft" and rest:
                self.server_ttft_ms = float(rest)

    def token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.chunks.append(now)

    def read_usage(self, usage: Any) -> None:
        self.prompt_tokens = getattr(usage, "prompt_tokens", None)
        self.completion_tokens = getattr(usage, "completion_tokens", None)
        extra = getattr(usage, "model_extra", None) or {}
        self.truncated_tokens = extra.get("truncated_prompt_tokens")

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.sent_at) * 1e3

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed after the first token, as the reader saw it."""
        if not self.completion_tokens or self.completion_tokens < 2:
            return None
        assert self.first_token_at is not None and self.last_token_at is not None
        span = self.last_token_at - self.first_token_at
        return (self.completion_tokens - 1) / span if span > 0 else None

    def footer(self) -> str:
        """One line under the answer; README "Chat front end" says what each number means."""
        parts = [f"pool **{self.pool}**", f"route `{self.route_reason}`"]
        if self.ttft_ms is not None:
            server = f" (app {self.server_ttft_ms:.0f} ms)" if self.server_ttft_ms else ""
            parts.append(f"TTFT {self.ttft_ms:.0f} ms{server}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        if self.prompt_tokens is not None and self.completion_tokens is not None:
            used = f"{self.prompt_tokens} prompt + {self.completion_tokens} completion tokens"
            if self.truncated_tokens:
                used += f" ({self.truncated_tokens} cut from the middle of the prompt)"
            parts.append(used)
        return " · ".join(parts)


def refusal_text(status: int, body: Any, retry_after: str | None) -> str:
    """A refusal (429, 503, 4xx) as a sentence: the app's reason and when to try again."""
    error = body.get("error", body) if isinstance(body, dict) else {}
    message = error.get("message") if isinstance(error, dict) else None
    code = error.get("code") or error.get("type") if isinstance(error, dict) else None
    kind = {429: "busy", 503: "unavailable"}.get(status, "refused the request")
    text = f"The app is {kind} ({status}" if status in (429, 503) else f"The app {kind} ({status}"
    text += f" `{code}`): " if code else "): "
    text += str(message or body)[:500]
    if retry_after:
        text += f" Retry after {retry_after} s."
    return text
