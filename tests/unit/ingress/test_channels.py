"""Stream channels end to end in one process: an ingress's channels to a replica of the fake
engine, through in-process handles (serve_app.local), as the pipeline uses them."""

import asyncio
from typing import Any

import pytest

from serve_app.engine.fake import FakeEngine
from serve_app.engine.protocol import GenerationRequest, StreamChunk
from serve_app.engine.replica import EngineReplica
from serve_app.ingress.channels import CallCancelled, ChannelStream, IngressChannels
from serve_app.local import LocalHandle
from serve_app.profiles import EngineArgs, EngineProfile, Platform

PROFILE = EngineProfile(
    name="p", model="m", engine=EngineArgs(max_model_len=1024, kv_cache_memory_bytes=1 << 28)
).resolve(Platform.CPU)


class CountingHandle(LocalHandle):
    """Counts the messages each kind of call sends back."""

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self.messages = {"generate": 0, "channel": 0}

    def __getattr__(self, name: str) -> Any:
        method = super().__getattr__(name)
        if name not in self.messages:
            return method
        handle = self

        class Counted:
            def remote(self, *args: Any) -> Any:
                stream = method.remote(*args)
                inner = stream._gen

                async def counted() -> Any:
                    async for message in inner:
                        handle.messages[name] += 1
                        yield message

                stream._gen = counted()
                return stream

        return Counted()


async def make(enabled: bool = True) -> tuple[IngressChannels, CountingHandle, FakeEngine]:
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(PROFILE, None, FakeEngine)  # type: ignore[misc]
    handle = CountingHandle(replica)
    channels = IngressChannels({"p": handle}, "ingress-a", ["p"] if enabled else [])
    return channels, handle, replica._engine  # type: ignore[return-value]


async def open_channel(channels: IngressChannels) -> None:
    channels.want("p", [PROFILE_REPLICA])
    for _ in range(100):
        if channels.open_to("p"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no channel opened")


PROFILE_REPLICA = "replica-of-p"


def dispatch(channels: IngressChannels, handle: Any, key: str, tokens: int) -> ChannelStream:
    carried = channels.may_carry(key)
    request = GenerationRequest(key, [1, 2], tokens, channel="ingress-a" if carried else "")
    return channels.stream(key, handle.generate.remote(request), carried)


async def read(stream: ChannelStream) -> list[StreamChunk]:
    return [c async for c in stream]


async def test_streams_arrive_whole_in_fewer_messages_than_chunks() -> None:
    channels, handle, _ = await make()
    await open_channel(channels)
    streams = [dispatch(channels, handle, f"r{i}", 20) for i in range(8)]
    results = await asyncio.gather(*(read(s) for s in streams))
    for chunks in results:
        assert [c.completion_tokens for c in chunks] == list(range(1, 21))
        assert chunks[-1].finish_reason == "length"
    assert handle.messages["generate"] == 0  # every chunk came on the channel
    # 160 chunks; the fake engine's streams step on their own timers, so batches are partial,
    # but never a message per chunk
    assert 1 < handle.messages["channel"] - 1 < 160, handle.messages
    assert not channels._streams  # nothing left registered
    channels.stop()


async def test_without_a_channel_the_request_streams_on_its_own_call() -> None:
    channels, handle, _ = await make()  # no channel opened yet
    chunks = await read(dispatch(channels, handle, "r", 5))
    assert [c.completion_tokens for c in chunks] == [1, 2, 3, 4, 5]
    assert handle.messages == {"generate": 5, "channel": 0}
    disabled, handle, _ = await make(enabled=False)
    assert not disabled.may_carry("r")
    disabled.want("p", [PROFILE_REPLICA])
    await asyncio.sleep(0.05)
    assert not disabled.open_to("p") and handle.messages["channel"] == 0


async def test_a_second_stream_with_the_same_id_goes_on_its_own_call() -> None:
    channels, handle, _ = await make()
    await open_channel(channels)
    first = dispatch(channels, handle, "same", 10)
    assert not channels.may_carry("same")
    second = dispatch(channels, handle, "same", 10)
    a, b = await asyncio.gather(read(first), read(second))
    assert len(a) == len(b) == 10
    assert handle.messages["generate"] == 10  # the second's chunks only


async def test_a_stream_read_only_to_its_last_token_leaves_nothing_behind() -> None:
    # as a non-streamed response reads it: up to the chunk with the finish reason, then closed
    for opened in (True, False):  # its chunks on the channel, or on its own call
        channels, handle, _ = await make()
        if opened:
            await open_channel(channels)
        stream = dispatch(channels, handle, "whole", 5)
        while (await anext(stream)).finish_reason is None:
            pass
        for _ in range(100):
            if not channels._streams:
                break
            await asyncio.sleep(0.01)
        assert not channels._streams, opened


async def test_a_cancelled_stream_is_aborted_in_the_engine() -> None:
    channels, handle, engine = await make()
    await open_channel(channels)
    stream = dispatch(channels, handle, "gone", 1000)
    assert (await anext(stream)).completion_tokens == 1
    assert engine.running == 1
    stream.cancel()
    for _ in range(100):
        if engine.running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.running == 0 and not channels._streams
    # the channel goes on serving others
    assert len(await read(dispatch(channels, handle, "next", 3))) == 3


async def test_a_second_channel_to_the_same_replica_is_refused() -> None:
    channels, handle, _ = await make()
    await open_channel(channels)
    hello = await anext(handle.channel.remote("ingress-a"))
    assert not hello.accepted
    assert channels.open_to("p") == {hello.replica_id}


class CancelledOnTheReplica:
    """A pool call whose task the replica's side cancelled: Ray raises that in the caller as
    asyncio.CancelledError from the call's stream, though nobody cancelled the caller."""

    def __init__(self, chunks_first: int) -> None:
        self._left = chunks_first
        self.cancelled = False

    def __aiter__(self) -> "CancelledOnTheReplica":
        return self

    async def __anext__(self) -> StreamChunk:
        await asyncio.sleep(0)
        if self._left == 0:
            raise asyncio.CancelledError
        self._left -= 1
        return StreamChunk("x", 1, 1, 1)

    def cancel(self) -> None:
        self.cancelled = True


async def test_a_call_cancelled_on_the_replica_ends_the_stream_with_an_error() -> None:
    # before its first chunk, or after some: the reader is told, rather than left waiting
    # (and its request left counted and protected in routing) for chunks that never come
    for chunks_first in (0, 2):
        for carried in (False, True):
            streams: dict[str, ChannelStream] = {}
            stream = ChannelStream(
                "r", CancelledOnTheReplica(chunks_first), streams if carried else None
            )
            for _ in range(chunks_first):
                assert (await asyncio.wait_for(anext(stream), 1)).completion_tokens == 1
            with pytest.raises(CallCancelled):
                await asyncio.wait_for(anext(stream), 1)
            assert not streams
    # the ingress's own cancel still ends it quietly
    own = CancelledOnTheReplica(1000)
    stream = ChannelStream("r", own, None)
    await anext(stream)
    stream.cancel()
    assert own.cancelled
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
