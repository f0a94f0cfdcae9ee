"""How many stream messages a replica may send per second: set by what its consumers can take.

Each chunk carries the time it was sent; the ingress measures how late chunks reach it (the lag:
transport plus its own queue) and reports it per pool through the pool state board, which hands
the worst lag back to the pool's replicas with every report they make (4 times a second). A
replica shrinks its message budget when consumers fall behind and grows it back while they keep
up (additive increase, multiplicative decrease, like TCP's congestion window). With N streams
open, each stream then sends at most one message per N / budget seconds (engine.replica), but
never waits longer than MAX_GAP_S: at the floor, 200 streams would each have waited 4 s, holding
a whole completion back after its first token (on one H200 at 1.5x and 2x capacity, 2-4 s holds
of every stream of a pool were most of the interactive TPOT misses: docs/results/goodput.md).
"""

from __future__ import annotations

from dataclasses import dataclass

TARGET_LAG_MS = 10.0  # consumers this late or later: send fewer, larger messages
MIN_BUDGET = 50.0  # messages per second per replica, whatever the lag
DECREASE = 0.7
INCREASE = 0.1  # of the ceiling, per report without lag
# The longest a stream is held between messages. A hold of g adds at most g to the stream's end,
# g / (n - 1) to the TPOT of n tokens: 0.5 ms per token over 100, 20 updates a second on a page.
MAX_GAP_S = 0.05
# A stream's share of the message budget below this is not worth a timer: an engine step takes
# longer, so the next output is not ready sooner anyway.
MIN_COALESCE_S = 0.002


@dataclass(slots=True)
class MessageBudget:
    ceiling: float  # the profile's stream_messages_per_s
    current: float = 0.0

    def __post_init__(self) -> None:
        self.current = self.current or self.ceiling

    def update(self, consumer_lag_ms: float | None) -> float:
        """Adjust to the lag consumers reported (None: no report, keep the budget)."""
        if consumer_lag_ms is None:
            return self.current
        if consumer_lag_ms > TARGET_LAG_MS:
            self.current = max(MIN_BUDGET, self.current * DECREASE)
        else:
            self.current = min(self.ceiling, self.current + INCREASE * self.ceiling)
        return self.current

    def gap_s(self, streams: int) -> float:
        """How long a stream waits after a message before taking the next output."""
        return min(streams / self.current, MAX_GAP_S)
