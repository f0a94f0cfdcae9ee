from serve_app.pool_state import PoolSnapshot
from serve_app.routing.config import LatencyPrior, RoutingConfig
from serve_app.routing.estimator import LatencyModel
from serve_app.routing.policy import RequestFeatures, RouteTo
from serve_app.routing.router import Router
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
        r.dispatched("a")
    # three requests wait for a first token: the pool is saturated for this ingress
    assert not isinstance(r.decide(features, slo, NOW), RouteTo)
    r.first_token("a")
    assert r.views()[0].waiting == 2 and r.views()[0].running == 1
    r.finished("a", got_first_token=True)
    r.finished("a", got_first_token=False)
    assert (r.views()[0].waiting, r.views()[0].running) == (1, 0)


def test_board_counts_win_when_larger() -> None:
    r = router()
    r.dispatched("a")
    r.update({"a": PoolSnapshot("a", replicas=1, waiting=5, running=7, updated_at=NOW)})
    view = r.views()[0]
    assert (view.waiting, view.running) == (5, 7)


def test_learning_moves_the_factor_towards_measurements() -> None:
    r = router()
    load = r.load_of("a")
    before = r.model("a").ttft_factor
    raw = LatencyModel(LatencyPrior()).predict(100, 0, 0).ttft_ms
    for _ in range(30):
        r.learn("a", 100, load, ttft_ms=raw * 3, tpot_ms=None)
    assert before == 1.0
    assert 2.9 < r.model("a").ttft_factor <= 3.0
    assert r.model("a").tpot_factor == 1.0
