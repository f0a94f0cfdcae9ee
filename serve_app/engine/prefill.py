"""Prefill accounting in one replica: prompt tokens queued for prefill, and the measured rate.

A request's prompt tokens are *queued* from the moment the replica hands it to the engine until
its first token comes back. The prefill rate is the prompt tokens whose first token came back
over the time during which some prefill work was pending (the engine's prefill throughput under
the decode load it had), measured over windows of at least `min_tokens` and smoothed. A rate not
re-measured for `forget_after_s` is forgotten: the router falls back to its prior.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class PrefillMeter:
    def __init__(
        self,
        min_tokens: int = 2048,
        weight: float = 0.3,
        forget_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._min_tokens = min_tokens
        self._weight = weight
        self._forget_after_s = forget_after_s
        self._clock = clock
        self.queued_tokens = 0
        self._last = clock()
        self._busy_s = 0.0  # time with prefill pending, this window
        self._tokens = 0  # tokens prefilled, this window
        self._rate: float | None = None
        self._measured_at = 0.0

    def _advance(self) -> float:
        now = self._clock()
        if self.queued_tokens > 0:
            self._busy_s += now - self._last
        self._last = now
        return now

    def queued(self, tokens: int) -> None:
        self._advance()
        self.queued_tokens += tokens

    def prefilled(self, tokens: int, cached: int = 0) -> None:
        """The request's first token came back: its prompt was prefilled, but for the `cached`
        tokens the engine found in its prefix cache (counted as prefilled, the rate would be
        the cache's, not the engine's)."""
        self._advance()
        self.queued_tokens -= tokens
        self._tokens += tokens - min(cached, tokens)

    def dropped(self, tokens: int) -> None:
        """The request ended before its first token (aborted or failed)."""
        self._advance()
        self.queued_tokens -= tokens

    def rate(self) -> float | None:
        """Prompt tokens prefilled per second, or None while unmeasured (or forgotten)."""
        now = self._advance()
        if self._tokens >= self._min_tokens and self._busy_s > 0:
            sample = self._tokens / self._busy_s
            old = self._rate
            self._rate = sample if old is None else (1 - self._weight) * old + self._weight * sample
            self._measured_at = now
            self._tokens, self._busy_s = 0, 0.0
        if self._rate is not None and now - self._measured_at > self._forget_after_s:
            self._rate = None
        return self._rate


class RecentRate:
    """Events per second over the last `window_s`."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()

    def add(self, n: int = 1) -> None:
        self._events.append((self._clock(), n))

    def per_s(self) -> float:
        cutoff = self._clock() - self._window_s
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()
        return sum(n for _, n in self._events) / self._window_s
