"""Per-pool autoscaling on engine queue depth, as a Ray Serve custom autoscaling policy.

Serve's default policy scales on ongoing requests per replica (queued at handles + in the
replica). For an LLM engine that count mixes requests being decoded, which a replica handles
fine in one batch, with requests the engine's scheduler could not admit yet (its waiting queue),
which are what hurts TTFT. This policy keeps Serve's ongoing-request target and adds replicas in
proportion to the engines' own waiting queues, reported by each replica's
`record_autoscaling_stats()`: one more replica per `target_waiting_per_replica` waiting requests
(Serve rounds the answer up, so a queue below the target adds none). Requests that came by
direct dispatch (engine/direct.py) are not Serve's ongoing requests: the replicas report them,
and the ongoing-request answer counts them with Serve's. Requests the ingress refused
because this pool lacked the capacity to meet their SLO are demand too: once they are over
REFUSED_SHARE of the pool's demand, the pool is sized for arrivals + refusals at its current
arrivals per replica (one more replica when nothing got through). While a pool still refuses
requests for want of capacity, however few, it keeps its target: no replica is removed and none
still starting is cancelled (a share hovering about REFUSED_SHARE would otherwise scale it up
and down, stopping each new replica before its engine is up). Bounds, delays and scaling factors
are applied by Serve around it.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingContext

WAITING_METRIC = "engine_waiting"
ARRIVALS_METRIC = "arrivals_per_s"
REFUSED_METRIC = "refused_per_s"
DIRECT_METRIC = "direct_ongoing"  # requests in flight that came by direct dispatch
REFUSED_SHARE = 0.1  # refusals below this share of a pool's demand do not scale it
POLICY_PATH = "serve_app.autoscaling:EngineQueuePolicy"

logger = logging.getLogger("ray.serve")


def desired_replicas(
    current: int,
    ongoing_desired: float,
    engine_waiting: float,
    target_waiting_per_replica: float,
    arrivals_per_s: float = 0.0,
    refused_per_s: float = 0.0,
    target: int = 0,
) -> float:
    """Replicas wanted: Serve's ongoing-request answer, or more while engines queue requests or
    the ingress refuses requests for want of this pool's capacity; never below `target` (the
    replicas asked for, running or starting) while any are refused."""
    if current == 0:
        return ongoing_desired
    desired = ongoing_desired
    if refused_per_s > 0:
        desired = max(desired, target)
    if engine_waiting > 0:
        desired = max(desired, current + math.floor(engine_waiting / target_waiting_per_replica))
    if refused_per_s > REFUSED_SHARE * (arrivals_per_s + refused_per_s):
        if arrivals_per_s > 0:
            by_demand = current * (arrivals_per_s + refused_per_s) / arrivals_per_s
        else:
            by_demand = current + 1
        desired = max(desired, by_demand)
    return desired


def with_direct(ctx: AutoscalingContext, direct: float) -> AutoscalingContext:
    """`ctx` with `direct` more ongoing requests (direct dispatch's, which Serve does not see).
    A copy: Serve reads its own context after the policy. Its totals are cached properties,
    so the copy's value is set where the property keeps it."""
    if direct <= 0:
        return ctx
    counted = copy.copy(ctx)
    counted.__dict__["total_num_requests"] = ctx.total_num_requests + direct
    return counted


class EngineQueuePolicy:
    """`autoscaling_config.policy` of a pool deployment (policy_kwargs give the target)."""

    def __init__(self, target_waiting_per_replica: float = 4.0) -> None:
        if target_waiting_per_replica <= 0:
            raise ValueError("target_waiting_per_replica must be positive")
        self.target_waiting_per_replica = target_waiting_per_replica
        self._turn = 0  # 1: wants more replicas than its target, -1: fewer, 0: as many
        self._turned_at = 0.0  # when it last turned
        self._said = True  # the current turn has been logged (or needs no line)

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}

        def total(name: str) -> float:
            return float(sum(metrics.get(name, {}).values()))

        ongoing_desired, state = replica_queue_length_autoscaling_policy(
            with_direct(ctx, total(DIRECT_METRIC))
        )

        waiting, arrivals, refused = (
            total(WAITING_METRIC),
            total(ARRIVALS_METRIC),
            total(REFUSED_METRIC),
        )
        desired = desired_replicas(
            ctx.current_num_replicas,
            ongoing_desired,
            waiting,
            self.target_waiting_per_replica,
            arrivals,
            refused,
            ctx.target_num_replicas,
        )
        # Serve logs its decisions, not why: once the pool has wanted more (or fewer) replicas
        # than its target for the scaling delay, when Serve acts on it, say what it saw.
        wanted = min(
            max(math.ceil(desired), ctx.capacity_adjusted_min_replicas),
            ctx.capacity_adjusted_max_replicas,
        )
        turn = (wanted > ctx.target_num_replicas) - (wanted < ctx.target_num_replicas)
        now = ctx.current_time or time.time()
        if turn != self._turn:
            self._turn, self._turned_at, self._said = turn, now, turn == 0
        config = ctx.config
        delay_s = 0.0
        if config is not None:
            delay_s = config.upscale_delay_s if turn > 0 else config.downscale_delay_s
        if not self._said and now - self._turned_at >= delay_s:
            self._said = True
            logger.info(
                "%s wants %d replicas (target %d, %d running): ongoing requests want %.2f; "
                "%.0f waiting in engines, %.2f arrivals/s, %.2f refused/s",
                ctx.deployment_name,
                wanted,
                ctx.target_num_replicas,
                ctx.current_num_replicas,
                ongoing_desired,
                waiting,
                arrivals,
                refused,
            )
        return desired, dict(state)
