"""Latency prediction per pool: the serving path's measured delay, plus the wait behind the
pool's queue and the request's own prefill, each times a learned factor.

    ttft_ms = path_ms
              + (ms_per_prefill_token * queued_tokens + ttft_per_waiting_request * waiting)
                * wait_factor
              + (ttft_base + ms_per_prefill_token * prompt_tokens
                 + ttft_per_running_request * running) * ttft_factor
    tpot_ms = (tpot_base + tpot_per_running_request * (running + 1)
               + tpot_per_prefill_token * min(queued_tokens, step_tokens)) * tpot_factor

All loads are per replica. A new request waits behind the prompt tokens already queued for
prefill, so the queue is measured in tokens: `ms_per_prefill_token` is 1000 / the pool's prefill
rate as its replicas measure it (tokens prefilled per second while prefill work was pending), or
the prior's value until a replica has measured one. Decode steps share each engine step with
queued prefill (chunked prefill), up to the step's token budget: that is the TPOT term.

Each request's measured TTFT (at its first token) and TPOT (at its end) move the pool's factor
towards measured / unscaled prediction by an exponentially weighted average. When the request's
TTFT breakdown is known (serve_app/timing.py), its time outside the engine's queue and prefill
(Serve's proxy, the ingress, the hops to and from the replica, the engine's input and output
processing) is learned apart, as `path_ms`, and the factors from the engine's part alone: a
serving path slowed by load (a proxy or replica event loop at its limit, requests held for a
replica slot) then shows in every prediction at once, whatever the request's length. The
engine's part splits again, by vLLM's own timestamps: its time in the scheduler's queue teaches
`wait_factor` (against the predicted wait behind the queued prompt tokens and requests) and its
prefill `ttft_factor` (against its own prefill). One factor over both could not fit two shapes
of request on one pool: on one H200 the documents' own prefill (7,000 tokens) ran faster than
the measured prefill rate says while the queue ahead ran slower (the queue counted from this
ingress and a board a few hundred ms old, the engine sharing its GPU), so the shared factor
settled between them and short interactive requests queued behind documents saw 1.6x their
predicted TTFT at the median (docs/results/goodput.md). Without
new measurements the factors relax back to 1 (the prior) and the path delay to 0 with a
half-life, so one stall cannot keep a pool's predictions high, and its traffic refused, after
the stall has passed. The path delay relaxes faster than the factors: it is the part of a TTFT
that load outside the engine adds (requests that waited for a replica slot behind a flood, an
event loop at its limit), so it ends with that load, and a pool that refuses everything learns
nothing new. Learned from requests that waited seconds for a slot, at the factors' half-life
it kept an idle pool refusing for tens of seconds (docs/results/goodput.md, one H200).

A request admitted to a pool also slows the requests already decoding there: its prefill (and
the prefill queued ahead of it) shares their engine steps, adding about its prefill time to
each one's decode (chunked prefill spreads the work, not its cost). `Decoding` tracks one
streaming request's *slack*: how much more delay its decode can take and still meet its TPOT
target, the rest of its decode at its own pace when nothing stalls it (the median of its
latest inter-chunk gaps: a stall it sat through is spent budget, not its pace). A pool admits
a request only while the prefill pending after it fits in the smallest slack of the requests
decoding there that can still meet their target (routing/policy.py). A request still queued
there is protected too (`Queued`): the prompts queued after it are prefilled while it decodes,
so each new prompt must fit in what the prompts already queued after it left of its slack.
Without it, a burst of documents admitted while none decoded passed the check one by one and
then stalled each other's decodes, every one missing its TPOT target (goodput.md, CPU).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from serve_app.routing.config import LatencyPrior

_FACTOR_BOUNDS = (0.02, 50.0)
# A predicted wait shorter than this teaches the wait factor nothing (a ratio of noise to ~0)
_MIN_WAIT_MS = 1.0
DEFAULT_HALF_LIFE_S = 10.0
DEFAULT_PATH_HALF_LIFE_S = 2.0
DEFAULT_STEP_TOKENS = 2048  # vLLM's token budget per step when a profile sets none


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class Load:
    """A pool's load per replica: prompt tokens queued for prefill, requests waiting, running."""

    queued_tokens: float = 0.0
    waiting: float = 0.0
    running: float = 0.0


class Factors(NamedTuple):
    ttft: float  # the request's own engine work: the base, its prefill, the running batch
    wait: float  # its wait in the engine's queue, behind queued prompt tokens and requests
    tpot: float


@dataclass(frozen=True, slots=True)
class LatencyModel:
    prior: LatencyPrior
    ttft_factor: float = 1.0
    tpot_factor: float = 1.0
    wait_factor: float = 1.0
    path_ms: float = 0.0  # learned time of the serving path outside the engine's queue, prefill
    learned_at: float = 0.0  # when the factors last moved (time.time())
    half_life_s: float = DEFAULT_HALF_LIFE_S
    path_half_life_s: float = DEFAULT_PATH_HALF_LIFE_S  # how fast path_ms relaxes to 0
    measured_ms_per_token: float | None = None  # from the replicas' prefill rate
    step_tokens: int = (
        DEFAULT_STEP_TOKENS  # the engines' token budget per step (max_num_batched_tokens)
    )

    @property
    def ms_per_prefill_token(self) -> float:
        if self.measured_ms_per_token is not None:
            return self.measured_ms_per_token
        return self.prior.ttft_ms_per_prompt_token

    def with_prefill_rate(self, tokens_per_s: float | None) -> LatencyModel:
        ms = 1000.0 / tokens_per_s if tokens_per_s else None
        return self if ms == self.measured_ms_per_token else replace(self, measured_ms_per_token=ms)

    def _keep(self, now: float, half_life_s: float) -> float:
        age = max(0.0, now - self.learned_at)
        return 0.5 ** (age / half_life_s) if half_life_s > 0 else 1.0

    def factors(self, now: float) -> Factors:
        """The learned factors as of `now`: relaxed towards 1 by the time since they last moved."""
        keep = self._keep(now, self.half_life_s)
        return Factors(
            1 + (self.ttft_factor - 1) * keep,
            1 + (self.wait_factor - 1) * keep,
            1 + (self.tpot_factor - 1) * keep,
        )

    def path(self, now: float) -> float:
        """The learned path delay as of `now`, relaxed towards 0 (its own half-life)."""
        return self.path_ms * self._keep(now, self.path_half_life_s)

    def _own_ms(self, prompt_tokens: int, load: Load) -> float:
        """Unscaled TTFT of the request's own engine work: its prefill beside the running batch."""
        p = self.prior
        return (
            p.ttft_base_ms
            + self.ms_per_prefill_token * prompt_tokens
            + p.ttft_ms_per_running_request * load.running
        )

    def _wait_ms(self, load: Load) -> float:
        """Unscaled wait in the engine's queue, behind the prompt tokens and requests there."""
        return (
            self.ms_per_prefill_token * load.queued_tokens
            + self.prior.ttft_ms_per_waiting_request * load.waiting
        )

    def _tpot_ms(self, load: Load) -> float:
        """Unscaled TPOT: the batch it decodes in, and the prefill sharing its steps."""
        p = self.prior
        return (
            p.tpot_base_ms
            + p.tpot_ms_per_running_request * (load.running + 1)
            + p.tpot_ms_per_prefill_token * min(load.queued_tokens, self.step_tokens)
        )

    def unscaled(self, prompt_tokens: int, load: Load) -> Prediction:
        """The prediction from the prior (with the measured prefill rate), no learned factor."""
        return Prediction(
            self._own_ms(prompt_tokens, load) + self._wait_ms(load), self._tpot_ms(load)
        )

    def predict(self, prompt_tokens: int, load: Load, now: float) -> Prediction:
        """Latency of a new request given the per-replica load."""
        f = self.factors(now)
        ttft_ms = (
            self.path(now)
            + self._own_ms(prompt_tokens, load) * f.ttft
            + self._wait_ms(load) * f.wait
        )
        return Prediction(ttft_ms, self._tpot_ms(load) * f.tpot)

    def learn(
        self,
        prompt_tokens: int,
        load: Load,
        ttft_ms: float | None,
        tpot_ms: float | None,
        rate: float,
        now: float,
        path_ms: float | None = None,
        queue_ms: float | None = None,
    ) -> LatencyModel:
        """The model after one measurement, taken with the load seen when the request was routed.

        `path_ms`: the part of `ttft_ms` spent outside the engine's queue and prefill, when the
        request's breakdown says; the factors then learn from the rest. `queue_ms`: of that
        rest, the time in the engine's queue (the remainder is the request's own prefill).
        """
        own_ms, wait_ms = self._own_ms(prompt_tokens, load), self._wait_ms(load)
        raw_tpot_ms = self._tpot_ms(load)
        ttft_factor, wait_factor, tpot_factor = self.factors(now)
        path = self.path(now)
        if ttft_ms is not None and own_ms + wait_ms > 0:
            engine_ms = ttft_ms
            if path_ms is not None:
                path = (1 - rate) * path + rate * max(0.0, path_ms)
                engine_ms = max(0.0, ttft_ms - path_ms)
            if path_ms is None or queue_ms is None:  # no split: both learn the whole
                whole = engine_ms / (own_ms + wait_ms)
                ttft_factor, wait_factor = (
                    _ewma(ttft_factor, whole, rate),
                    _ewma(wait_factor, whole, rate),
                )
            elif wait_ms < _MIN_WAIT_MS and own_ms > 0:  # nothing predicted ahead: all its own
                ttft_factor = _ewma(ttft_factor, engine_ms / own_ms, rate)
            elif own_ms > 0:
                queue_ms = min(max(0.0, queue_ms), engine_ms)
                wait_factor = _ewma(wait_factor, queue_ms / wait_ms, rate)
                ttft_factor = _ewma(ttft_factor, (engine_ms - queue_ms) / own_ms, rate)
        if tpot_ms is not None and raw_tpot_ms > 0:
            tpot_factor = _ewma(tpot_factor, tpot_ms / raw_tpot_ms, rate)
        return replace(
            self,
            ttft_factor=ttft_factor,
            wait_factor=wait_factor,
            tpot_factor=tpot_factor,
            path_ms=path,
            learned_at=now,
        )


_PACE_GAPS = 32  # the latest inter-chunk gaps a decode's pace is the median of


@dataclass(slots=True, eq=False)  # one per request: kept in sets by identity
class Decoding:
    """One streaming request with a TPOT target, from its first token (wall clock) on."""

    tpot_target_ms: float
    max_tokens: int  # the completion length it may reach (the remaining decode is bounded by it)
    predicted_tpot_ms: float  # what routing predicted, its pace until it has measured its own
    first_at: float  # time.time() of its first token
    tokens: int = 1  # completion tokens so far
    last_at: float | None = None  # time.time() of its latest chunk (None: only the first)
    # ms per token of each of its latest chunks after the first
    gaps_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_PACE_GAPS))
    # the median of `gaps_ms`, kept from one chunk to the next: admission reads every decode's
    # pace for each decision, far more often than a stream's chunks come
    _pace_ms: float | None = field(default=None, init=False, repr=False)
    _paced: bool = field(default=False, init=False, repr=False)

    def advance(self, tokens: int, now: float) -> None:
        """A chunk came at `now`, bringing the completion to `tokens` tokens."""
        new = tokens - self.tokens
        if new <= 0:
            return
        since = self.first_at if self.last_at is None else self.last_at
        self.gaps_ms.append((now - since) * 1e3 / new)
        self.tokens, self.last_at = tokens, now
        self._paced = False

    def pace_ms(self) -> float:
        """Its time per output token when nothing stalls it: the median of its latest gaps (the
        prediction until it has two). A prefill that stalled it once is one gap, not its pace,
        so a request that sat through one stall still counts as one admission must protect."""
        measured = self.measured_pace_ms()
        return self.predicted_tpot_ms if measured is None else measured

    def measured_pace_ms(self) -> float | None:
        """Its pace as measured (None until it has two gaps)."""
        if not self._paced:
            gaps = self.gaps_ms
            self._pace_ms = statistics.median(gaps) if len(gaps) >= 2 else None
            self._paced = True
        return self._pace_ms

    def slack_ms(self, now: float) -> float:
        """Delay its decode can still take and meet the target, the rest of it at its pace
        (negative: it will miss it anyway)."""
        remaining = max(0, self.max_tokens - self.tokens)
        elapsed_ms = max(0.0, now - self.first_at) * 1e3
        budget_ms = self.tpot_target_ms * max(1, self.max_tokens - 1)
        return budget_ms - elapsed_ms - remaining * self.pace_ms()


def decode_pace_ms(paces: Iterable[float | None]) -> float | None:
    """The pace a pool's engine keeps now: the median of its decoding requests' measured paces
    (None: none measured yet). Continuous batching gives every request decoding on one engine a
    token per step, so each measures the same step time, stalls aside."""
    measured = [p for p in paces if p is not None]
    return statistics.median(measured) if measured else None


def decode_slack_ms(decoding: Iterable[Decoding], now: float) -> float | None:
    """The smallest slack of the requests that can still meet their TPOT target (None: none
    can, or none is decoding: admission protects no one)."""
    slacks = [s for s in (d.slack_ms(now) for d in decoding) if s >= 0]
    return min(slacks, default=None)


@dataclass(slots=True, eq=False)  # one per request: kept in ordered sets by identity
class Queued:
    """One request with a TPOT target, dispatched and waiting for its first token. Its decode
    will share its engine's steps with every prefill queued after it, so those prefills spend
    its slack before it has a token: the whole budget, less its decode at its predicted pace."""

    tpot_target_ms: float
    max_tokens: int
    predicted_tpot_ms: float
    prompt_tokens: int
    dispatched_at: float = 0.0  # time.time(): orders the queues of several ingresses as one
    # time.time() by which its first token must come to meet its TTFT target (None: it has
    # none): past it the request has missed its SLO, and admission no longer protects it
    ttft_deadline: float | None = None

    def overdue(self, now: float) -> bool:
        return self.ttft_deadline is not None and now > self.ttft_deadline

    def slack_ms(self) -> float:
        return (self.tpot_target_ms - self.predicted_tpot_ms) * max(1, self.max_tokens - 1)


@dataclass(frozen=True, slots=True)
class Protected:
    """What one ingress's admission protects on one pool: shared through the pool-state
    board, so that each ingress protects the requests the others dispatched too (each knows
    its own at once, the others' a board round trip late)."""

    decode_slack_ms: float | None  # the smallest slack of its requests decoding there
    queued: tuple[Queued, ...] = ()  # its requests waiting there for a first token, in order
    decode_pace_ms: float | None = None  # the pace its requests decoding there keep (measured)


def queued_slack_ms(
    queued: Iterable[Queued], ms_per_prefill_token: float, now: float = 0.0
) -> float | None:
    """The prefill time a new request's prompt may add to one pool's engine without making a
    request queued there (in dispatch order, oldest first) miss its TPOT target: the smallest
    slack left once the prompts queued after each are counted. A request those prompts
    already make miss is not protected (as a decode that misses anyway is not), nor one past
    its TTFT deadline at `now` (it has missed its SLO): None when no queued request can still
    meet its target."""
    slack: float | None = None
    after = 0  # prompt tokens queued after the one at hand
    for q in reversed(list(queued)):
        left = q.slack_ms() - after * ms_per_prefill_token
        if left >= 0 and not q.overdue(now):
            slack = left if slack is None else min(slack, left)
        after += q.prompt_tokens
    return slack


def _ewma(old: float, sample: float, rate: float) -> float:
    lo, hi = _FACTOR_BOUNDS
    return min(hi, max(lo, (1 - rate) * old + rate * sample))
