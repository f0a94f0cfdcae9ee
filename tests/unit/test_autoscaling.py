import logging
from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_app.autoscaling import (
    ARRIVALS_METRIC,
    DIRECT_METRIC,
    REFUSED_METRIC,
    WAITING_METRIC,
    EngineQueuePolicy,
    desired_replicas,
)


def test_no_queue_keeps_serves_answer() -> None:
    assert desired_replicas(2, 1.5, 0, 4) == 1.5


def test_queue_adds_replicas_in_proportion() -> None:
    assert desired_replicas(1, 1.0, 8, 4) == 3.0
    assert desired_replicas(2, 5.0, 4, 4) == 5.0  # Serve already wants more
    assert desired_replicas(2, 2.0, 3, 4) == 2.0  # below the target: none (Serve rounds up)


def test_refused_demand_sizes_the_pool_for_arrivals_plus_refusals() -> None:
    # 2 replicas take 10 req/s and 15 req/s more are refused: 2 * 25 / 10
    assert desired_replicas(2, 2.0, 0, 4, arrivals_per_s=10, refused_per_s=15) == 5.0
    # nothing got through: one more replica
    assert desired_replicas(1, 1.0, 0, 4, arrivals_per_s=0, refused_per_s=3) == 2.0
    assert desired_replicas(2, 2.0, 0, 4, arrivals_per_s=10, refused_per_s=0) == 2.0
    # a refusal now and then (under a tenth of the demand) is no reason to scale
    assert desired_replicas(2, 2.0, 0, 4, arrivals_per_s=10, refused_per_s=1) == 2.0


def context(
    current: int,
    ongoing: float,
    waiting: dict[str, float],
    extra: dict[str, dict[str, float]] | None = None,
) -> AutoscalingContext:
    dep = DeploymentID(name="pool-x", app_name="llm")
    replicas = [ReplicaID(unique_id=rid, deployment_id=dep) for rid in waiting]
    metrics: dict[str, Any] = {WAITING_METRIC: dict(zip(replicas, waiting.values(), strict=True))}
    for name, values in (extra or {}).items():
        metrics[name] = dict(zip(replicas, values.values(), strict=True))
    return AutoscalingContext(
        deployment_id=dep,
        deployment_name="pool-x",
        app_name="llm",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=replicas,
        total_num_requests=ongoing,
        total_queued_requests=0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=8),
    )


def test_policy_reads_engine_waiting_from_replica_stats() -> None:
    policy = EngineQueuePolicy(target_waiting_per_replica=2)
    desired, _ = policy(context(1, ongoing=8, waiting={"a": 6}))
    assert desired == pytest.approx(4.0)  # 1 + 6 / 2; ongoing alone would keep 1


def test_policy_follows_ongoing_requests_when_engines_keep_up() -> None:
    policy = EngineQueuePolicy(target_waiting_per_replica=2)
    desired, _ = policy(context(2, ongoing=4, waiting={"a": 0, "b": 0}))
    assert desired == pytest.approx(0.5)  # 4 ongoing / 8 target per replica: scale down


def test_policy_counts_direct_requests_as_ongoing_with_serves() -> None:
    """Requests that came by direct dispatch are not in Serve's count: the replicas report them
    and the policy adds them, else a pool busy with them would be scaled down."""
    policy = EngineQueuePolicy(target_waiting_per_replica=2)
    ctx = context(2, ongoing=4, waiting={"a": 0, "b": 0}, extra={DIRECT_METRIC: {"a": 12, "b": 16}})
    desired, _ = policy(ctx)
    assert desired == pytest.approx(4.0)  # (4 + 28) ongoing / 8 per replica
    assert ctx.total_num_requests == 4  # Serve's own context is left as it was


def test_policy_reads_refused_demand_from_replica_stats() -> None:
    policy = EngineQueuePolicy(target_waiting_per_replica=1000)
    extra = {ARRIVALS_METRIC: {"a": 4.0}, REFUSED_METRIC: {"a": 8.0}}
    desired, _ = policy(context(1, ongoing=2, waiting={"a": 0}, extra=extra))
    assert desired == pytest.approx(3.0)  # 1 * (4 + 8) / 4


def test_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        EngineQueuePolicy(0)


def test_a_pool_that_still_refuses_keeps_its_target() -> None:
    # one replica running, a second starting (target 2); refusals fell to a twentieth of the
    # demand: not enough to scale up, but the starting replica is not cancelled
    assert desired_replicas(1, 0.1, 0, 4, arrivals_per_s=19, refused_per_s=1, target=2) == 2.0
    assert desired_replicas(2, 0.1, 0, 4, arrivals_per_s=19, refused_per_s=1, target=2) == 2.0
    # no refusals: Serve's answer, and the pool may shrink
    assert desired_replicas(1, 0.1, 0, 4, arrivals_per_s=19, refused_per_s=0, target=2) == 0.1


def test_policy_holds_a_scale_up_in_flight_while_refusing() -> None:
    policy = EngineQueuePolicy(target_waiting_per_replica=1000)
    extra = {ARRIVALS_METRIC: {"a": 19.0}, REFUSED_METRIC: {"a": 1.0}}
    ctx = context(1, ongoing=2, waiting={"a": 0}, extra=extra)
    ctx.target_num_replicas = 2
    desired, _ = policy(ctx)
    assert desired == pytest.approx(2.0)


def test_policy_says_why_once_the_wish_outlasts_the_delay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = EngineQueuePolicy(target_waiting_per_replica=2)

    def at(t: float, waiting: float) -> None:
        ctx = context(1, ongoing=8, waiting={"a": waiting})
        ctx.current_time = t
        policy(ctx)

    delay = context(1, ongoing=8, waiting={"a": 6}).config.upscale_delay_s
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        at(1000.0, 6)  # wants 4: Serve waits for the delay; so does the log
        at(1000.0 + delay / 2, 0)  # back to its target: the wish is gone
        at(1000.0 + delay, 6)  # wants 4 again, anew
        assert not caplog.records
        at(1000.0 + 2 * delay, 6)  # for the whole delay: Serve scales now
        at(1000.0 + 3 * delay, 6)  # said once
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("pool-x wants 4 replicas (target 1, 1 running)"), line
    assert "6 waiting in engines" in line
