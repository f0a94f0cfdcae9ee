"""Direct dispatch over a kept Unix socket: both ends, with a stand-in for generate() (no Ray)."""

import asyncio
import os
from collections.abc import AsyncIterator, Callable

import pytest

from serve_app.engine import direct
from serve_app.engine.channel import ChannelHello, Channels
from serve_app.engine.direct import DirectServer
from serve_app.engine.protocol import (
    EngineDeadError,
    EngineRequestError,
    GenerationRequest,
    Placement,
    StreamChunk,
)
from serve_app.ingress.direct import DirectDispatch


class Generate:
    """Yields `n` chunks (its prompt's length), raises for request id "bad", and waits forever
    for "slow" until cancelled (noting the cancellation)."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def __call__(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        if request.request_id == "bad":
            raise EngineRequestError("max_tokens is too large")
        if request.request_id.startswith("slow"):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.append(request.request_id)
                raise
        for i in range(len(request.prompt_token_ids)):
            yield StreamChunk(f"t{i}", 1, i + 1, len(request.prompt_token_ids))


async def until(condition: Callable[[], object], timeout_s: float = 1.0) -> None:
    """Wait for `condition` (polled each 10 ms) for up to `timeout_s`; the caller asserts."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)


async def connected() -> tuple[DirectServer, DirectDispatch, Generate, Placement]:
    generate = Generate()
    server = DirectServer(generate)
    await server.start()
    dispatch = DirectDispatch("node")
    placement = Placement(node_id="node", dispatch_path=server.path)
    assert dispatch.pick([("r", placement)]) is None  # opening: the Serve call meanwhile
    await until(lambda: dispatch.pick([("r", placement)]) is not None)
    return server, dispatch, generate, placement


async def test_chunks_then_the_end_and_errors_come_back_per_request() -> None:
    server, dispatch, _, placement = await connected()
    connection = dispatch.pick([("r", placement)])
    assert connection is not None
    a = connection.call(GenerationRequest("a", [1, 2, 3], 3))
    bad = connection.call(GenerationRequest("bad", [1], 1))
    b = connection.call(GenerationRequest("b", [1, 2], 2))
    assert [c.text async for c in a] == ["t0", "t1", "t2"]
    assert [c.text async for c in b] == ["t0", "t1"]
    with pytest.raises(EngineRequestError, match="max_tokens"):
        await anext(bad)
    assert not connection.calls  # every call that ended is forgotten
    dispatch.stop()
    server.drain()


async def test_a_cancelled_call_aborts_its_generate() -> None:
    server, dispatch, generate, placement = await connected()
    connection = dispatch.pick([("r", placement)])
    assert connection is not None
    slow = connection.call(GenerationRequest("slow", [1], 1))
    await asyncio.sleep(0.1)
    slow.cancel()
    await until(lambda: generate.cancelled)
    assert generate.cancelled == ["slow"]
    dispatch.stop()
    server.drain()


async def test_a_lost_connection_fails_its_calls_as_a_dead_replica() -> None:
    server, dispatch, generate, placement = await connected()
    connection = dispatch.pick([("r", placement)])
    assert connection is not None
    slow = connection.call(GenerationRequest("slow-1", [1], 1))
    await asyncio.sleep(0.1)
    connection.close()  # as when the replica's process dies
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(anext(slow), 5)
    assert connection.closed
    await until(lambda: generate.cancelled)  # the replica's end aborts what it brought
    assert generate.cancelled == ["slow-1"]
    server.drain()


async def test_direct_only_while_every_replica_of_the_pool_can_be_reached_so() -> None:
    """A replica on another node, or one that does not listen, gets requests only through
    Serve's routing: were the others reached directly, it would get none."""
    server, dispatch, _, placement = await connected()
    elsewhere = Placement(node_id="other", dispatch_path=server.path)
    assert dispatch.pick([("x", elsewhere), ("r", placement)]) is None
    assert dispatch.pick([("y", Placement(node_id="node")), ("r", placement)]) is None
    assert dispatch.pick([("r", placement)]) is not None
    assert dispatch.connected(server.path) and not dispatch.connected("")
    dispatch.stop()
    server.drain()


async def test_the_socket_has_no_file_and_answers_only_its_own_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, dispatch, _, _ = await connected()
    assert server.path.startswith("\0")  # Linux's abstract namespace: nothing on disk
    dispatch.stop()
    uid = os.getuid()
    monkeypatch.setattr(direct.os, "getuid", lambda: uid + 1)  # as if another user
    reader, writer = await direct.connect(server.path)
    direct.write_frame(writer, direct.REQUEST, "a", GenerationRequest("a", [1], 1))
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):  # closed, unanswered
        await asyncio.wait_for(direct.read_frame(reader), 5)
    writer.close()
    server.drain()


async def test_a_draining_replica_gets_no_more_but_ends_what_it_has() -> None:
    server, dispatch, generate, placement = await connected()
    connection = dispatch.pick([("r", placement)])
    assert connection is not None
    slow = connection.call(GenerationRequest("slow", [1], 1))
    quick = connection.call(GenerationRequest("q", [1, 2], 2))
    await asyncio.sleep(0.05)
    assert server.in_flight == 1  # "q" ended, "slow" runs on
    server.drain()
    await until(lambda: connection.draining)
    assert connection.draining and not dispatch.connected(server.path)
    assert dispatch.pick([("r", placement)]) is None  # by Serve meanwhile, not reopened
    assert [c.text async for c in quick] == ["t0", "t1"]
    assert not await server.drained(0.1)  # "slow" still running: cut short
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(anext(slow), 5)
    await until(lambda: generate.cancelled)
    assert generate.cancelled == ["slow"]
    dispatch.stop()


async def test_past_the_limit_a_request_goes_by_serve() -> None:
    server, dispatch, _, placement = await connected()
    connection = dispatch.pick([("r", placement)], limit=2)
    assert connection is not None
    calls = [connection.call(GenerationRequest(f"slow-{i}", [1], 1)) for i in range(2)]
    assert dispatch.pick([("r", placement)], limit=2) is None
    assert dispatch.pick([("r", placement)], limit=3) is connection
    for call in calls:
        call.cancel()
    dispatch.stop()
    server.drain()


async def test_the_board_s_replicas_are_connected_ahead_and_dropped_ones_let_go() -> None:
    generate = Generate()
    server = DirectServer(generate)
    await server.start()
    dispatch = DirectDispatch("node")
    placement = Placement(node_id="node", dispatch_path=server.path)
    dispatch.follow([placement, Placement(node_id="other", dispatch_path="\0elsewhere")])
    await until(lambda: dispatch.connected(server.path))  # before any request
    connection = dispatch.pick([("r", placement)])
    assert connection is not None
    slow = connection.call(GenerationRequest("slow", [1], 1))
    dispatch.follow([])  # dropped by the board, but a call of this ingress is on it
    assert dispatch.connected(server.path)
    slow.cancel()
    dispatch.follow([])
    assert not dispatch.connected(server.path)
    await until(lambda: connection.closed)
    assert connection.closed
    server.drain()


class Writer:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


async def test_what_one_turn_of_the_loop_produced_goes_out_in_one_write() -> None:
    writer = Writer()
    outbox = direct.Outbox(writer)  # type: ignore[arg-type]
    for key in ("a", "b", "c"):  # three streams woken by one engine step
        outbox.put(direct.CHUNK, key, StreamChunk(key, 1, 1, 1))
    assert writer.writes == []
    await asyncio.sleep(0)
    assert len(writer.writes) == 1
    reader = asyncio.StreamReader()
    reader.feed_data(writer.writes[0])
    frames = [await direct.read_frame(reader) for _ in range(3)]
    assert [(kind, key, chunk.text) for kind, key, chunk in frames] == [
        (direct.CHUNK, k, k) for k in ("a", "b", "c")
    ]
    outbox.put(direct.END, "a")
    await asyncio.sleep(0)
    assert len(writer.writes) == 2


async def test_a_channel_over_the_socket_brings_its_messages_and_closes_with_its_connection() -> (
    None
):
    """An engine frontend's channel to an ingress on its node (ChannelServer): the hello and
    the batches as frames; the ingress closing the connection closes the channel there."""
    channels = Channels("replica-1/1")
    server = direct.ChannelServer(channels.serve)
    await server.start()
    try:
        messages, close = await direct.channel_messages(server.path, "ingress-a")
        assert await anext(messages) == ChannelHello("replica-1/1", accepted=True)
        channel = channels.acquire("ingress-a")
        assert channel is not None
        chunk = StreamChunk("", 1, 1, 2)
        channel.put("r1", chunk)
        channel.put("r1", None)
        assert await anext(messages) == [("r1", chunk), ("r1", None)]
        # a second connection of the same ingress is not accepted, and ends
        again, _ = await direct.channel_messages(server.path, "ingress-a")
        assert [m async for m in again] == [ChannelHello("replica-1/1", accepted=False)]
        close()
        await until(lambda: len(channels) == 0)
        assert not channel.open
    finally:
        server.stop()
