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
    assert channels.get("ingress-a") is not None
    again = [m async for m in channels.serve("ingress-a")]
    assert again == [ChannelHello("replica-1", accepted=False)]
    assert channels.get("ingress-b") is None and channels.get("") is None
    await first.aclose()  # the ingress closed it
    assert channels.get("ingress-a") is None and len(channels) == 0


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
