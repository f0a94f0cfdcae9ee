"""Prefill accounting in one replica: prompt tokens queued for prefill, and the measured rate.

A request's prompt tokens are *queued* from the moment the replica hands it to the engine until
its first token comes back. The prefill rate is the prompt tokens the engine computed for those
requests over the time during which one of them was pending (the union of their spans from
queued to first token: the engine's prefill throughput under the decode load it had), measured
over windows of at least `min_tokens` and smoothed. A request that computed fewer than
`min_request_tokens` (a short prompt, or one found mostly in the prefix cache) is left out, its
tokens and its time alike: its first token took a step's time, not a per-token rate, and counted
it would make the rate a fraction of the engine's. A rate not re-measured for `forget_after_s`
is forgotten: the router falls back to its prior.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable


def _union_s(spans: Iterable[tuple[float, float, int]]) -> float:
    """Seconds covered by at least one of the (start, end, _) spans."""
    total, reach = 0.0, float("-inf")
    for start, end, _ in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class PrefillMeter:
    def __init__(
        self,
        min_tokens: int = 2048,
        weight: float = 0.3,
        forget_after_s: float = 30.0,
        min_request_tokens: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._min_tokens = min_tokens
        self._weight = weight
        self._forget_after_s = forget_after_s
        self._min_request_tokens = min_request_tokens
        self._clock = clock
        self.queued_tokens = 0
        # measured requests of this window, in the order their first tokens came back:
        # (queued at, first token at, tokens computed)
        self._spans: deque[tuple[float, float, int]] = deque()
        self._tokens = 0  # tokens computed, this window
        self._rate: float | None = None
        self._measured_at = 0.0

    def queued(self, tokens: int) -> float:
        """A request of `tokens` prompt tokens went to the engine: when (for `prefilled`)."""
        self.queued_tokens += tokens
        return self._clock()

    def prefilled(self, tokens: int, since: float, cached: int = 0) -> None:
        """The first token came back for the request queued at `since`: its prompt was
        prefilled, but for the `cached` tokens the engine found in its prefix cache."""
        self.queued_tokens -= tokens
        computed = tokens - min(cached, tokens)
        if computed >= self._min_request_tokens:
            self._spans.append((since, self._clock(), computed))
            self._tokens += computed

    def dropped(self, tokens: int) -> None:
        """The request ended before its first token (aborted or failed)."""
        self.queued_tokens -= tokens

    def rate(self) -> float | None:
        """Prompt tokens prefilled per second, or None while unmeasured (or forgotten)."""
        now = self._clock()
        while self._spans and now - self._spans[0][1] > self._forget_after_s:
            self._tokens -= self._spans.popleft()[2]  # too old to measure with the rest
        if self._tokens >= self._min_tokens:
            busy_s = _union_s(self._spans)
            if busy_s > 0:
                sample = self._tokens / busy_s
                old = self._rate
                self._rate = (
                    sample if old is None else (1 - self._weight) * old + self._weight * sample
                )
                self._measured_at = now
                self._spans.clear()
                self._tokens = 0
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
