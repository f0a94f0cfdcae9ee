from serve_app.engine.protocol import EngineStats, ReplicaReport
from serve_app.pool_state import (
    PROTECTED_STALE_AFTER_S,
    REFUSALS_WINDOW_S,
    IngressPost,
    PoolStateBoard,
    aggregate,
)
from serve_app.routing.estimator import Protected, Queued

NOW = 1000.0


def report(pool: str, rid: str, waiting: int = 0, running: int = 0, **kw: object) -> ReplicaReport:
    fields: dict[str, object] = {"reported_at": NOW, "max_model_len": 2048} | kw
    healthy = bool(fields.pop("healthy", True))
    stats = EngineStats(waiting, running, kv_cache_usage=0.5, healthy=healthy)
    return ReplicaReport(pool=pool, replica_id=rid, stats=stats, **fields)  # type: ignore[arg-type]


def test_sums_queues_and_counts_live_replicas() -> None:
    snaps = aggregate(
        ["a", "b"],
        [
            report("a", "1", 2, 3, ttft_ms_recent=(10.0, 30.0)),
            report("a", "2", 1, 1, ttft_ms_recent=(20.0,)),
        ],
        NOW,
    )
    a = snaps["a"]
    assert (a.replicas, a.waiting, a.running) == (2, 3, 4)
    assert a.kv_cache_usage == 0.5
    assert a.ttft_ms_recent_p50 == 20.0
    assert not snaps["b"].ready


def test_stale_and_unhealthy_replicas_are_left_out() -> None:
    snaps = aggregate(
        ["a"],
        [report("a", "1", reported_at=NOW - 10), report("a", "2", healthy=False), report("a", "3")],
        NOW,
    )
    assert snaps["a"].replicas == 1


def test_unknown_pools_are_ignored() -> None:
    assert set(aggregate(["a"], [report("zzz", "1")], NOW)) == {"a"}


def test_board_keeps_latest_report_per_replica_and_forgets_old_ones() -> None:
    board = PoolStateBoard(["a"])
    board.report(report("a", "1", waiting=5, reported_at=NOW - 100))
    board.report(report("a", "2", waiting=1))
    board.report(report("a", "2", waiting=2))
    assert set(board._reports) == {"2"}
    assert board._reports["2"].stats.waiting == 2


def test_placements_list_each_live_replica_where_it_runs() -> None:
    from serve_app.engine.protocol import Placement

    here, there = Placement("n1", "10.0.0.1", ("0",)), Placement("n2", "10.0.0.2", ("1",))
    snaps = aggregate(
        ["a"],
        [
            report("a", "2", placement=there),
            report("a", "1", placement=here),
            report("a", "3", placement=here, reported_at=NOW - 10),  # stale: gone
        ],
        NOW,
    )
    assert snaps["a"].placements == (("1", here), ("2", there))


def test_board_answers_reports_with_the_pools_worst_fresh_consumer_lag() -> None:
    import time

    board = PoolStateBoard(["a", "b"])
    now = time.time()
    # no consumer reported yet
    assert board.report(report("a", "1", reported_at=now)).consumer_lag_ms is None
    board.consumer_lag("ingress-1", {"a": 4.0})
    board.consumer_lag("ingress-2", {"a": 12.0, "b": 1.0})
    assert board.report(report("a", "1", reported_at=now)).consumer_lag_ms == 12.0
    assert board.report(report("b", "2", reported_at=now)).consumer_lag_ms == 1.0
    # lag reports older than the staleness window no longer count
    assert board.report(report("a", "1", reported_at=now + 60)).consumer_lag_ms is None


def test_board_shares_refused_demand_among_the_pools_replicas() -> None:
    board = PoolStateBoard(["a", "b"])
    board.refused({"a": 30, "b": 0}, now=NOW)
    board.refused({"a": 10}, now=NOW + 1)
    board.report(report("a", "2", reported_at=NOW + 1))
    reply = board.report(report("a", "1", reported_at=NOW + 1))
    assert reply.refused_per_s == (40 / REFUSALS_WINDOW_S) / 2  # two live replicas of a
    assert board.report(report("b", "3", reported_at=NOW + 1)).refused_per_s == 0
    # refusals older than the window are demand no more
    later = board.report(report("a", "1", reported_at=NOW + REFUSALS_WINDOW_S + 2))
    assert later.refused_per_s == 0


def test_snapshot_sums_queued_tokens_and_averages_measured_rates() -> None:
    snaps = aggregate(
        ["a"],
        [
            report("a", "1", queued_tokens=100, prefill_tok_s=1000.0),
            report("a", "2", queued_tokens=50, prefill_tok_s=3000.0),
            report("a", "3", queued_tokens=5),  # not measured yet
        ],
        NOW,
    )
    assert snaps["a"].queued_tokens == 155 and snaps["a"].prefill_tok_s == 2000.0


def test_board_hands_each_pools_protected_requests_with_the_ingress_that_posted_them() -> None:
    board = PoolStateBoard(["a", "b"])
    one = Protected(120.0, (Queued(150, 25, 50, 3000, NOW),))
    board.protect("ingress-1", {"a": one}, now=NOW)
    board.protect("ingress-2", {}, now=NOW)
    snaps = board.snapshot(NOW + 0.5)
    assert snaps["a"].protected == (("ingress-1", one),)
    assert snaps["b"].protected == ()
    # a later post replaces the earlier one; a post older than the window is dropped
    board.protect("ingress-1", {"b": one}, now=NOW + 0.5)
    assert board.snapshot(NOW + 0.5)["a"].protected == ()
    assert board.snapshot(NOW + 0.6 + PROTECTED_STALE_AFTER_S)["b"].protected == ()


def test_an_ingress_posts_its_news_and_takes_the_snapshot_in_one_exchange() -> None:
    board = PoolStateBoard(["a", "b"])
    one = Protected(120.0, (Queued(150, 25, 50, 3000, NOW),))
    post = IngressPost("ingress-1", {"a": 9.0}, {"a": 10}, {"a": one})
    snaps = board.exchange(post, now=NOW)
    assert snaps["a"].protected == (("ingress-1", one),)
    reply = board.report(report("a", "1", reported_at=NOW))
    assert reply.consumer_lag_ms == 9.0
    assert reply.refused_per_s == 10 / REFUSALS_WINDOW_S
    # no news keeps the last post; an empty one withdraws it
    assert board.exchange(IngressPost("ingress-1"), now=NOW)["a"].protected == (("ingress-1", one),)
    assert board.exchange(IngressPost("ingress-1", protected={}), now=NOW)["a"].protected == ()
