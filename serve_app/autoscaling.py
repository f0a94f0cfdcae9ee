"""Per-pool autoscaling on engine queue depth, as a Ray Serve custom autoscaling policy.

Serve's default policy scales on ongoing requests per replica (queued at handles + in the
replica). For an LLM engine that count mixes requests being decoded, which a replica handles
fine in one batch, with requests the engine's scheduler could not admit yet (its waiting queue),
which are what hurts TTFT. This policy keeps Serve's ongoing-request target and adds replicas in
proportion to the engines' own waiting queues, reported by each replica's
`record_autoscaling_stats()`. Bounds, delays and scaling factors are applied by Serve around it.
"""

from __future__ import annotations

from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingContext

WAITING_METRIC = "engine_waiting"
POLICY_PATH = "serve_app.autoscaling:EngineQueuePolicy"


def desired_replicas(
    current: int, ongoing_desired: float, engine_waiting: float, target_waiting_per_replica: float
) -> float:
    """Replicas wanted: Serve's ongoing-request answer, or more while engines queue requests."""
    if engine_waiting <= 0 or current == 0:
        return ongoing_desired
    by_queue = current + engine_waiting / target_waiting_per_replica
    return max(ongoing_desired, by_queue)


class EngineQueuePolicy:
    """`autoscaling_config.policy` of a pool deployment (policy_kwargs give the target)."""

    def __init__(self, target_waiting_per_replica: float = 4.0) -> None:
        if target_waiting_per_replica <= 0:
            raise ValueError("target_waiting_per_replica must be positive")
        self.target_waiting_per_replica = target_waiting_per_replica

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        ongoing_desired, state = replica_queue_length_autoscaling_policy(ctx)
        per_replica = (ctx.aggregated_metrics or {}).get(WAITING_METRIC, {})
        waiting = float(sum(per_replica.values()))
        desired = desired_replicas(
            ctx.current_num_replicas, ongoing_desired, waiting, self.target_waiting_per_replica
        )
        return desired, dict(state)
