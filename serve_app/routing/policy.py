"""The routing policy: a pure function of request features, SLO, pool views and the clock.

    decide(features, slo, pools, config, now) -> RouteTo | Reject

1. Pools whose max_model_len cannot hold prompt + max_tokens are out; if none is left the request
   is a client error (400, param `input_tokens` when the prompt alone is too long, else
   `max_tokens`).
2. Pools with no live replica (or a stale view) are out; none left: 503 with Retry-After.
3. Each pool's TTFT and TPOT are predicted from its load per replica (routing/estimator.py:
   prompt tokens queued for prefill over the measured prefill rate, waiting and running requests).
   A request's *ratio* on a pool is its worst predicted/target latency (0 when it names no
   targets).
4. A pool is *saturated* when its queue per replica reaches `max_waiting_per_replica`. A pool
   *protects* its running requests when the prefill pending after this request (queued tokens
   plus its prompt, at the pool's prefill rate) fits in the smallest decode slack of the
   requests streaming there, or on a pool sharing its device, that can still meet their TPOT
   target, and its prompt in what is left of the slack of each request queued there for its
   first token (routing/estimator.py): a request that would make them miss is not theirs to
   take.
5. Among unsaturated pools that protect their running requests and whose ratio is at most
   `fit_margin`, the configured placement picks: **headroom** (the default, see README: lowest
   ratio, most room before a miss), **best fit** (highest ratio: the slowest pool that still
   fits, keeping fast pools free), or **least load** (fewest requests per replica). If the
   pick over all pools was saturated, the reason is `spillover`. Pools that meet the SLO only
   without margin come next (lowest ratio first).
   Requests without targets go to the pool predicted to finish them soonest (one that protects
   its running requests, if any does).
6. No pool meets the SLO: reject 429 with Retry-After (the time the best pool's queue needs to
   drain below the target; reason `protects-running` when a pool would meet it but must protect
   its running requests; the ingress may hold such a request while its TTFT target allows,
   and decide again), unless the request asked for best effort: then the lowest ratio wins.
   A refusal for lack of capacity names the pool that would have met the SLO idle
   (`demand_pool`): refused demand counts towards that pool's autoscaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from serve_app.constants import STATS_STALE_AFTER_S
from serve_app.routing.config import Placement, RoutingConfig
from serve_app.routing.estimator import LatencyModel, Load, Prediction
from serve_app.routing.slo import SLO


class RouteReason(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    SINGLE_POOL = "single-pool"
    SLO_FIT = "slo-fit"
    SLO_TIGHT = "slo-tight"
    SPILLOVER = "spillover"
    BEST_EFFORT = "best-effort"
    FASTEST = "fastest"  # no latency target: soonest predicted completion


class RejectReason(StrEnum):
    PROMPT_TOO_LONG = "prompt-too-long"
    MAX_TOKENS_TOO_LARGE = "max-tokens-too-large"
    NO_REPLICA = "no-replica"
    SATURATED = "saturated"
    SLO_UNMEETABLE = "slo-unmeetable"
    PROTECTS_RUNNING = "protects-running"


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    prompt_tokens: int
    max_tokens: int  # the completion length latency is predicted for
    # False: the request set no max_tokens; vLLM generates up to the rest of the context, so a
    # pool fits when it holds the prompt (max_tokens is then only the length predicted)
    max_tokens_set: bool = True

    @property
    def context_tokens(self) -> int:
        """The context a pool must hold to take the request."""
        return self.prompt_tokens + (self.max_tokens if self.max_tokens_set else 1)


@dataclass(frozen=True, slots=True)
class PoolView:
    """What the policy knows of one pool (per-pool sums; divided per replica here)."""

    name: str
    max_model_len: int
    replicas: int
    waiting: int
    running: int
    model: LatencyModel
    updated_at: float
    queued_tokens: int = 0  # prompt tokens dispatched and not yet prefilled
    # smallest decode slack of the requests streaming there (or on a pool sharing its device)
    # that can still meet their TPOT target (routing/estimator.py `Decoding`); None: no one to
    # protect
    decode_slack_ms: float | None = None
    # the prefill time a new prompt may add there without making a request queued for its
    # first token (there or on a pool sharing its device) miss its TPOT target (`Queued`)
    queued_slack_ms: float | None = None
    # the pace its requests decoding now keep, ms a token (None: none measured): a floor under
    # its predicted TPOT
    decode_pace_ms: float | None = None

    @property
    def load(self) -> Load:
        r = max(self.replicas, 1)
        return Load(self.queued_tokens / r, self.waiting / r, self.running / r)


@dataclass(frozen=True, slots=True)
class RouteTo:
    pool: str
    reason: RouteReason
    predicted: Prediction
    load: Load  # the pool's load per replica the decision saw (what routing later learns with)


@dataclass(frozen=True, slots=True)
class Reject:
    status: int
    reason: RejectReason
    message: str
    retry_after_s: float | None = None
    param: str | None = None
    demand_pool: str | None = None  # refused for lack of capacity: the pool that lacked it
    # protects-running: the lowest TTFT predicted on a pool that would take the request once
    # its running requests can spare the prefill (how long the request may still wait for it)
    wait_ttft_ms: float | None = None


Decision = RouteTo | Reject


def predict(pool: PoolView, features: RequestFeatures, now: float) -> Prediction:
    pred = pool.model.predict(features.prompt_tokens, pool.load, now)
    pace = pool.decode_pace_ms
    if pace is not None and pace > pred.tpot_ms:  # its engines' steps take this long now
        return Prediction(pred.ttft_ms, pace)
    return pred


def _saturated(pool: PoolView, config: RoutingConfig) -> bool:
    return pool.load.waiting >= config.max_waiting_per_replica


def pending_prefill_ms(pool: PoolView, features: RequestFeatures) -> float:
    """Prefill time the pool's engine steps carry once this request is queued: what its
    running requests' decodes are slowed by."""
    tokens = pool.load.queued_tokens + features.prompt_tokens
    return tokens * pool.model.ms_per_prefill_token


def protects(pool: PoolView, features: RequestFeatures) -> bool:
    """Taking the request leaves every request decoding or queued on the pool (and on the
    pools sharing its device) within its TPOT target: those decoding share their steps with all
    the prefill pending, those queued with the prompts queued after them."""
    decode = pool.decode_slack_ms
    if decode is not None and pending_prefill_ms(pool, features) > decode:
        return False
    queued = pool.queued_slack_ms
    return queued is None or features.prompt_tokens * pool.model.ms_per_prefill_token <= queued


def _requests_per_replica(pool: PoolView) -> float:
    return pool.load.waiting + pool.load.running


def slo_ratio(pred: Prediction, slo: SLO) -> float:
    """Worst predicted/target latency over the targets the SLO sets (0 when it sets none)."""
    ratios = [0.0]
    if slo.ttft_ms:
        ratios.append(pred.ttft_ms / slo.ttft_ms)
    if slo.tpot_ms:
        ratios.append(pred.tpot_ms / slo.tpot_ms)
    return max(ratios)


def _length_reject(features: RequestFeatures, pools: list[PoolView]) -> Reject:
    longest = max((p.max_model_len for p in pools), default=0)
    if features.prompt_tokens >= longest:
        return Reject(
            400,
            RejectReason.PROMPT_TOO_LONG,
            f"prompt has {features.prompt_tokens} tokens; the longest context served is {longest}",
            param="input_tokens",
        )
    return Reject(
        400,
        RejectReason.MAX_TOKENS_TOO_LARGE,
        f"prompt ({features.prompt_tokens} tokens) + max_tokens ({features.max_tokens}) exceeds "
        f"the longest context served ({longest}); lower max_tokens to at most "
        f"{longest - features.prompt_tokens}",
        param="max_tokens",
    )


def _retry_after_s(
    pool: PoolView, pred: Prediction, slo: SLO, config: RoutingConfig, now: float
) -> float:
    """Time for the pool's queue to shrink until the TTFT target could be met."""
    load = pool.load
    per_request_ms = pool.model.prior.ttft_ms_per_waiting_request * pool.model.factors(now).wait
    excess_ms = pred.ttft_ms - (slo.ttft_ms or pred.ttft_ms)
    drain_ms = max(excess_ms, (load.waiting - config.max_waiting_per_replica + 1) * per_request_ms)
    return max(1.0, math.ceil(drain_ms / 1000.0))


def _demand_pool(features: RequestFeatures, slo: SLO, pools: list[PoolView]) -> str | None:
    """The pool that would meet the SLO with no load (lowest idle ratio, from the prior: the
    learned factors carry the present load): a refusal for want of its capacity is demand for
    more of it. None when even an idle pool would miss."""
    idle = [
        (slo_ratio(p.model.unscaled(features.prompt_tokens, Load()), slo), p.name) for p in pools
    ]
    ratio, name = min(idle)
    return name if ratio <= 1.0 else None


def _place(
    fits: list[tuple[PoolView, Prediction]], ratios: dict[str, float], placement: Placement
) -> tuple[PoolView, Prediction]:
    if placement is Placement.BEST_FIT:
        return max(fits, key=lambda pp: ratios[pp[0].name])
    if placement is Placement.LEAST_LOAD:
        return min(fits, key=lambda pp: (_requests_per_replica(pp[0]), ratios[pp[0].name]))
    return min(fits, key=lambda pp: ratios[pp[0].name])


def decide(
    features: RequestFeatures,
    slo: SLO,
    pools: list[PoolView],
    config: RoutingConfig,
    now: float,
) -> Decision:
    long_enough = [p for p in pools if p.max_model_len >= features.context_tokens]
    if not long_enough:
        return _length_reject(features, pools)
    live = [p for p in long_enough if p.replicas > 0 and now - p.updated_at <= STATS_STALE_AFTER_S]
    if not live:
        return Reject(503, RejectReason.NO_REPLICA, "no replica is ready to serve this request", 5)

    scored = [(p, predict(p, features, now)) for p in live]
    ratios = {p.name: slo_ratio(pred, slo) for p, pred in scored}
    open_ = [(p, pred) for p, pred in scored if not _saturated(p, config)]
    safe = [(p, pred) for p, pred in open_ if protects(p, features)]

    if slo.ttft_ms is None and slo.tpot_ms is None:
        if open_:
            p, pred = min(
                safe or open_, key=lambda pp: pp[1].ttft_ms + pp[1].tpot_ms * features.max_tokens
            )
            return RouteTo(p.name, RouteReason.FASTEST, pred, p.load)
    else:
        fits = [(p, pred) for p, pred in safe if ratios[p.name] <= config.fit_margin]
        if fits:
            p, pred = _place(fits, ratios, config.placement)
            overall, _ = _place(
                [pp for pp in scored if ratios[pp[0].name] <= config.fit_margin],
                ratios,
                config.placement,
            )
            reason = RouteReason.SPILLOVER if overall.name != p.name else RouteReason.SLO_FIT
            return RouteTo(p.name, reason, pred, p.load)
        meets = [(p, pred) for p, pred in safe if ratios[p.name] <= 1.0]
        if meets:
            p, pred = min(meets, key=lambda pp: ratios[pp[0].name])
            return RouteTo(p.name, RouteReason.SLO_TIGHT, pred, p.load)
        if open_ and slo.best_effort:
            p, pred = min(open_, key=lambda pp: ratios[pp[0].name])
            return RouteTo(p.name, RouteReason.BEST_EFFORT, pred, p.load)

    best, best_pred = min(scored, key=lambda pp: ratios[pp[0].name])
    retry = _retry_after_s(best, best_pred, slo, config, now)
    demand = _demand_pool(features, slo, live)
    if not open_:
        return Reject(
            429, RejectReason.SATURATED, "every pool that fits is saturated", retry, None, demand
        )
    crowded = [
        (p, pred) for p, pred in open_ if ratios[p.name] <= 1.0 and not protects(p, features)
    ]
    if crowded:
        return Reject(
            429,
            RejectReason.PROTECTS_RUNNING,
            f"taking it on {', '.join(p.name for p, _ in crowded)} would make requests decoding "
            "or queued there (or on a pool sharing its device) miss their TPOT target",
            retry,
            None,
            demand,
            min(pred.ttft_ms for _, pred in crowded),
        )
    return Reject(
        429,
        RejectReason.SLO_UNMEETABLE,
        f"no pool is predicted to meet the SLO (best: {best.name}, predicted TTFT "
        f"{best_pred.ttft_ms:.0f} ms, TPOT {best_pred.tpot_ms:.1f} ms)",
        retry,
        None,
        demand,
    )


def decide_plain(
    features: RequestFeatures,
    pools: list[PoolView],
    now: float,
    turn: int,
    only: str | None,
    least_load: bool = False,
) -> Decision:
    """The baselines SLO routing is compared with: round-robin over the pools long enough for
    the request (`only` None), the one of them with the fewest requests per replica
    (`least_load`), or a single pool. None predicts latency or refuses for it."""
    candidates = [p for p in pools if only is None or p.name == only]
    long_enough = [p for p in candidates if p.max_model_len >= features.context_tokens]
    if not long_enough:
        return _length_reject(features, candidates)
    live = [p for p in long_enough if p.replicas > 0 and now - p.updated_at <= STATS_STALE_AFTER_S]
    if not live:
        return Reject(503, RejectReason.NO_REPLICA, "no replica is ready to serve this request", 5)
    pool = live[turn % len(live)]
    reason = RouteReason.SINGLE_POOL if only else RouteReason.ROUND_ROBIN
    if least_load and not only:
        # ties (an idle fleet) in turn, as round-robin
        order = {p.name: (i - turn) % len(live) for i, p in enumerate(live)}
        pool = min(live, key=lambda p: (_requests_per_replica(p), order[p.name]))
        reason = RouteReason.LEAST_LOAD
    return RouteTo(pool.name, reason, predict(pool, features, now), pool.load)
