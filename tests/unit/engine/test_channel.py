"""A replica's stream channels: one per ingress, batches of every stream's chunks."""

import asyncio

from serve_app.engine.channel import Channel, ChannelHello, Channels
from serve_app.engine.protocol import StreamChunk


def chunk(text: str) -> StreamChunk:
    return StreamChunk(text, 1, 1, 1)


async def test_an_ingress_gets_one_channel_per_replica() -> None:
    channels = Channels("replica-1")
    first = channels.serve("ingress-a")
    assert await anext(first) == ChannelHello("replica-1", accepted=True)
    assert channels.acquire("ingress-a") is not None
    again = [m async for m in channels.serve("ingress-a")]
    assert again == [ChannelHello("replica-1", accepted=False)]
    assert channels.acquire("ingress-b") is None and channels.acquire("") is None
    await first.aclose()  # the ingress closed it
    assert channels.acquire("ingress-a") is None and len(channels) == 0


async def test_a_channel_ends_once_no_stream_has_used_it_for_a_while() -> None:
    # so that a replica Serve drains (no new streams) is not kept up by its channels
    channels = Channels("replica-1", idle_s=0.05)
    messages = channels.serve("ingress-a")
    await anext(messages)
    channel = channels.acquire("ingress-a")
    assert channel is not None
    waiting = asyncio.ensure_future(anext(messages))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # a stream holds it
    channel.streams -= 1
    try:
        await asyncio.wait_for(waiting, 1)
        raise AssertionError("a batch from an idle channel")
    except StopAsyncIteration:
        pass
    assert len(channels) == 0 and channels.acquire("ingress-a") is None


async def test_what_streams_put_in_one_turn_leaves_as_one_batch() -> None:
    channel = Channel()
    batches = channel.batches()
    waiting = asyncio.ensure_future(anext(batches))
    await asyncio.sleep(0)

    async def stream(key: str) -> None:
        channel.put(key, chunk(key))

    # as one engine step wakes several streams: all run before the channel takes its batch
    await asyncio.gather(*(stream(k) for k in "abc"))
    assert [k for k, _ in await waiting] == ["a", "b", "c"]
    channel.put("a", None)
    assert await anext(batches) == [("a", None)]
