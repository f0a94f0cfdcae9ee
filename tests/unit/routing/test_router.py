import pytest

from serve_app.engine.protocol import EngineStats, Placement, ReplicaReport
from serve_app.pool_state import PROTECTED_STALE_AFTER_S, PoolSnapshot, PoolStateBoard
from serve_app.routing.config import LatencyPrior, Policy, RoutingConfig
from serve_app.routing.estimator import Decoding, LatencyModel, Load, Queued
from serve_app.routing.policy import Reject, RejectReason, RequestFeatures, RouteTo
from serve_app.routing.router import VIEWS_REUSE_S, Router
from serve_app.routing.slo import SLO

NOW = 1000.0


def router() -> Router:
    r = Router({"a": 2048}, RoutingConfig(max_waiting_per_replica=3))
    r.update({"a": PoolSnapshot("a", replicas=1, updated_at=NOW)})
    return r


def test_local_dispatches_count_until_the_board_catches_up() -> None:
    r = router()
    features, slo = RequestFeatures(10, 10), SLO("s", ttft_ms=10_000)
    for _ in range(3):
        assert isinstance(r.decide(features, slo, NOW), RouteTo)
        r.dispatched("a", 10)
    # three requests wait for a first token: the pool is saturated for this ingress
    assert not isinstance(r.decide(features, slo, NOW), RouteTo)
    assert r.views(NOW)[0].queued_tokens == 30
    r.first_token("a", 10)
    view = r.views(NOW)[0]
    assert (view.waiting, view.running, view.queued_tokens) == (2, 1, 20)
    r.finished("a", 10, got_first_token=True)
    r.finished("a", 10, got_first_token=False)
    view = r.views(NOW)[0]
    assert (view.waiting, view.running, view.queued_tokens) == (1, 0, 10)


def test_board_counts_win_when_larger() -> None:
    r = router()
    r.dispatched("a", 10)
    r.update({"a": PoolSnapshot("a", replicas=1, waiting=5, running=7, updated_at=NOW)})
    view = r.views(NOW)[0]
    assert (view.waiting, view.running) == (5, 7)


def test_learning_moves_the_factor_towards_measurements() -> None:
    r = router()
    load = Load()
    before = r.model("a").ttft_factor
    raw = LatencyModel(LatencyPrior()).predict(100, load, NOW).ttft_ms
    for _ in range(30):
        r.learn("a", 100, load, ttft_ms=raw * 3, tpot_ms=None, now=NOW)
    assert before == 1.0
    assert 2.9 < r.model("a").ttft_factor <= 3.0
    assert r.model("a").tpot_factor == 1.0


def two_pools() -> Router:
    r = Router({"a": 2048, "b": 2048}, RoutingConfig())
    r.update({name: PoolSnapshot(name, replicas=2, updated_at=NOW) for name in ("a", "b")}, now=NOW)
    return r


def test_round_robin_alternates_when_an_admission_check_runs_first() -> None:
    r = two_pools()
    features, slo = RequestFeatures(10, 10), SLO("s")
    pools = []
    for _ in range(10):
        # the ingress's early admission check, then the route step, as for every request
        r.decide(RequestFeatures(1, 1), slo, NOW, Policy.ROUND_ROBIN, commit=False)
        decision = r.decide(features, slo, NOW, Policy.ROUND_ROBIN)
        assert isinstance(decision, RouteTo)
        pools.append(decision.pool)
    assert pools == ["b", "a"] * 5


def test_many_failures_on_one_replica_count_it_once() -> None:
    r = two_pools()
    for _ in range(5):
        r.replica_failed("a", "actor_id:1", NOW)
    assert r.views(NOW)[0].replicas == 1
    r.replica_failed("a", "actor_id:2", NOW)
    assert r.views(NOW)[0].replicas == 0
    assert r.views(NOW + 10)[0].replicas == 2  # the board has had time to notice


def test_routing_goes_on_when_the_board_stops_answering() -> None:
    r = two_pools()
    later = NOW + 60  # no snapshot for a minute
    assert r.board_stale(later)
    decision = r.decide(RequestFeatures(10, 10), SLO("s", ttft_ms=10_000), later)
    assert isinstance(decision, RouteTo)
    # whereas a live board that reports no replica for a pool still takes it out
    r.update({"a": PoolSnapshot("a", updated_at=later), "b": PoolSnapshot("b")}, now=later)
    gone = r.decide(RequestFeatures(10, 10), SLO("s", ttft_ms=10_000), later)
    assert isinstance(gone, Reject) and gone.reason is RejectReason.NO_REPLICA


def test_a_placement_can_be_asked_for_per_request() -> None:
    r = Router({"a": 2048, "b": 2048}, RoutingConfig())
    busy = PoolSnapshot("a", replicas=1, running=30, updated_at=NOW)
    r.update({"a": busy, "b": PoolSnapshot("b", replicas=1, updated_at=NOW)}, now=NOW)
    features, slo = RequestFeatures(10, 10), SLO("s", ttft_ms=10_000)
    by_load = r.decide(features, slo, NOW, Policy.SLO, "least-load")
    assert isinstance(by_load, RouteTo) and by_load.pool == "b"


def test_requests_decoding_with_a_tpot_target_set_the_pool_slack_until_they_end() -> None:
    r = router()
    assert r.views(NOW)[0].decode_slack_ms is None
    d = Decoding(tpot_target_ms=40, max_tokens=11, predicted_tpot_ms=20, first_at=NOW)
    r.dispatched("a", 10)
    r.first_token("a", 10, d)
    assert r.views(NOW)[0].decode_slack_ms == pytest.approx(400 - 10 * 20)
    for i in range(2, 7):  # 5 tokens in 100 ms: 20 ms each, 5 to come
        d.advance(i, NOW + 0.02 * (i - 1))
    assert r.views(NOW + 0.1)[0].decode_slack_ms == pytest.approx(400 - 100 - 5 * 20)
    r.finished("a", 10, got_first_token=True, decoding=d)
    assert r.views(NOW + 0.1)[0].decode_slack_ms is None


def test_requests_queued_with_a_tpot_target_are_protected_until_their_first_token() -> None:
    r = router()
    r.update({"a": PoolSnapshot("a", replicas=1, updated_at=NOW, prefill_tok_s=5000)})
    assert r.views(NOW)[0].queued_slack_ms is None
    first, second = Queued(150, 25, 50, 3000), Queued(150, 25, 50, 3000)
    r.dispatched("a", 3000, first)
    r.dispatched("a", 3000, second)
    # 2,400 ms each; the first loses the second's 600 ms prefill (0.2 ms a token)
    assert r.views(NOW)[0].queued_slack_ms == pytest.approx(1800)
    d = Decoding(tpot_target_ms=150, max_tokens=25, predicted_tpot_ms=50, first_at=NOW)
    r.first_token("a", 3000, d, first)  # decoding now: protected as a decode instead
    assert r.views(NOW)[0].queued_slack_ms == pytest.approx(2400)
    assert r.views(NOW)[0].decode_slack_ms is not None
    r.finished("a", 3000, got_first_token=False, queued=second)  # failed before its first token
    assert r.views(NOW)[0].queued_slack_ms is None


def test_protecting_only_the_decoding_requests_lets_a_burst_in() -> None:
    r = Router({"a": 8192}, RoutingConfig(allow_policy_header=True))
    r.update({"a": PoolSnapshot("a", replicas=1, updated_at=NOW, prefill_tok_s=5000)})
    doc, slo = RequestFeatures(3000, 25), SLO("s", ttft_ms=60_000, tpot_ms=150)
    r.dispatched("a", 3000, Queued(150, 25, 50, 3000))
    # 2,400 ms of slack less its own 600 ms prefill: four more documents fit, not five
    for _ in range(3):
        assert isinstance(r.decide(doc, slo, NOW), RouteTo)
        r.dispatched("a", 3000, Queued(150, 25, 50, 3000))
    assert isinstance(r.decide(doc, slo, NOW), RouteTo)
    r.dispatched("a", 3000, Queued(150, 25, 50, 3000))
    refused = r.decide(doc, slo, NOW)
    assert isinstance(refused, Reject) and refused.reason is RejectReason.PROTECTS_RUNNING
    let_in = r.decide(doc, slo, NOW, Policy.SLO, "headroom:decoding")
    assert isinstance(let_in, RouteTo)


def test_a_queued_request_stops_holding_the_pool_shut_at_its_ttft_deadline() -> None:
    """Five documents queued, none with a first token yet: a sixth is refused to protect
    them. Once their TTFT deadline has passed (their answer is late, or will never come)
    they have missed their SLO: the sixth is let in."""
    r = Router({"a": 8192}, RoutingConfig())
    r.update({"a": PoolSnapshot("a", replicas=1, updated_at=NOW, prefill_tok_s=5000)})
    doc, slo = RequestFeatures(3000, 25), SLO("s", ttft_ms=60_000, tpot_ms=150)
    for _ in range(5):
        r.dispatched("a", 3000, Queued(150, 25, 50, 3000, NOW, ttft_deadline=NOW + 2))
    refused = r.decide(doc, slo, NOW + 1)
    assert isinstance(refused, Reject) and refused.reason is RejectReason.PROTECTS_RUNNING
    r.update({"a": PoolSnapshot("a", replicas=1, updated_at=NOW + 3, prefill_tok_s=5000)})
    assert isinstance(r.decide(doc, slo, NOW + 3), RouteTo)


def test_a_prefill_is_refused_where_it_would_stall_decodes_on_a_pool_sharing_its_device() -> None:
    """Two engines on one GPU slow each other's steps: a decode on `a` with 100 ms of slack
    makes `b`, which shares its device, refuse a prefill of 210 ms; a pool of its own takes it."""
    prior = LatencyPrior(ttft_ms_per_prompt_token=0.1, ttft_base_ms=0, tpot_base_ms=1)
    routed = {}
    for colocated in ([["a", "b"]], []):
        config = RoutingConfig(priors={"a": prior, "b": prior}, colocated=colocated, max_held=0)
        r = Router({"a": 2048, "b": 8192}, config)
        r.update({n: PoolSnapshot(n, replicas=1, updated_at=NOW) for n in "ab"}, now=NOW)
        # 11 tokens, target 30 ms each: 300 ms budget, 10 to come at 20 ms: 100 ms of slack
        d = Decoding(tpot_target_ms=30, max_tokens=11, predicted_tpot_ms=20, first_at=NOW)
        r.dispatched("a", 10)
        r.first_token("a", 10, d)
        document = RequestFeatures(prompt_tokens=2100, max_tokens=10)  # fits `b` only
        routed[bool(colocated)] = r.decide(document, SLO("s", ttft_ms=2000), NOW)
    refused, taken = routed[True], routed[False]
    assert isinstance(refused, Reject) and refused.reason is RejectReason.PROTECTS_RUNNING
    assert "taking it on b" in refused.message
    assert isinstance(taken, RouteTo) and taken.pool == "b"


def _placed(pool: str, *devices: tuple[str, tuple[str, ...]]) -> PoolSnapshot:
    placements = tuple(
        (f"{pool}-{i}", Placement(node_id=node, gpu_ids=gpus))
        for i, (node, gpus) in enumerate(devices)
    )
    return PoolSnapshot(pool, replicas=len(devices), updated_at=NOW, placements=placements)


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        ([("n1", ("0",))], [("n1", ("1",))], False),  # a GPU each
        ([("n1", ("0",))], [("n1", ("0",))], True),  # half of one GPU each
        ([("n1", ("0",)), ("n2", ("0",))], [("n2", ("0",))], True),  # one of a's replicas
        ([("n1", ("0",))], [("n2", ("0",))], False),  # GPU 0 of two nodes
        ([("n1", ())], [("n1", ())], True),  # one CPU
        ([("n1", ())], [("n2", ())], False),
    ],
)
def test_pools_share_a_device_where_their_replicas_report_one(
    a: list[tuple[str, tuple[str, ...]]], b: list[tuple[str, tuple[str, ...]]], shared: bool
) -> None:
    r = Router({"a": 2048, "b": 2048}, RoutingConfig())
    r.update({"a": _placed("a", *a), "b": _placed("b", *b)}, now=NOW)
    assert r.sharing("a") == (["a", "b"] if shared else ["a"])
    assert r.sharing("b") == (["a", "b"] if shared else ["b"])


def test_configured_colocation_wins_over_where_replicas_run() -> None:
    r = Router({"a": 2048, "b": 2048}, RoutingConfig(colocated=[]))
    r.update({"a": _placed("a", ("n1", ("0",))), "b": _placed("b", ("n1", ("0",)))}, now=NOW)
    assert r.sharing("a") == ["a"]


def _two_ingresses() -> tuple[Router, Router, PoolStateBoard]:
    """Two ingresses' routers on one pool `a` (prefill 0.2 ms a token) and the board between
    them, with `a`'s replica reporting to it."""
    board = PoolStateBoard(["a"])
    board.report(ReplicaReport("a", "r1", EngineStats(), 8192, NOW, prefill_tok_s=5000))
    routers = tuple(
        Router({"a": 8192}, RoutingConfig(allow_policy_header=True), ingress_id=name)
        for name in ("ingress-1", "ingress-2")
    )
    for r in routers:
        r.update(board.snapshot(NOW), now=NOW)
    return routers[0], routers[1], board


def _exchange(board: PoolStateBoard, *routers: Router, now: float = NOW) -> None:
    """Each router posts what it protects, then takes the board's state (the ingresses'
    refresh)."""
    for r in routers:
        board.protect(r._ingress_id, r.protected(now), now=now)
    for r in routers:
        r.update(board.snapshot(now), now=now)


def test_an_ingress_protects_the_requests_another_ingress_queued() -> None:
    one, two, board = _two_ingresses()
    doc, slo = RequestFeatures(3000, 25), SLO("s", ttft_ms=60_000, tpot_ms=150)
    # ingress-1 queues five documents: 2,400 ms of slack each, 600 ms a prefill, so the first
    # has none left for a sixth
    for i in range(5):
        one.dispatched("a", 3000, Queued(150, 25, 50, 3000, dispatched_at=NOW + i / 1000))
    assert isinstance(two.decide(doc, slo, NOW), RouteTo)  # before the board has it
    _exchange(board, one, two)
    assert two.views(NOW)[0].queued_slack_ms == pytest.approx(0)
    refused = two.decide(doc, slo, NOW)
    assert isinstance(refused, Reject) and refused.reason is RejectReason.PROTECTS_RUNNING
    # protecting this ingress's requests only, as before the board carried them
    assert isinstance(two.decide(doc, slo, NOW, Policy.SLO, "headroom:queued:own"), RouteTo)
    # ingress-1 does not count its own post twice
    assert one.views(NOW)[0].queued_slack_ms == pytest.approx(0)
    one.finished("a", 3000, got_first_token=False, queued=next(iter(one._queued["a"])))
    assert one.views(NOW)[0].queued_slack_ms == pytest.approx(600)


def test_queues_of_two_ingresses_are_merged_in_dispatch_order() -> None:
    one, two, board = _two_ingresses()
    # ingress-2's document came second: the prefill of ingress-1's later one spends its slack
    one.dispatched("a", 3000, Queued(150, 25, 50, 3000, dispatched_at=NOW))
    two.dispatched("a", 3000, Queued(150, 25, 50, 3000, dispatched_at=NOW + 0.1))
    one.dispatched("a", 1000, Queued(150, 25, 50, 1000, dispatched_at=NOW + 0.2))
    _exchange(board, one, two)
    # the first: 2,400 less 4,000 tokens after it (800 ms); the second: 2,400 less 200 ms
    assert one.views(NOW)[0].queued_slack_ms == pytest.approx(1600)
    assert two.views(NOW)[0].queued_slack_ms == pytest.approx(1600)


def test_an_ingress_protects_the_requests_another_ingress_has_decoding() -> None:
    one, two, board = _two_ingresses()
    d = Decoding(tpot_target_ms=40, max_tokens=11, predicted_tpot_ms=20, first_at=NOW)
    one.dispatched("a", 10)
    one.first_token("a", 10, d)
    _exchange(board, one, two)
    assert two.views(NOW)[0].decode_slack_ms == pytest.approx(400 - 10 * 20)
    one.finished("a", 10, got_first_token=True, decoding=d)
    _exchange(board, one, two)  # the empty post withdraws it
    assert two.views(NOW)[0].decode_slack_ms is None


def test_what_a_silent_ingress_protected_is_forgotten() -> None:
    one, two, board = _two_ingresses()
    one.dispatched("a", 3000, Queued(150, 25, 50, 3000, dispatched_at=NOW))
    _exchange(board, one, two)
    assert two.views(NOW)[0].queued_slack_ms == pytest.approx(2400)
    later = NOW + PROTECTED_STALE_AFTER_S + 0.1  # ingress-1 stopped posting
    two.update(board.snapshot(later), now=later)
    assert two.views(later)[0].queued_slack_ms is None


def test_the_pace_of_every_ingress_s_decoding_requests_floors_the_tpot() -> None:
    one, two, board = _two_ingresses()
    d = Decoding(tpot_target_ms=400, max_tokens=100, predicted_tpot_ms=20, first_at=NOW)
    one.dispatched("a", 10)
    one.first_token("a", 10, d)
    assert one.views(NOW)[0].decode_pace_ms is None  # not measured yet
    for i in range(2, 5):  # 300 ms a token
        d.advance(i, NOW + 0.3 * (i - 1))
    assert one.views(NOW + 1)[0].decode_pace_ms == pytest.approx(300)
    _exchange(board, one, two, now=NOW + 1)
    assert two.views(NOW + 1)[0].decode_pace_ms == pytest.approx(300)
    doc, slo = RequestFeatures(100, 25), SLO("s", ttft_ms=60_000, tpot_ms=150)
    paced = two.decide(doc, slo, NOW + 1, Policy.SLO, "headroom:queued:paced")
    assert isinstance(paced, Reject) and paced.reason is RejectReason.SLO_UNMEETABLE
    assert isinstance(two.decide(doc, slo, NOW + 1), RouteTo)  # the model alone (the default)


def test_decisions_of_one_moment_share_one_view_until_something_changes() -> None:
    r = router()
    d = Decoding(tpot_target_ms=40, max_tokens=11, predicted_tpot_ms=20, first_at=NOW)
    r.dispatched("a", 10)
    r.first_token("a", 10, d)
    views = r.views(NOW)
    assert views[0].decode_slack_ms == pytest.approx(200)
    assert r.views(NOW + VIEWS_REUSE_S) is views
    r.dispatched("a", 10)  # admission must see the request it just let in
    again = r.views(NOW + VIEWS_REUSE_S)
    assert again is not views and again[0].waiting == 1
    later = r.views(NOW + 2 * VIEWS_REUSE_S + 0.001)  # and the slack the clock has spent
    assert later is not again
    assert later[0].decode_slack_ms == pytest.approx(200 - (2 * VIEWS_REUSE_S + 0.001) * 1e3)
