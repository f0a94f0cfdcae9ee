"""The request pipeline's routing around the router: requests held for a pool that protects
its running requests."""

import asyncio
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from serve_app.app import ingress_config, resolve_profiles
from serve_app.config import AppArgs
from serve_app.engine.fake import FakeRenderer
from serve_app.ingress.pipeline import RequestPipeline
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
