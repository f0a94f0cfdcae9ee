"""Engine frontends in one process: a replica of the fake engine with one frontend (its own fake
engine standing in for a second client of the same engine), reached through in-process stand-ins
for Ray actor handles, and an ingress's channels to both."""

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serve_app.engine.channel import Channel, relay
from serve_app.engine.direct import DirectServer
from serve_app.engine.fake import FakeEngine
from serve_app.engine.frontend import EngineFrontend, Frontends, FrontendSockets
from serve_app.engine.protocol import (
    EngineDeadError,
    EngineRequestError,
    EngineStats,
    GenerationRequest,
    StreamChunk,
)
from serve_app.engine.replica import EngineReplica
from serve_app.ingress.channels import ChannelStream, IngressChannels
from serve_app.local import LocalHandle
from serve_app.profiles import (
    EngineArgs,
    EngineProfile,
    Platform,
    PlatformOverride,
    PoolSpec,
)

PROFILE = EngineProfile(
    name="p", model="m", engine=EngineArgs(max_model_len=1024, kv_cache_memory_bytes=1 << 28)
).resolve(Platform.CPU)


class _ActorId:
    def __init__(self, key: str) -> None:
        self._key = key

    def hex(self) -> str:
        return self._key


class _Call:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def options(self, **_: Any) -> "_Call":
        return self

    def remote(self, *args: Any) -> Any:
        result = self._fn(*args)
        if inspect.isasyncgen(result):
            return _refs(result)
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


async def _refs(gen: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A streaming call's values as Ray hands them out: one awaitable reference each."""
    async for value in gen:
        ref = asyncio.get_running_loop().create_future()
        ref.set_result(value)
        yield ref


class LocalActor:
    """`handle.method.options(num_returns="streaming").remote(...)` on an object here."""

    def __init__(self, target: Any, key: str) -> None:
        self._target = target
        self._actor_id = _ActorId(key)
        self.called: list[str] = []

    def __getattr__(self, name: str) -> _Call:
        self.called.append(name)
        return _Call(getattr(self._target, name))


def frontend(replica_id: str) -> tuple[EngineFrontend, FakeEngine]:
    engine = FakeEngine(PROFILE)
    return EngineFrontend(PROFILE, f"{replica_id}/1", engine=engine), engine


async def make(
    socket: bool = False, ingress_node: str = ""
) -> tuple[IngressChannels, EngineReplica, FakeEngine, FakeEngine]:
    """`socket`: the frontend takes requests and channels on its sockets too (started as
    Frontends.start does). The replica's node is "" here, as is the ingress's unless
    `ingress_node`."""
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(PROFILE, None, FakeEngine)  # type: ignore[misc]
    served, its_engine = frontend(replica._replica_id)
    sockets = (await served.start(),) if socket else ()
    replica._frontends = Frontends([LocalActor(served, "actor-1")], sockets)
    await replica._frontends.connect()
    replica._channels.frontends = replica._frontends.handles
    replica._channels.sockets = replica._frontends.channel_sockets
    channels = IngressChannels({"p": LocalHandle(replica)}, "ingress-a", ["p"], ingress_node)
    return channels, replica, replica._engine, its_engine  # type: ignore[return-value]


def dispatch(channels: IngressChannels, replica: EngineReplica, key: str, n: int) -> ChannelStream:
    carried = channels.may_carry(key)
    request = GenerationRequest(key, [1, 2], n, channel="ingress-a" if carried else "")
    return channels.stream(key, LocalHandle(replica).generate.remote(request), carried)


async def read(stream: ChannelStream) -> list[StreamChunk]:
    return [c async for c in stream]


@pytest.mark.parametrize(
    ("socket", "ingress_node", "by_socket"),
    [
        (False, "", False),  # the frontend has no sockets: Ray calls
        (True, "", True),  # the ingress on its node: its channel socket
        (True, "another-node", False),  # elsewhere: its channel by a Ray call
    ],
)
async def test_streams_spread_over_the_frontends_and_arrive_whole_on_their_channels(
    socket: bool, ingress_node: str, by_socket: bool
) -> None:
    channels, replica, own_engine, frontend_engine = await make(socket, ingress_node)
    channels.want("p", [replica._replica_id])
    for _ in range(100):  # the replica's channel, then (named in its hello) the frontend's
        if len(channels.open_to("p")) == 2:
            break
        await asyncio.sleep(0.01)
    assert channels.open_to("p") == {replica._replica_id, f"{replica._replica_id}/1"}

    streams = [dispatch(channels, replica, f"r{i}", 6) for i in range(6)]
    results = await asyncio.gather(*(read(s) for s in streams))

    assert [[c.completion_tokens for c in chunks] for chunks in results] == [[1, 2, 3, 4, 5, 6]] * 6
    assert all(not c.carried for chunks in results for c in chunks)  # no receipt reached it
    # the process serving the fewest streams took each: half each
    assert (own_engine.started, frontend_engine.started) == (3, 3)
    assert list(replica._ttft_ms) and len(replica._tpot_ms) == 6  # receipts told the replica
    actor = replica._frontends.handles[0]
    assert ("channel" in actor.called) is not by_socket
    assert ("generate" in actor.called) is not socket  # the replica's own socket to it
    channels.stop()
    if socket:
        actor._target.shutdown()


async def test_a_frontend_without_the_ingress_channel_streams_through_the_replica() -> None:
    served, _ = frontend("replica-1")
    own = [c async for c in served.generate(GenerationRequest("r", [1], 4, channel="elsewhere"))]
    assert [c.completion_tokens for c in own] == [1, 2, 3, 4] and not any(c.carried for c in own)


async def test_a_frontend_with_the_channel_sends_only_receipts_of_the_first_and_last() -> None:
    served, _ = frontend("replica-1")
    messages = served.channel("ingress-a")
    await anext(messages)  # the hello
    request = GenerationRequest("r", [1], 5, channel="ingress-a")
    receipts = [c async for c in served.generate(request)]
    assert [(c.completion_tokens, c.carried, c.data) for c in receipts] == [
        (1, True, None),
        (5, True, None),
    ]
    sent = []
    while not sent or sent[-1] != ("r", None):
        sent += await anext(messages)
    assert [c.completion_tokens for _, c in sent if c is not None] == [1, 2, 3, 4, 5]


async def test_the_replica_ends_no_stream_a_frontend_carries() -> None:
    # two channels are not ordered: an end from the replica could overtake the frontend's chunks
    channel = Channel()

    async def receipts() -> AsyncIterator[StreamChunk]:
        yield StreamChunk("", 1, 1, 1, carried=True)
        yield StreamChunk("", 1, 2, 1, "length", carried=True)

    request = GenerationRequest("r", [1], 2)
    out = [x async for x in relay(receipts(), request, channel, 0.0)]
    assert [carried for _, carried in out] == [True, True]
    assert channel._pending == []


def test_the_least_busy_process_serves_and_the_freshest_stats_win() -> None:
    frontends = Frontends(["a", "b"])
    frontends._streams = [1, 1]
    assert frontends.pick(4) == 1  # the replica serves 2 of its 4 itself
    assert frontends.pick(2) == 0  # none itself
    assert frontends.pick(3) == 0  # as many as each frontend: ties go to the replica
    stale, fresh = EngineStats(running=1, recorded_at=1.0), EngineStats(running=9, recorded_at=2.0)
    frontends._stats = fresh
    assert frontends.stats(stale) == fresh
    frontends._stats = stale
    assert frontends.stats(fresh) == fresh
    dead = EngineStats(healthy=False)
    assert frontends.stats(dead) == dead


def test_a_platform_sets_its_own_frontend_count() -> None:
    profile = EngineProfile(
        name="p",
        model="m",
        engine=EngineArgs(max_model_len=1024, kv_cache_memory_bytes=1 << 28),
        pool=PoolSpec(frontends=4),
        platforms={Platform.CPU: PlatformOverride(frontends=1)},
    )
    assert profile.resolve(Platform.CPU).pool.frontends == 1
    assert profile.resolve(Platform.CUDA).pool.frontends == 4


class _GoneActor:
    """A frontend whose process is gone: every call fails as Ray fails it."""

    class _Stats:
        def remote(self) -> Any:
            from ray.exceptions import RayActorError

            future = asyncio.get_running_loop().create_future()
            future.set_exception(RayActorError())
            return future

    stats = _Stats()


async def test_a_frontend_gone_fails_its_replicas_health_and_requests() -> None:
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(PROFILE, None, FakeEngine)  # type: ignore[misc]
    replica._frontends = Frontends([_GoneActor()])
    await replica.check_health()
    for _ in range(100):  # the replica polls its frontends 4 times a second
        if replica._dead is not None:
            break
        await asyncio.sleep(0.05)
    try:
        await replica.check_health()
        raise AssertionError("healthy with a frontend gone")
    except EngineDeadError as e:
        assert "engine frontend 1 died" in str(e)
    try:
        await anext(replica.generate(GenerationRequest("r", [1], 2)))
        raise AssertionError("served with a frontend gone")
    except EngineDeadError:
        pass
    replica._reporter.cancel()


class _FailingActor:
    """A frontend whose stream fails as Ray reports it: an error of the cause's class too."""

    def __init__(self, cause: Exception) -> None:
        self._cause = cause
        self.generate = _Call(self._generate)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        from ray.exceptions import RayTaskError

        raise RayTaskError("generate", "traceback", self._cause).as_instanceof_cause()
        yield  # an async generator


async def test_a_frontends_error_reaches_the_replica_as_its_own_class() -> None:
    for cause in (EngineDeadError("engine gone"), EngineRequestError("bad parameter")):
        frontends = Frontends([_FailingActor(cause)])
        try:
            await anext(frontends.forward(1, GenerationRequest("r", [1], 2)))
            raise AssertionError("no error")
        except Exception as e:
            assert type(e) is type(cause) and str(e) == str(cause), repr(e)


async def _failing(request: GenerationRequest) -> AsyncIterator[StreamChunk]:
    raise EngineRequestError("bad parameter")
    yield  # an async generator


async def _endless(request: GenerationRequest) -> AsyncIterator[StreamChunk]:
    for i in range(1000):
        yield StreamChunk("", 1, i + 1, 1)
        await asyncio.sleep(0.01)


async def test_over_the_socket_a_frontends_error_keeps_its_class_and_a_lost_one_is_dead() -> None:
    servers = [DirectServer(_failing), DirectServer(_endless)]
    for server in servers:
        await server.start()
    frontends = Frontends(["a", "b"], [FrontendSockets(dispatch=s.path) for s in servers])
    await frontends.connect()
    with pytest.raises(EngineRequestError, match="bad parameter"):
        await anext(frontends.forward(1, GenerationRequest("r", [1], 2)))
    stream = frontends.forward(2, GenerationRequest("s", [1], 1000))
    assert (await anext(stream)).completion_tokens == 1
    assert frontends._streams == [0, 1]
    await servers[1].drained(0)  # its process gone: every connection closed
    with pytest.raises(EngineDeadError, match="engine frontend 2 died"):
        async for _ in stream:
            pass
    assert frontends._streams == [0, 0]
    servers[0].drain()


async def test_a_request_the_replica_gives_up_is_cancelled_in_the_frontend() -> None:
    server = DirectServer(_endless)
    await server.start()
    frontends = Frontends(["a"], [FrontendSockets(dispatch=server.path)])
    await frontends.connect()
    stream = frontends.forward(1, GenerationRequest("r", [1], 1000))
    await anext(stream)
    assert server.in_flight == 1
    await stream.aclose()  # the client left
    for _ in range(100):
        if server.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert server.in_flight == 0
    server.drain()
