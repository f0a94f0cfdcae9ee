"""The routing policy, with no Ray and no engine: tables of cases, then invariants."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.routing.config import LatencyPrior, Placement, RoutingConfig
from serve_app.routing.estimator import LatencyModel, Load
from serve_app.routing.policy import (
    PoolView,
    Reject,
    RejectReason,
    RequestFeatures,
    RouteReason,
    RouteTo,
    decide,
    decide_plain,
    pending_prefill_ms,
    predict,
    slo_ratio,
)
from serve_app.routing.slo import SLO

NOW = 1000.0
# The decision table runs best fit, the placement whose cases are the subtlest; the others
# have their own tests below.
CONFIG = RoutingConfig(max_waiting_per_replica=8, fit_margin=0.8, placement=Placement.BEST_FIT)
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
        "throughput", RouteReason.SLO_FIT, predict(THR, req(), NOW), THR.load
    )
    # throughput turned out 3x slower than its prior: it no longer fits
    model = THR.model
    for _ in range(20):
        model = model.learn(100, Load(), ttft_ms=300, tpot_ms=None, rate=0.3, now=NOW)
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
                assert saturated or slo_ratio(predict(p, features, NOW), slo) > 1.0


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


def test_least_load_baseline_takes_the_pool_with_fewer_requests() -> None:
    busy_low = replace(LOW, waiting=2, running=6)
    decision = decide_plain(req(), [busy_low, replace(THR, running=3)], NOW, 0, None, True)
    assert isinstance(decision, RouteTo)
    assert (decision.pool, decision.reason) == ("throughput", RouteReason.LEAST_LOAD)
    # an idle fleet: in turn
    idle = [decide_plain(req(), [LOW, THR], NOW, t, None, True) for t in range(2)]
    assert {d.pool for d in idle if isinstance(d, RouteTo)} == {"low-latency", "throughput"}


# --- queueing in prefill tokens, placement, demand ------------------------------------------

PER_TOKEN = FAST.model_copy(
    update={"ttft_ms_per_prompt_token": 0.05, "ttft_ms_per_waiting_request": 0}
)


def test_queued_prefill_tokens_raise_the_prediction() -> None:
    idle = pool("a", prior=PER_TOKEN)
    queued = replace(idle, queued_tokens=20_000, waiting=2)
    assert predict(idle, req(100), NOW).ttft_ms == pytest.approx(20 + 0.05 * 100)
    # 20,000 tokens ahead at 0.05 ms each: a second more, whatever the request count
    assert predict(queued, req(100), NOW).ttft_ms == pytest.approx(20 + 0.05 * 20_100)
    two_replicas = replace(queued, replicas=2)
    assert predict(two_replicas, req(100), NOW).ttft_ms == pytest.approx(20 + 0.05 * 10_100)
    decision = decide(req(100), SLO("i", ttft_ms=500), [queued], CONFIG, NOW)
    assert isinstance(decision, Reject) and decision.reason is RejectReason.SLO_UNMEETABLE


def test_measured_prefill_rate_replaces_the_prior() -> None:
    measured = pool("a", prior=PER_TOKEN, running=0)
    measured = replace(measured, queued_tokens=10_000, model=measured.model.with_prefill_rate(1e6))
    assert predict(measured, req(0), NOW).ttft_ms == pytest.approx(20 + 10_000 * 1e-3)


def test_queued_prefill_slows_decoding_up_to_the_step_budget() -> None:
    prior = FAST.model_copy(update={"tpot_ms_per_prefill_token": 0.01})
    p = replace(pool("a", prior=prior), model=LatencyModel(prior, step_tokens=1000))
    assert predict(replace(p, queued_tokens=500), req(), NOW).tpot_ms == pytest.approx(4 + 5)
    assert predict(replace(p, queued_tokens=50_000), req(), NOW).tpot_ms == pytest.approx(4 + 10)


@pytest.mark.parametrize(
    ("placement", "want"),
    [
        (Placement.HEADROOM, "low-latency"),  # ratio 0.02 vs 0.1
        (Placement.BEST_FIT, "throughput"),
        (Placement.LEAST_LOAD, "throughput"),  # 0 requests vs 3
    ],
)
def test_placement_when_several_pools_fit(placement: Placement, want: str) -> None:
    config = replace_config(placement)
    busy_low = replace(LOW, running=3)
    decision = decide(req(), SLO("s", ttft_ms=1000), [busy_low, THR], config, NOW)
    assert isinstance(decision, RouteTo) and decision.pool == want


def replace_config(placement: Placement) -> RoutingConfig:
    return CONFIG.model_copy(update={"placement": placement})


def test_refusal_for_capacity_names_the_pool_that_lacked_it() -> None:
    queued = replace(pool("low-latency", prior=PER_TOKEN), queued_tokens=20_000)
    decision = decide(req(100), SLO("i", ttft_ms=500), [queued], CONFIG, NOW)
    assert isinstance(decision, Reject) and decision.demand_pool == "low-latency"
    saturated = decide(req(100), SLO("i", ttft_ms=500), [replace(LOW, waiting=9)], CONFIG, NOW)
    assert isinstance(saturated, Reject) and saturated.demand_pool == "low-latency"
    # even an idle pool would miss 5 ms: more replicas would not help
    hopeless = decide(req(100), SLO("i", ttft_ms=5), [LOW], CONFIG, NOW)
    assert isinstance(hopeless, Reject) and hopeless.demand_pool is None


def test_learned_factors_relax_to_the_prior_without_measurements() -> None:
    model = LatencyModel(FAST, half_life_s=10)
    for _ in range(30):
        model = model.learn(100, Load(), ttft_ms=800, tpot_ms=None, rate=0.5, now=NOW)
    stalled = model.predict(100, Load(), NOW).ttft_ms
    assert stalled > 700  # a stall: the prediction follows it
    assert model.factors(NOW + 30)[0] == pytest.approx(1 + (model.ttft_factor - 1) / 8)
    assert model.predict(100, Load(), NOW + 300).ttft_ms == pytest.approx(20, rel=1e-3)
    # so a pool refused during the stall is admitted again once it has passed
    p = replace(LOW, model=model)
    fresh = replace(p, updated_at=NOW + 120)  # the board kept reporting the idle pool
    assert isinstance(decide(req(), SLO("i", ttft_ms=100), [p], CONFIG, NOW), Reject)
    assert isinstance(decide(req(), SLO("i", ttft_ms=100), [fresh], CONFIG, NOW + 120), RouteTo)


def test_a_path_delay_learned_behind_a_flood_ends_with_the_flood() -> None:
    """Requests load-balanced past the pool's replica slots waited seconds to be dispatched
    while the engine stayed fast (one H200, 2x capacity, round-robin): that wait is learned as
    path delay. Once the flood has gone, the idle pool must take interactive requests again
    within seconds, although no new measurement arrives while it refuses them."""
    model = LatencyModel(FAST, half_life_s=10)
    raw = model.unscaled(100, Load()).ttft_ms
    for _ in range(40):
        model = model.learn(100, Load(), raw + 5000, None, rate=0.2, now=NOW, path_ms=5000)
    assert model.path(NOW) == pytest.approx(5000, rel=1e-3)
    flooded = replace(LOW, model=model)
    assert isinstance(decide(req(), SLO("i", ttft_ms=250), [flooded], CONFIG, NOW), Reject)
    idle = replace(flooded, updated_at=NOW + 10)  # the board kept reporting the idle pool
    assert isinstance(decide(req(), SLO("i", ttft_ms=250), [idle], CONFIG, NOW + 10), RouteTo)


def test_a_slow_serving_path_is_learned_apart_from_the_engine() -> None:
    """Requests held up outside the engine (a replica slot, a busy proxy) while the engine's
    queue and prefill stay fast: the path delay is learned as such, and every prediction of the
    pool carries it, long prompts and short alike."""
    model = LatencyModel(FAST, half_life_s=10)
    raw = model.unscaled(100, Load()).ttft_ms
    for _ in range(40):  # 300 ms outside the engine, the engine exactly as the prior says
        model = model.learn(100, Load(), raw + 300, None, rate=0.3, now=NOW, path_ms=300)
    assert model.path(NOW) == pytest.approx(300, rel=1e-3)
    assert model.factors(NOW)[0] == pytest.approx(1.0, rel=1e-3)
    long_raw = model.unscaled(1000, Load()).ttft_ms
    assert model.predict(1000, Load(), NOW).ttft_ms == pytest.approx(300 + long_raw, rel=1e-3)
    # so admission refuses what the path alone makes late, and admits again once it recovers
    slow = replace(LOW, model=model)
    assert isinstance(decide(req(), SLO("i", ttft_ms=250), [slow], CONFIG, NOW), Reject)
    assert model.path(NOW + 2) == pytest.approx(300 / 2, rel=1e-3)  # path_half_life_s
    recovered = replace(slow, updated_at=NOW + 60)
    assert isinstance(decide(req(), SLO("i", ttft_ms=250), [recovered], CONFIG, NOW + 60), RouteTo)


def test_without_a_breakdown_the_factor_learns_the_whole_ttft() -> None:
    model = LatencyModel(FAST)
    raw = model.unscaled(100, Load()).ttft_ms
    for _ in range(40):
        model = model.learn(100, Load(), raw * 2, None, rate=0.3, now=NOW)
    assert model.path(NOW) == 0.0 and model.factors(NOW)[0] == pytest.approx(2.0, rel=1e-3)


# prefill at 1,000 tokens per second: a 3,000-token document stalls the decodes it joins 3 s
PREFILLING = LatencyModel(SLOW, measured_ms_per_token=1.0)


def test_a_document_that_would_make_the_running_requests_miss_is_refused() -> None:
    doc, slo = req(3000, 32), SLO("s", ttft_ms=10_000, tpot_ms=150)
    thr = replace(THR, model=PREFILLING, running=2)
    assert pending_prefill_ms(thr, doc) == pytest.approx(3000)
    assert isinstance(decide(doc, slo, [thr], CONFIG, NOW), RouteTo)  # no one to protect
    roomy = decide(doc, slo, [replace(thr, decode_slack_ms=3500)], CONFIG, NOW)
    assert isinstance(roomy, RouteTo)
    crowded = decide(doc, slo, [replace(thr, decode_slack_ms=2500)], CONFIG, NOW)
    assert isinstance(crowded, Reject) and crowded.reason is RejectReason.PROTECTS_RUNNING
    assert crowded.status == 429 and "throughput" in crowded.message
    # how long it may still wait for them: the TTFT the pool is predicted to give it
    assert crowded.wait_ttft_ms == pytest.approx(predict(thr, doc, NOW).ttft_ms)
    # the prefill queued ahead of it stalls them as well
    queued = replace(thr, decode_slack_ms=3500, queued_tokens=1000)
    assert isinstance(decide(doc, slo, [queued], CONFIG, NOW), Reject)


def test_a_document_that_would_make_the_queued_documents_miss_is_refused() -> None:
    """Documents admitted while none decodes are protected from each other as well: each one
    queued decodes while the prompts queued after it prefill."""
    doc, slo = req(3000, 32), SLO("s", ttft_ms=10_000, tpot_ms=150)
    thr = replace(THR, model=PREFILLING)  # its 3,000-token prompt costs 3 s
    assert isinstance(decide(doc, slo, [replace(thr, queued_slack_ms=3500)], CONFIG, NOW), RouteTo)
    crowded = decide(doc, slo, [replace(thr, queued_slack_ms=2500)], CONFIG, NOW)
    assert isinstance(crowded, Reject) and crowded.reason is RejectReason.PROTECTS_RUNNING
    assert "queued" in crowded.message
    # only its own prompt counts against them: the prefill queued ahead of it runs before
    # their decodes
    ahead = replace(thr, queued_slack_ms=3500, queued_tokens=3000)
    assert isinstance(decide(doc, slo, [ahead], CONFIG, NOW), RouteTo)


def test_a_short_request_still_fits_beside_the_decodes_a_document_would_break() -> None:
    thr = replace(THR, model=PREFILLING, decode_slack_ms=500)
    short = decide(req(100, 32), SLO("s", ttft_ms=10_000, tpot_ms=150), [thr], CONFIG, NOW)
    assert isinstance(short, RouteTo) and short.pool == "throughput"


def test_a_request_goes_where_it_breaks_no_one_when_another_pool_fits() -> None:
    slo = SLO("s", ttft_ms=1000)  # best fit alone would pick the slower pool
    crowded_thr = replace(THR, model=PREFILLING, decode_slack_ms=50)
    decision = decide(req(), slo, [LOW, crowded_thr], CONFIG, NOW)
    assert isinstance(decision, RouteTo) and decision.pool == "low-latency"
    prefilling_low = LatencyModel(FAST, measured_ms_per_token=1.0)
    crowded_low = replace(LOW, model=prefilling_low, decode_slack_ms=0)
    no_target = decide(req(), SLO("b"), [crowded_low, THR], CONFIG, NOW)
    assert isinstance(no_target, RouteTo) and no_target.pool == "throughput"


def test_the_pace_decoding_requests_keep_is_a_floor_under_the_predicted_tpot() -> None:
    """The model predicts 10 ms a token on the throughput pool; its decoding requests keep
    200 ms a token now (prefills stall their steps): a 150 ms TPOT target is not met there."""
    doc, slo = req(3000, 32), SLO("s", ttft_ms=10_000, tpot_ms=150)
    assert isinstance(decide(doc, slo, [replace(THR, decode_pace_ms=20)], CONFIG, NOW), RouteTo)
    slow = decide(doc, slo, [replace(THR, decode_pace_ms=200)], CONFIG, NOW)
    assert isinstance(slow, Reject) and slow.reason is RejectReason.SLO_UNMEETABLE
    assert "TPOT 200.0 ms" in slow.message
