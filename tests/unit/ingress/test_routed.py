"""The ingress's side of the TTFT breakdown: its own stages, the replica's, the header."""

import concurrent.futures
import time

import pytest
from ray.serve.handle import DeploymentResponseGenerator, _DeploymentResponseBase

from serve_app.engine.protocol import StreamChunk
from serve_app.ingress.routed import Routed
from serve_app.routing.estimator import Load
from serve_app.routing.slo import SLO
from serve_app.timing import Stage, parse_server_timing


def routed(stages: dict[str, float] | None, proxy: float | None = 0.4) -> Routed:
    return Routed(
        request_id="cmpl-1",
        pool="low-latency",
        reason="slo",
        slo=SLO("interactive"),
        load=Load(0, 0, 0),
        prompt_tokens=10,
        started=100.0,
        predicted_ttft_ms=20.0,
        tokenized=100.003,
        decided=100.0035,
        proxy_ms=proxy,
        stages=stages,
    )


def test_first_chunk_assembles_every_stage_in_order() -> None:
    r = routed({})
    remote = {
        Stage.DISPATCH: 0.7,
        Stage.ENGINE_IN: 0.2,
        Stage.QUEUE: 3.0,
        Stage.PREFILL: 9.0,
        Stage.ENGINE_OUT: 0.3,
    }
    chunk = StreamChunk("a", 1, 1, 10, sent_at=time.time() - 0.001, stages=remote)
    r.first_chunk(chunk, now=100.020)
    timing = parse_server_timing(r.headers["server-timing"])
    assert list(timing) == [
        "proxy",
        "ingress",
        "route",
        "dispatch",
        "engine_in",
        "queue",
        "prefill",
        "engine_out",
        "return",
        "ttft",
    ]
    assert timing["ingress"] == pytest.approx(3.0, abs=0.01)
    assert timing["route"] == pytest.approx(0.5, abs=0.01)
    assert timing["queue"] == 3.0
    assert 1.0 <= timing["return"] < 1000
    assert timing["ttft"] == pytest.approx(20.0, abs=0.01)


def test_untimed_requests_carry_no_header() -> None:
    r = routed(None)
    r.first_chunk(StreamChunk("a", 1, 1, 10, stages={Stage.QUEUE: 1.0}), now=100.02)
    assert "server-timing" not in r.headers


def test_engine_without_timestamps_still_gives_the_ingress_stages() -> None:
    r = routed({}, proxy=None)
    r.first_chunk(StreamChunk("a", 1, 1, 10), now=100.02)
    assert list(parse_server_timing(r.headers["server-timing"])) == ["ingress", "route", "ttft"]


def test_routing_learns_from_the_proxy_on_and_the_path_outside_the_engine() -> None:
    r = routed({}, proxy=4.0)
    remote = {Stage.QUEUE: 3.0, Stage.PREFILL: 9.0}
    r.first_chunk(StreamChunk("a", 1, 1, 10, stages=remote), now=100.020)
    ttft, path, queue = r.learned_ttft()
    # 20 at the ingress (0.5 of it routing) + 4 in the proxy
    assert ttft == pytest.approx(23.5, abs=0.01)
    assert path == pytest.approx(11.5, abs=0.01)  # all but the engine's 3 + 9
    assert queue == 3.0
    untimed = routed(None)
    untimed.first_chunk(StreamChunk("a", 1, 1, 10, stages=remote), now=100.020)
    assert untimed.learned_ttft() == (pytest.approx(19.5, abs=0.01), None, None)


def test_a_hold_at_routing_is_not_learned_as_path() -> None:
    """A request held 400 ms for admission (its `route` stage) teaches routing the TTFT it
    had from its dispatch on: the next request is decided afresh, and would not wait so."""
    remote = {Stage.QUEUE: 3.0, Stage.PREFILL: 9.0}
    timed, untimed = routed({}, proxy=4.0), routed(None)
    for r in (timed, untimed):
        r.decided = r.tokenized + 0.4
        r.first_chunk(StreamChunk("a", 1, 1, 10, stages=remote), now=r.decided + 0.017)
    assert parse_server_timing(timed.headers["server-timing"])["route"] == pytest.approx(400)
    ttft, path, queue = timed.learned_ttft()
    assert ttft == pytest.approx(24.0, abs=0.01)  # 3 ingress + 17 after routing + 4 proxy
    assert path == pytest.approx(12.0, abs=0.01)
    assert queue == 3.0
    assert untimed.learned_ttft() == (pytest.approx(20.0, abs=0.01), None, None)


def test_a_wait_for_a_replica_slot_is_learned_as_queued_not_as_path() -> None:
    """A request that waited 900 ms in Serve's queue for a replica slot (its pool's replicas
    all at `max_ongoing_requests`, e.g. behind round-robin's requests) teaches it as time
    queued behind the requests ahead (the wait factor), not as a path every request takes."""
    remote = {Stage.DISPATCH: 901.0, Stage.QUEUE: 3.0, Stage.PREFILL: 9.0}
    r = routed({}, proxy=4.0)
    r.dispatched_at = 5000.0
    r.assigned_at = 5000.9
    r.first_chunk(StreamChunk("a", 1, 1, 10, stages=remote), now=100.920)
    assert r.slot_wait_ms() == pytest.approx(900.0)
    ttft, path, queue = r.learned_ttft()
    assert ttft == pytest.approx(924.0 - 0.5, abs=0.01)  # the client's TTFT, less routing
    assert path == pytest.approx(923.5 - 903.0 - 9.0, abs=0.01)
    assert queue == pytest.approx(903.0)
    assert routed({}).slot_wait_ms() == 0.0  # not known: nothing moved


def test_serve_responses_tell_when_a_replica_took_the_call() -> None:
    """Serve's response (as `.remote()` returns it, Ray's own class) resolves its assignment
    future once a replica takes the call: the request notes that moment."""
    future: concurrent.futures.Future[object] = concurrent.futures.Future()
    response = DeploymentResponseGenerator.__new__(DeploymentResponseGenerator)
    _DeploymentResponseBase.__init__(response, future, None)  # type: ignore[arg-type]
    r = routed({})
    r.watch_assignment(response)
    assert r.assigned_at is None
    before = time.time()
    future.set_result(object())
    assert r.assigned_at is not None and before <= r.assigned_at <= time.time()
    double = routed({})
    double.watch_assignment(object())  # a handle without one (a test double): nothing noted
    assert double.assigned_at is None and double.slot_wait_ms() == 0.0
