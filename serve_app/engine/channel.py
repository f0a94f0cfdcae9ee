"""Stream channels: one message per engine step for all of an ingress's streams on a replica.

Without a channel every chunk of every stream is a message of its own between the pool replica
and the ingress (pickled, framed, sent, received, unpickled and woken up for, on both sides):
with N streams open that is N messages per engine step, and the replica must coalesce
(engine/coalesce.py) to keep the message rate within what the two processes can handle, which
makes streams chunky. An ingress opens one long-lived call per pool replica (`channel`); the
replica then puts the chunks of that ingress's streams on it instead of on each request's own
stream, and sends whatever accumulated as one message: the streams woken by one engine step
travel together, so messages scale with steps, not streams.

A request's own call stays open until it ends: it carries errors, cancellation (the client went
away) and Serve's request accounting, and its chunks whenever its ingress has no channel to this
replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from serve_app.engine.coalesce import MIN_COALESCE_S, MessageBudget
from serve_app.engine.protocol import GenerationRequest, StreamChunk
from serve_app.timing import Stage, elapsed_ms

# A channel no stream has used for this long ends (the ingress opens another when it next
# dispatches): a replica Serve is draining gets no new streams, so its channels end and do not
# hold up its shutdown as calls in flight.
IDLE_S = 2.0

# (request id, chunk or None: that stream's end), in the order they were produced
Batch = list[tuple[str, StreamChunk | None]]


@dataclass(frozen=True, slots=True)
class ChannelHello:
    """A channel's first message: which replica it reaches, and whether it is open.

    Not accepted: the ingress already has a channel to this replica (Serve routed the call to a
    replica it had reached before); the call ends at once. `frontends`: the Ray actor handles
    of the replica's engine frontends (engine/frontend.py), each to be given a channel too;
    `sockets`: where each takes channels over a socket ("": by its Ray call only), reachable
    from node `node_id` (the replica's, where its frontends run).
    """

    replica_id: str
    accepted: bool
    frontends: tuple[Any, ...] = ()
    sockets: tuple[str, ...] = ()
    node_id: str = ""


class Channel:
    """The chunks waiting to go to one ingress."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self._pending: Batch = []
        self._ready = asyncio.Event()
        self._idle_s = idle_s
        self.open = True
        self.streams = 0  # streams sending on it now

    def put(self, request_id: str, chunk: StreamChunk | None) -> None:
        self._pending.append((request_id, chunk))
        self._ready.set()

    async def batches(self) -> AsyncIterator[Batch]:
        """Everything put since the last batch, once there is something; ends once idle."""
        while True:
            try:
                await asyncio.wait_for(self._ready.wait(), self._idle_s)
            except TimeoutError:
                if self.streams == 0 and not self._pending:
                    return
                continue
            # One turn of the loop: the other streams woken by the same engine step add theirs.
            await asyncio.sleep(0)
            self._ready.clear()
            batch, self._pending = self._pending, []
            yield batch


class Channels:
    """A replica's (or an engine frontend's) open channels, by ingress id."""

    def __init__(self, replica_id: str, idle_s: float = IDLE_S) -> None:
        self._replica_id = replica_id
        self._idle_s = idle_s
        self._open: dict[str, Channel] = {}
        # named in the hello (ChannelHello)
        self.frontends: tuple[Any, ...] = ()
        self.sockets: tuple[str, ...] = ()
        self.node_id = ""

    def acquire(self, ingress_id: str) -> Channel | None:
        """The open channel to `ingress_id` for one more stream (`release` it when done)."""
        channel = self._open.get(ingress_id) if ingress_id else None
        if channel is None or not channel.open:
            return None
        channel.streams += 1
        return channel

    async def serve(self, ingress_id: str) -> AsyncGenerator[ChannelHello | Batch, None]:
        """A channel's messages: the hello, then batches until the ingress closes it."""
        if ingress_id in self._open:
            yield self._hello(accepted=False)
            return
        channel = self._open[ingress_id] = Channel(self._idle_s)
        try:
            yield self._hello(accepted=True)
            async for batch in channel.batches():
                yield batch
        finally:
            # Streams still running send on their own calls from now on; chunks still pending
            # here are lost with the ingress that was to read them.
            channel.open = False
            del self._open[ingress_id]

    def _hello(self, accepted: bool) -> ChannelHello:
        return ChannelHello(self._replica_id, accepted, self.frontends, self.sockets, self.node_id)

    def __len__(self) -> int:
        return len(self._open)


async def relay(
    chunks: AsyncIterator[StreamChunk],
    request: GenerationRequest,
    channel: Channel | None,
    received: float,
    budget: MessageBudget | None = None,
    streams: Callable[[], int] = lambda: 1,
) -> AsyncGenerator[tuple[StreamChunk, bool], None]:
    """Send one stream's chunks: on `channel` while it is open, else back to the caller to go on
    the request's own call. Yields (chunk, carried): carried chunks went on a channel, and the
    caller only takes note of them. A chunk that is already a receipt (`StreamChunk.carried`:
    an engine frontend sent it on its own channel) is yielded as carried and not sent again.

    Under load the stream is coalesced: after a message it waits its share of `budget` before
    taking the next output, and the engine merges the deltas produced meanwhile into one (vLLM's
    DELTA outputs accumulate until read). The first token always goes at once; with few streams
    the share is shorter than an engine step, so every step goes out as it comes.
    """
    first = True
    receipts = False
    async for chunk in chunks:
        if chunk.carried:
            receipts = True
            yield chunk, True
            continue
        if first and chunk.num_tokens:
            first = False
            if request.sent_at:
                chunk.stages = chunk.stages or {}
                chunk.stages.setdefault(Stage.DISPATCH, elapsed_ms(request.sent_at, received))
        chunk.sent_at = time.time()
        carried = channel is not None and channel.open
        if carried:
            channel.put(request.request_id, chunk)  # type: ignore[union-attr]
        yield chunk, carried
        if budget is not None and chunk.finish_reason is None:
            gap_s = budget.gap_s(streams())
            if gap_s > MIN_COALESCE_S:
                await asyncio.sleep(gap_s)
    # The stream's end, unless a frontend's channel carries it (two channels are not ordered:
    # an end sent here could overtake that channel's last chunks).
    if channel is not None and channel.open and not receipts:
        channel.put(request.request_id, None)


def receipt(chunk: StreamChunk) -> StreamChunk:
    """What an engine frontend tells its replica of a chunk it sent on its own channel."""
    return replace(chunk, data=None, stages=None, carried=True)
