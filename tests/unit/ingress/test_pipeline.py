"""The request pipeline's routing around the router: requests held for a pool that protects
its running requests."""

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

from serve_app.app import ingress_config, resolve_profiles
from serve_app.config import AppArgs
from serve_app.engine.fake import FakeRenderer
from serve_app.engine.protocol import StreamChunk
from serve_app.ingress.channels import CallCancelled
from serve_app.ingress.metrics import Outcome
from serve_app.ingress.pipeline import ClosingStreamingResponse, RequestPipeline
from serve_app.profiles import Platform
from serve_app.routing.config import Policy
from serve_app.routing.estimator import Load, Prediction
from serve_app.routing.policy import (
    Decision,
    Reject,
    RejectReason,
    RequestFeatures,
    RouteReason,
    RouteTo,
)
from serve_app.routing.slo import SLO
from tests.unit.ingress.test_routed import routed

POLL_MS = 20.0
HOLD = Reject(429, RejectReason.PROTECTS_RUNNING, "held", wait_ttft_ms=1.0)
GO = RouteTo("low-latency", RouteReason.SLO_FIT, Prediction(1.0, 1.0), Load(0, 0, 0))


def pipeline() -> RequestPipeline:
    args = AppArgs.model_validate(
        {"profiles": ["low-latency"], "engine": "fake", "routing": {"hold_poll_ms": POLL_MS}}
    )
    profiles = resolve_profiles(args, Platform.CPU)
    return RequestPipeline(ingress_config(args, profiles), {}, None, FakeRenderer("m"))


async def test_held_requests_are_decided_again_together_oldest_first() -> None:
    """Three requests held one after another are decided again at one poll, in the order they
    came; the one let in goes on (to its dispatch) before the next is decided."""
    p = pipeline()
    calls: list[tuple[int, float]] = []  # (request, loop time) of each decision
    let_in: set[int] = set()
    admitted: list[int] = []

    def decide(features: RequestFeatures, *_: object) -> Decision:
        me = features.prompt_tokens
        calls.append((me, asyncio.get_running_loop().time()))
        if me in let_in:
            admitted.append(me)
            return GO
        return HOLD

    p._router.decide = decide  # type: ignore[method-assign]

    async def route(me: int) -> list[int]:
        decision = await p._decide(
            RequestFeatures(me, 1), SLO("s", ttft_ms=10_000), Policy.SLO, None
        )
        assert decision is GO
        return list(admitted)  # who had gone in when this one went on

    tasks = []
    for me in (1, 2, 3):
        tasks.append(asyncio.create_task(route(me)))
        await asyncio.sleep(POLL_MS / 3e3)  # each comes a third of a poll after the last
    await asyncio.sleep(POLL_MS / 1e3 * 1.5)
    let_in.update((3, 1))
    first, _, third = tasks
    assert await first == [1]  # it went on before the others were decided
    assert await third == [1, 3]
    let_in.add(2)
    await tasks[1]
    rounds: list[list[int]] = []  # decisions less than a quarter poll apart: one poll
    last = None
    for me, at in calls[3:]:  # after the first decision of each, on arrival
        if last is None or at - last > POLL_MS / 4e3:
            rounds.append([])
        rounds[-1].append(me)
        last = at
    assert len(rounds) >= 3, rounds
    assert all(r == [1, 2, 3] for r in rounds[:-1]), rounds  # every poll, oldest first
    assert rounds[-1] == [2], rounds


async def test_predicted_ttft_counts_its_hold() -> None:
    """A request held at admission is told the TTFT predicted since it came (what its client
    sees): its hold so far plus what the decision that let it in predicts from there."""
    p = pipeline()
    decisions = iter([HOLD, HOLD, GO])
    p._router.decide = lambda *_: next(decisions)  # type: ignore[method-assign]
    request = Request({"type": "http", "headers": [(b"x-slo-ttft-ms", b"10000")]})
    call = SimpleNamespace(request=SimpleNamespace(request_id="r", max_tokens=8))
    routed = await p._route(call, 10, request)  # type: ignore[arg-type]
    assert routed.pool == GO.pool
    held_ms = (routed.decided - routed.started) * 1e3
    assert held_ms >= POLL_MS  # held for at least one poll
    assert routed.predicted_ttft_ms == pytest.approx(held_ms + GO.predicted.ttft_ms)
    header = float(routed.headers["x-route-predicted-ttft-ms"])
    assert header == pytest.approx(held_ms + GO.predicted.ttft_ms, abs=0.05)


@pytest.mark.parametrize("spec_version", ["2.4", "2.3"])
async def test_a_stream_the_client_left_is_closed_with_its_response(spec_version: str) -> None:
    """The client goes away after 2 events (2.4: the send fails; before it: the server reports
    the disconnect): the events' generator is closed by the time the response returns, though a
    reference cycle holds it and the garbage collector does not run."""
    closed = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            for _ in range(1000):
                yield b"data: {}\n\n"
                await asyncio.sleep(0.005)
        finally:
            closed.set()

    sent = 0
    gone = asyncio.Event()

    async def send(message: Message) -> None:
        nonlocal sent
        if message["type"] == "http.response.body":
            sent += 1
            if sent > 2:
                gone.set()
                if spec_version == "2.4":
                    raise OSError("connection reset")

    async def receive() -> Message:
        await gone.wait()
        return {"type": "http.disconnect"}

    body = events()
    cycle: list[Any] = [body]
    cycle.append(cycle)
    gc.disable()
    try:
        response = ClosingStreamingResponse(body)
        with contextlib.suppress(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)
        assert closed.is_set()
    finally:
        gc.enable()


class CancelledAfterOne:
    """A replica's stream: one chunk, then its call cancelled on the replica's side."""

    def __init__(self) -> None:
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[StreamChunk]:
        yield StreamChunk(text="a", num_tokens=1, completion_tokens=1, prompt_tokens=10)
        raise CallCancelled("cmpl-1")

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("client_left", [True, False])
async def test_a_call_cancelled_as_its_client_left_counts_as_a_disconnect(
    client_left: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serve cancels the replica's side of a request whose client left, and that can reach the
    stream first: then the stream ends as a disconnect. Cancelled with the client still there,
    it fails, and whoever answers the client counts the outcome."""
    p = pipeline()
    outcomes: list[Outcome] = []
    monkeypatch.setattr(p.metrics, "request", lambda pool, cls, outcome: outcomes.append(outcome))
    stream = CancelledAfterOne()

    async def client_gone() -> bool:
        return client_left

    track = routed(None)
    got: list[StreamChunk] = []
    if client_left:
        got = [chunk async for chunk in p._track(track, stream, client_gone)]
        assert outcomes == [Outcome.DISCONNECTED]
    else:
        with pytest.raises(CallCancelled):
            async for chunk in p._track(track, stream, client_gone):
                got.append(chunk)
        assert outcomes == []
    assert len(got) == 1
    assert stream.cancelled  # the replica's side is told to stop either way
