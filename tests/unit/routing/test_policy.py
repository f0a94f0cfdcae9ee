"""The routing policy, with no Ray and no engine: tables of cases, then invariants."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.routing.config import LatencyPrior, RoutingConfig
from serve_app.routing.estimator import LatencyModel
from serve_app.routing.policy import (
    PoolView,
    Reject,
    RejectReason,
    RequestFeatures,
    RouteReason,
    RouteTo,
    decide,
    decide_plain,
    predict,
    slo_ratio,
)
from serve_app.routing.slo import SLO

NOW = 1000.0
CONFIG = RoutingConfig(max_waiting_per_replica=8, fit_margin=0.8)
FAST = LatencyPrior(
    ttft_base_ms=20,
    ttft_ms_per_prompt_token=0.0,
    ttft_ms_per_waiting_request=20,
    tpot_base_ms=4,
    tpot_ms_per_running_request=0.0,
)
SLOW = LatencyPrior(
    ttft_base_ms=100,
    ttft_ms_per_prompt_token=0.0,
    ttft_ms_per_waiting_request=40,
    tpot_base_ms=10,
    tpot_ms_per_running_request=0.0,
)


def pool(
    name: str,
    max_len: int = 2048,
    prior: LatencyPrior = FAST,
    replicas: int = 1,
    waiting: int = 0,
    running: int = 0,
) -> PoolView:
    return PoolView(name, max_len, replicas, waiting, running, LatencyModel(prior), NOW)


LOW = pool("low-latency", 2048, FAST)
THR = pool("throughput", 8192, SLOW)


def req(prompt: int = 100, max_tokens: int = 100) -> RequestFeatures:
    return RequestFeatures(prompt, max_tokens)


CASES = [
    # (id, features, slo, pools, expected pool or reject reason, expected route reason)
    (
        "tight-ttft-only-fast-fits",
        req(),
        SLO("i", ttft_ms=50),
        [LOW, THR],
        "low-latency",
        "slo-fit",
    ),
    (
        "loose-ttft-best-fit-slow",
        req(),
        SLO("s", ttft_ms=1000),
        [LOW, THR],
        "throughput",
        "slo-fit",
    ),
    (
        "long-prompt-only-long-pool",
        req(3000),
        SLO("s", ttft_ms=1000),
        [LOW, THR],
        "throughput",
        "slo-fit",
    ),
    (
        "saturated-best-fit-spills",
        req(),
        SLO("s", ttft_ms=1000),
        [LOW, replace(THR, waiting=8)],
        "low-latency",
        "spillover",
    ),
    (
        "meets-only-without-margin",
        req(),
        SLO("i", ttft_ms=22),
        [LOW, THR],
        "low-latency",
        "slo-tight",
    ),
    ("no-target-fastest", req(), SLO("batch"), [LOW, THR], "low-latency", "fastest"),
    (
        "best-effort-least-bad",
        req(),
        SLO("i", ttft_ms=5, best_effort=True),
        [LOW, THR],
        "low-latency",
        "best-effort",
    ),
    ("unmeetable", req(), SLO("i", ttft_ms=5), [LOW, THR], RejectReason.SLO_UNMEETABLE, 429),
    (
        "all-saturated",
        req(),
        SLO("s", ttft_ms=10_000, best_effort=True),
        [replace(LOW, waiting=8), replace(THR, waiting=9)],
        RejectReason.SATURATED,
        429,
    ),
    ("prompt-too-long", req(9000, 10), SLO("s"), [LOW, THR], RejectReason.PROMPT_TOO_LONG, 400),
    (
        "max-tokens-too-large",
        req(100, 8100),
        SLO("s"),
        [LOW, THR],
        RejectReason.MAX_TOKENS_TOO_LARGE,
        400,
    ),
    (
        "no-replicas",
        req(),
        SLO("s", ttft_ms=1000),
        [replace(LOW, replicas=0)],
        RejectReason.NO_REPLICA,
        503,
    ),
    (
        "stale-view",
        req(),
        SLO("s", ttft_ms=1000),
        [replace(LOW, updated_at=NOW - 60)],
        RejectReason.NO_REPLICA,
        503,
    ),
    (
        "queue-raises-prediction",
        req(),
        SLO("i", ttft_ms=90),
        [replace(LOW, waiting=5), THR],
        RejectReason.SLO_UNMEETABLE,
        429,
    ),
    (
        "replicas-share-the-queue",
        req(),
        SLO("i", ttft_ms=100),
        [replace(LOW, waiting=5, replicas=5), THR],
        "low-latency",
        "slo-fit",
    ),
]


@pytest.mark.parametrize(
    ("features", "slo", "pools", "want", "detail"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decision_table(
    features: RequestFeatures, slo: SLO, pools: list[PoolView], want: object, detail: object
) -> None:
    decision = decide(features, slo, pools, CONFIG, NOW)
    if isinstance(want, RejectReason):
        assert isinstance(decision, Reject), decision
        assert (decision.reason, decision.status) == (want, detail)
    else:
        assert isinstance(decision, RouteTo), decision
        assert (decision.pool, decision.reason.value) == (want, detail)


def test_length_rejects_name_the_parameter() -> None:
    too_long = decide(req(9000, 10), SLO("s"), [LOW, THR], CONFIG, NOW)
    assert isinstance(too_long, Reject) and too_long.param == "input_tokens"
    too_many = decide(req(100, 8100), SLO("s"), [LOW, THR], CONFIG, NOW)
    assert isinstance(too_many, Reject) and too_many.param == "max_tokens"
    assert "at most 8092" in too_many.message


def test_reject_for_latency_carries_retry_after() -> None:
    decision = decide(req(), SLO("i", ttft_ms=100), [replace(LOW, waiting=7)], CONFIG, NOW)
    assert isinstance(decision, Reject) and decision.status == 429
    assert decision.retry_after_s is not None and decision.retry_after_s >= 1


def test_learned_factor_changes_the_choice() -> None:
    slo = SLO("i", ttft_ms=150)
    assert decide(req(), slo, [LOW, THR], CONFIG, NOW) == RouteTo(
        "throughput", RouteReason.SLO_FIT, predict(THR, req())
    )
    # throughput turned out 3x slower than its prior: it no longer fits
    model = THR.model
    for _ in range(20):
        model = model.learn(100, 0, 0, ttft_ms=300, tpot_ms=None, rate=0.3)
    slower = replace(THR, model=model)
    decision = decide(req(), slo, [LOW, slower], CONFIG, NOW)
    assert isinstance(decision, RouteTo) and decision.pool == "low-latency"


# --- invariants ----------------------------------------------------------------------------

priors = st.builds(
    LatencyPrior,
    ttft_base_ms=st.floats(1, 500),
    ttft_ms_per_prompt_token=st.floats(0, 1),
    ttft_ms_per_waiting_request=st.floats(0, 200),
    tpot_base_ms=st.floats(1, 50),
    tpot_ms_per_running_request=st.floats(0, 2),
)
pools_st = st.lists(
    st.builds(
        PoolView,
        name=st.sampled_from(["a", "b", "c", "d", "e", "f", "g", "h"]),
        max_model_len=st.sampled_from([512, 2048, 4096, 8192]),
        replicas=st.integers(0, 4),
        waiting=st.integers(0, 64),
        running=st.integers(0, 64),
        model=st.builds(LatencyModel, priors, st.floats(0.1, 10), st.floats(0.1, 10)),
        updated_at=st.just(NOW),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda p: p.name,
)
slos = st.builds(
    SLO,
    slo_class=st.just("x"),
    ttft_ms=st.none() | st.floats(1, 5000),
    tpot_ms=st.none() | st.floats(1, 200),
    best_effort=st.booleans(),
)
features_st = st.builds(RequestFeatures, st.integers(1, 9000), st.integers(1, 4000))


@settings(max_examples=400, deadline=None)
@given(features_st, slos, pools_st)
def test_never_routes_to_a_pool_too_short(
    features: RequestFeatures, slo: SLO, pools: list[PoolView]
) -> None:
    decision = decide(features, slo, pools, CONFIG, NOW)
    if isinstance(decision, RouteTo):
        chosen = next(p for p in pools if p.name == decision.pool)
        assert chosen.max_model_len >= features.prompt_tokens + features.max_tokens
        assert chosen.replicas > 0


@settings(max_examples=400, deadline=None)
@given(features_st, slos, pools_st)
def test_rejects_for_latency_only_when_every_pool_misses(
    features: RequestFeatures, slo: SLO, pools: list[PoolView]
) -> None:
    decision = decide(features, slo, pools, CONFIG, NOW)
    if isinstance(decision, Reject) and decision.reason is RejectReason.SLO_UNMEETABLE:
        need = features.prompt_tokens + features.max_tokens
        for p in pools:
            if p.max_model_len >= need and p.replicas > 0:
                waiting_per_replica = p.waiting / p.replicas
                saturated = waiting_per_replica >= CONFIG.max_waiting_per_replica
                assert saturated or slo_ratio(predict(p, features), slo) > 1.0


@settings(max_examples=400, deadline=None)
@given(features_st, slos, pools_st)
def test_best_effort_never_rejects_for_latency(
    features: RequestFeatures, slo: SLO, pools: list[PoolView]
) -> None:
    decision = decide(features, replace(slo, best_effort=True), pools, CONFIG, NOW)
    if isinstance(decision, Reject):
        assert decision.reason is not RejectReason.SLO_UNMEETABLE


@settings(max_examples=200, deadline=None)
@given(features_st, slos, pools_st)
def test_routed_within_slo_unless_best_effort(
    features: RequestFeatures, slo: SLO, pools: list[PoolView]
) -> None:
    decision = decide(features, slo, pools, CONFIG, NOW)
    if isinstance(decision, RouteTo) and decision.reason is not RouteReason.BEST_EFFORT:
        assert slo_ratio(decision.predicted, slo) <= 1.0


def test_round_robin_alternates_over_pools_long_enough() -> None:
    chosen = [decide_plain(req(), [LOW, THR], NOW, turn, None) for turn in range(4)]
    assert [d.pool for d in chosen if isinstance(d, RouteTo)] == [
        "low-latency",
        "throughput",
        "low-latency",
        "throughput",
    ]
    long = decide_plain(req(3000), [LOW, THR], NOW, 0, None)
    assert isinstance(long, RouteTo) and long.pool == "throughput"


def test_plain_policies_never_refuse_for_latency() -> None:
    busy = replace(LOW, waiting=1000)
    decision = decide_plain(req(), [busy], NOW, 0, "low-latency")
    assert isinstance(decision, RouteTo) and decision.reason is RouteReason.SINGLE_POOL
    too_long = decide_plain(req(3000), [LOW, THR], NOW, 0, "low-latency")
    assert isinstance(too_long, Reject) and too_long.param == "input_tokens"
