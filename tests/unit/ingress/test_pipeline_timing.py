"""The ingress's side of the TTFT breakdown: its own stages, the replica's, the header."""

import time

import pytest

from serve_app.engine.protocol import StreamChunk
from serve_app.ingress.pipeline import Routed
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
