"""The replica's own logic (latency bookkeeping, stats, health) with a scripted engine."""

import asyncio
import gc
import time
from collections.abc import AsyncIterator

import pytest

from serve_app.engine.channel import ChannelHello, Channels
from serve_app.engine.direct import DirectConnection
from serve_app.engine.protocol import (
    Engine,
    EngineDeadError,
    EngineStats,
    GenerationRequest,
    StreamChunk,
)
from serve_app.engine.replica import EngineReplica
from serve_app.ingress.direct import DirectDispatch
from serve_app.profiles import EngineArgs, EngineProfile, Platform, ResolvedProfile
from serve_app.timing import Stage
from tests.unit.engine.test_direct import until

PROFILE = EngineProfile(
    name="p", model="m", engine=EngineArgs(max_model_len=1024, kv_cache_memory_bytes=1 << 28)
).resolve(Platform.CPU)


class ScriptedEngine(Engine):
    def __init__(self, profile: ResolvedProfile) -> None:
        self.dead = False
        self.started = False
        self.release = asyncio.Event()  # request "held" waits for it after its first token

    async def start(self) -> None:
        self.started = True

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        for i in range(request.max_tokens):
            done = i == request.max_tokens - 1
            yield StreamChunk(
                f"t{i}", 1, i + 1, len(request.prompt_token_ids), "length" if done else None
            )
            if request.request_id == "held":
                await self.release.wait()

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("dead")

    def stats(self) -> EngineStats:
        return EngineStats(waiting=3, running=2, kv_cache_usage=0.25)

    def shutdown(self) -> None:
        self.dead = True


async def make_replica() -> tuple[EngineReplica, ScriptedEngine]:
    engines: list[ScriptedEngine] = []

    def factory(profile: ResolvedProfile) -> Engine:
        engines.append(ScriptedEngine(profile))
        return engines[-1]

    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(PROFILE, None, factory)  # type: ignore[misc]
    return replica, engines[0]


async def test_streams_and_records_latencies() -> None:
    replica, engine = await make_replica()
    assert engine.started
    chunks = [c async for c in replica.generate(GenerationRequest("r", [1, 2, 3], 5))]
    assert "".join(c.text for c in chunks) == "t0t1t2t3t4"
    assert chunks[-1].completion_tokens == 5 and chunks[-1].finish_reason == "length"
    report = replica.report()
    assert report.pool == "p" and report.max_model_len == 1024
    assert len(report.ttft_ms_recent) == 1 and len(report.tpot_ms_recent) == 1
    assert report.stats.waiting == 3


async def test_first_chunk_carries_the_dispatch_stage_when_timed() -> None:
    replica, _ = await make_replica()
    sent = time.time() - 0.05  # the ingress dispatched it 50 ms ago
    chunks = [c async for c in replica.generate(GenerationRequest("r", [1], 3, sent_at=sent))]
    assert chunks[0].stages is not None
    assert 50 <= chunks[0].stages[Stage.DISPATCH] < 5_000
    assert [c.stages for c in chunks[1:]] == [None, None]
    untimed = [c async for c in replica.generate(GenerationRequest("q", [1], 2))]
    assert [c.stages for c in untimed] == [None, None]


async def test_autoscaling_stats_expose_the_engine_queue() -> None:
    replica, _ = await make_replica()
    assert replica.record_autoscaling_stats() == {
        "engine_waiting": 3,
        "engine_running": 2,
        "arrivals_per_s": 0.0,
        "refused_per_s": 0.0,
        "direct_ongoing": 0,
    }


async def test_prompt_tokens_are_queued_until_the_first_token() -> None:
    replica, _ = await make_replica()
    stream = replica.generate(GenerationRequest("r", [7] * 300, 3))
    assert replica.report().queued_tokens == 0
    first = await anext(stream)  # the engine answered: prefill is done
    assert first.num_tokens == 1 and replica.report().queued_tokens == 0
    other = replica.generate(GenerationRequest("q", [7] * 40, 3))
    await other.aclose()  # closed before it started: nothing queued, nothing leaked
    assert replica.report().queued_tokens == 0
    rest = [c async for c in stream]
    assert rest[-1].finish_reason == "length"
    assert replica.record_autoscaling_stats()["arrivals_per_s"] > 0


async def test_health_check_fails_when_the_engine_is_dead() -> None:
    replica, engine = await make_replica()
    await replica.check_health()
    engine.dead = True
    with pytest.raises(EngineDeadError):
        await replica.check_health()


class DyingEngine(ScriptedEngine):
    """Dies under its requests: "stuck" never gets an answer (it reached the engine as it
    died), every other request sees the death."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        yield StreamChunk("a", 1, 1, len(request.prompt_token_ids))
        if request.request_id == "stuck":
            await asyncio.Event().wait()
        self.dead = True
        raise EngineDeadError("engine core gone")


async def test_a_dead_engine_fails_every_request_on_the_replica_at_once() -> None:
    replica, _ = await make_replica()
    dying = DyingEngine(PROFILE)
    replica._engine = dying

    async def drain(request_id: str) -> list[StreamChunk]:
        return [c async for c in replica.generate(GenerationRequest(request_id, [1], 4))]

    stuck = asyncio.create_task(drain("stuck"))
    await asyncio.sleep(0.01)  # it has its first chunk and waits on the engine
    with pytest.raises(EngineDeadError, match="engine core gone"):
        await drain("sees-it")
    with pytest.raises(EngineDeadError, match="engine core gone"):
        await asyncio.wait_for(stuck, 1)
    with pytest.raises(EngineDeadError):  # and nothing new reaches the dead engine
        await drain("later")
    assert replica._inflight == set()


async def test_a_dead_engine_seen_by_the_health_check_fails_the_requests_waiting_on_it() -> None:
    replica, _ = await make_replica()
    dying = DyingEngine(PROFILE)
    replica._engine = dying

    async def drain() -> list[StreamChunk]:
        return [c async for c in replica.generate(GenerationRequest("stuck", [1], 4))]

    stuck = asyncio.create_task(drain())
    await asyncio.sleep(0.01)
    dying.dead = True
    with pytest.raises(EngineDeadError):
        await replica.check_health()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(stuck, 1)


async def test_a_request_whose_caller_left_is_cancelled_not_failed() -> None:
    replica, _ = await make_replica()
    replica._engine = DyingEngine(PROFILE)

    async def drain() -> list[StreamChunk]:
        return [c async for c in replica.generate(GenerationRequest("stuck", [1], 4))]

    stuck = asyncio.create_task(drain())
    await asyncio.sleep(0.01)
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stuck
    assert replica._inflight == set()


class MergingEngine(ScriptedEngine):
    """Like vLLM's DELTA output: tokens are produced on the engine's clock (one per ms) and
    whatever the consumer has not read yet is merged into the next delta."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        import asyncio

        produced: list[str] = []
        more = asyncio.Event()

        async def produce() -> None:
            for i in range(request.max_tokens):
                await asyncio.sleep(0.001)
                produced.append(f"t{i} ")
                more.set()

        task = asyncio.create_task(produce())
        sent = 0
        try:
            while sent < request.max_tokens:
                await more.wait()
                more.clear()
                new = produced[sent:]
                sent += len(new)
                finished = sent == request.max_tokens
                yield StreamChunk("".join(new), len(new), sent, 1, "length" if finished else None)
        finally:
            task.cancel()


async def _stream_all(budget: float | None, streams: int) -> tuple[int, list[str]]:
    import asyncio

    profile = PROFILE.model_copy(
        update={"pool": PROFILE.pool.model_copy(update={"stream_messages_per_s": budget})}
    )
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(profile, None, MergingEngine)  # type: ignore[misc]

    async def one(i: int) -> tuple[int, str]:
        chunks = [c async for c in replica.generate(GenerationRequest(str(i), [1], 100))]
        assert chunks[-1].completion_tokens == 100 and chunks[-1].finish_reason == "length"
        return len(chunks), "".join(c.text for c in chunks)

    results = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(n for n, _ in results), [t for _, t in results]


async def test_streams_coalesce_under_load_without_changing_the_text() -> None:
    # 20 streams of 100 tokens at 1 token/ms each. Without a budget every delta is a message;
    # with 1,000 messages/s for the replica, each stream sends one per ~20 ms.
    every_delta, texts = await _stream_all(None, 20)
    budgeted, budgeted_texts = await _stream_all(1000, 20)
    assert budgeted_texts == texts == ["".join(f"t{i} " for i in range(100))] * 20
    assert budgeted < every_delta / 3, (budgeted, every_delta)


async def test_one_stream_is_not_held_back() -> None:
    # A lone stream's share of the budget (1 ms) is below the coalescing floor: no waiting.
    lone, _ = await _stream_all(1000, 1)
    assert lone > 50


async def reach(replica: EngineReplica) -> tuple[DirectDispatch, DirectConnection]:
    """An ingress's end of direct dispatch, once connected to `replica`."""
    dispatch = DirectDispatch(replica.report().placement.node_id)
    placements = [("r", replica.report().placement)]
    await until(lambda: dispatch.pick(placements) is not None)
    connection = dispatch.pick(placements)
    assert connection is not None
    return dispatch, connection


async def test_a_direct_request_s_chunks_come_back_on_the_socket_not_the_channel() -> None:
    """A Serve call's chunks go on the ingress's stream channel; a direct request's come on
    the socket it came by (one hop less), though that ingress has a channel open."""
    replica, _ = await make_replica()
    channel = replica.channel("ingress-1")
    hello = await anext(channel)
    assert isinstance(hello, ChannelHello) and hello.accepted
    carried = [
        c async for c in replica.generate(GenerationRequest("s", [1], 3, channel="ingress-1"))
    ]
    assert carried == []  # all on the channel
    batch = await asyncio.wait_for(anext(channel), 5)
    assert [chunk.text for _, chunk in batch if chunk is not None] == ["t0", "t1", "t2"]
    dispatch, connection = await reach(replica)
    call = connection.call(GenerationRequest("d", [1], 3, channel="ingress-1"))
    assert [c.text async for c in call] == ["t0", "t1", "t2"]
    nothing = asyncio.ensure_future(anext(channel))
    await asyncio.sleep(0.05)
    assert not nothing.done()  # the channel carried none of it
    nothing.cancel()
    dispatch.stop()


async def test_the_channel_stays_open_while_a_direct_stream_runs() -> None:
    """A channel no stream uses ends (the ingress would open it again, a Serve call, at its
    next dispatch); a direct stream keeps its ingress's channel open though its chunks go on
    the socket."""
    replica, engine = await make_replica()
    replica._channels = Channels(replica._replica_id, idle_s=0.1)
    channel = replica.channel("ingress-1")
    assert isinstance(await anext(channel), ChannelHello)
    dispatch, connection = await reach(replica)
    call = connection.call(GenerationRequest("held", [1], 2, channel="ingress-1"))
    assert (await anext(call)).text == "t0"
    waiting = asyncio.ensure_future(anext(channel))
    await asyncio.sleep(0.3)  # three idle periods
    assert not waiting.done()  # still open: a stream holds it
    engine.release.set()
    assert [c.text async for c in call] == ["t1"]
    with pytest.raises(StopAsyncIteration):  # idle once the stream ended
        await asyncio.wait_for(waiting, 5)
    dispatch.stop()


async def test_a_stop_lets_direct_requests_end_and_sends_no_more_there() -> None:
    """Serve drains its own calls before calling __del__; the requests that came over the
    direct socket are the replica's to wait for: the ingress is told to send no more there,
    the one in flight runs to its end, then the engine stops."""
    replica, engine = await make_replica()
    assert replica._direct is not None  # on by default
    dispatch, connection = await reach(replica)
    placements = [("r", replica.report().placement)]
    call = connection.call(GenerationRequest("held", [1], 3))
    assert (await anext(call)).text == "t0"
    assert replica.record_autoscaling_stats()["direct_ongoing"] == 1
    stopping = replica.__del__()
    assert stopping is not None  # Serve awaits it
    task = asyncio.ensure_future(stopping)
    await until(lambda: connection.draining)
    assert connection.draining and dispatch.pick(placements) is None  # by Serve from now on
    await asyncio.sleep(0.05)
    assert not task.done() and not engine.dead  # still waiting for the request
    engine.release.set()
    assert [c.text async for c in call] == ["t1", "t2"]
    await asyncio.wait_for(task, 5)
    assert engine.dead  # shut down once it ended
    dispatch.stop()


async def test_a_stop_with_nothing_direct_in_flight_stops_at_once() -> None:
    replica, engine = await make_replica()
    assert replica.__del__() is None
    assert engine.dead


class EndlessEngine(ScriptedEngine):
    """Streams until closed, and notes when its stream was closed (vLLM aborts it then)."""

    def __init__(self, profile: ResolvedProfile) -> None:
        super().__init__(profile)
        self.closed: list[str] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        try:
            for i in range(10**6):
                yield StreamChunk(f"t{i}", 1, i + 1, 1)
                await asyncio.sleep(0)
        finally:
            self.closed.append(request.request_id)


async def test_a_cancel_during_coalescing_closes_the_engine_stream_at_once() -> None:
    """A stream coalesced under load waits between messages; a cancel landing in that wait
    must close the engine's stream then, not when a garbage collection finds it."""
    profile = PROFILE.model_copy(
        update={"pool": PROFILE.pool.model_copy(update={"stream_messages_per_s": 2})}
    )
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(profile, None, EndlessEngine)  # type: ignore[misc]
    engine = replica._engine
    assert isinstance(engine, EndlessEngine)
    stream = replica.generate(GenerationRequest("coalesced", [1], 10**6))
    gc.disable()  # what closes it must be the replica, not the collector
    try:
        await anext(stream)  # the first token goes at once; the next waits its share (0.5 s)
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert engine.closed == ["coalesced"]
    finally:
        gc.enable()
