"""The ingress's end of the stream channels (engine/channel.py): one per pool replica.

When it dispatches a request, the ingress opens channels to the replicas the board lists for the
pool that lack one, if the pool's profile asks for them (`pool.stream_channel`); a replica ends a
channel no stream has used for engine/channel.IDLE_S. Serve routes a channel call like any
other, so the ingress cannot name the replica: it opens one call at a time per pool until
every listed replica has answered with an accepted hello (a replica it already reaches
answers "not accepted" and the call ends). A request dispatched meanwhile, or to a replica
the ingress has no channel to yet, gets its chunks on its own call, as without channels.

`ChannelStream` is what the pipeline iterates for one request either way: the chunks of its own
call and those the channels bring for it, in the order they arrive, ending with its last chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, cast

from serve_app.engine import direct
from serve_app.engine.channel import Batch, ChannelHello
from serve_app.engine.protocol import StreamChunk

logger = logging.getLogger("ray.serve")

HELLO_TIMEOUT_S = 10.0
RETRY_S = 1.0  # after a failed or refused channel call, wait this long before the next one
# Own call ended before the last chunk: the channel's message with it is still on its way.
IN_FLIGHT_S = 5.0


class CallCancelled(Exception):
    """The request's own call was cancelled on the replica's side, not by this ingress (Ray
    raises a task cancelled there as asyncio.CancelledError in the caller): the call is over,
    with no chunk more to come on it."""


class _Ended:
    """The request's own call ended (without error)."""


ENDED = _Ended()
Item = StreamChunk | BaseException | _Ended | None  # None: a channel says the stream ended


class ChannelStream:
    """One request's chunks, whichever way they come (the pipeline's ChunkStream).

    The stream ends when its own call ends having carried chunks (no channel did), or when a
    channel says so. Its own call ending without chunks means a channel carried them: its end
    is then on the way, and waited for up to IN_FLIGHT_S.
    """

    def __init__(self, key: str, own: Any, streams: dict[str, ChannelStream] | None) -> None:
        self._key = key
        self._own = own
        self._streams = streams if streams is not None else {}
        self._carried = streams is not None
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._done = False
        self._own_chunks = 0
        self._own_ended = False
        if streams is not None:
            streams[key] = self
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def deliver(self, chunk: StreamChunk | None) -> None:
        self._queue.put_nowait(chunk)
        if chunk is None:  # nothing more will come for it: free its key now, read or not
            self._release()

    async def _watch(self) -> None:
        try:
            async for chunk in self._own:
                self._own_chunks += 1
                self._queue.put_nowait(chunk)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._done or (task is not None and task.cancelling()):
                raise  # cancel() or the loop's shutdown: nobody waits for more
            # cancelled on the replica's side: the reader would otherwise wait forever (and
            # its request stay counted, and protected, in routing)
            self._queue.put_nowait(CallCancelled(self._key))
            self._release()
        except BaseException as e:
            self._queue.put_nowait(e)
            self._release()
        else:
            self._queue.put_nowait(ENDED)
            if self._own_chunks:  # its own call carried it: no channel will bring more
                self._release()

    def __aiter__(self) -> ChannelStream:
        return self

    async def __anext__(self) -> StreamChunk:
        while not self._done:
            if self._own_ended:
                try:
                    item = await asyncio.wait_for(self._queue.get(), IN_FLIGHT_S)
                except TimeoutError:
                    break
            else:
                item = await self._queue.get()
            if isinstance(item, StreamChunk):
                return item
            if isinstance(item, BaseException):
                self._finish()
                raise item
            if item is None:  # a channel brought the end
                break
            self._own_ended = True
            if self._own_chunks or not self._carried:
                break  # no channel carried it: that was all
        self._finish()
        raise StopAsyncIteration

    def _finish(self) -> None:
        self._done = True
        self._release()

    def _release(self) -> None:
        if self._streams.get(self._key) is self:
            del self._streams[self._key]

    def cancel(self) -> None:
        """The client went away or the ingress failed: abort the request in the engine."""
        self._finish()
        self._watcher.cancel()
        self._own.cancel()


class IngressChannels:
    """This ingress's channels to the pools' replicas, and the streams they deliver to."""

    def __init__(
        self,
        pools: Mapping[str, Any],
        ingress_id: str,
        enabled: Iterable[str],
        node_id: str = "",
    ) -> None:
        """`node_id`: this ingress's node (an engine frontend there is reached by its socket)."""
        self._pools = pools
        self._ingress_id = ingress_id
        self._node_id = node_id
        self._enabled = frozenset(enabled)
        self._streams: dict[str, ChannelStream] = {}
        self._open: dict[str, set[str]] = {pool: set() for pool in self._enabled}
        self._opening: dict[str, asyncio.Task[None]] = {}
        self._readers: set[asyncio.Task[None]] = set()
        self._frontends: set[str] = set()  # engine frontends (actor ids) with a channel
        self._by_socket: set[str] = set()  # the open channels that came over a socket
        # the engine frontends the pools' replicas named, by actor id: the handle, and the
        # channel socket to use ("": the Ray call)
        self._known: dict[str, dict[str, tuple[Any, str]]] = {pool: {} for pool in self._enabled}

    @property
    def ingress_id(self) -> str:
        return self._ingress_id

    def open_to(self, pool: str) -> frozenset[str]:
        """The replicas of `pool` this ingress has a channel to, and their engine frontends
        (`<replica id>/<index>`)."""
        return frozenset(self._open.get(pool, ()))

    def by_socket(self) -> frozenset[str]:
        """The open channels (of `open_to`'s) that this ingress reads over a socket."""
        return frozenset(self._by_socket)

    def want(self, pool: str, replica_ids: Iterable[str]) -> None:
        """Open channels to the replicas of `pool` that lack one (one call at a time)."""
        if pool not in self._enabled:
            return
        for key, (frontend, path) in self._known[pool].items():
            self._want_frontend(pool, key, frontend, path)  # never opened, or closed when idle
        if pool in self._opening or set(replica_ids) <= self._open[pool]:
            return
        task = asyncio.get_running_loop().create_task(self._open_one(pool))
        self._opening[pool] = task
        task.add_done_callback(lambda _: self._opening.pop(pool, None))

    def may_carry(self, key: str) -> bool:
        """Whether a channel may carry the stream of request `key` (no other stream has it)."""
        return bool(self._enabled) and key not in self._streams

    def stream(self, key: str, own: Any, carried: bool) -> ChannelStream:
        """Track one request's chunks: its own call's and, when `carried`, the channels'.

        Call it right after dispatching (no await between), so no chunk arrives untracked.
        """
        return ChannelStream(key, own, self._streams if carried else None)

    async def _open_one(self, pool: str) -> None:
        stream = self._pools[pool].channel.remote(self._ingress_id)
        try:
            # a replica at its max_ongoing_requests leaves the call queued: give up, try again
            hello = cast(ChannelHello, await asyncio.wait_for(anext(stream), HELLO_TIMEOUT_S))
        except Exception as e:
            logger.warning("pool %s: stream channel failed to open: %r", pool, e)
            stream.cancel()
            await asyncio.sleep(RETRY_S)
            return
        local = hello.node_id == self._node_id
        for i, frontend in enumerate(hello.frontends):
            key = frontend._actor_id.hex()
            path = hello.sockets[i] if local and i < len(hello.sockets) else ""
            self._known[pool][key] = (frontend, path)
            self._want_frontend(pool, key, frontend, path)
        if not hello.accepted:  # Serve routed it to a replica already reached
            await asyncio.sleep(RETRY_S / 10)
            return
        self._open[pool].add(hello.replica_id)
        logger.debug("pool %s: stream channel to replica %s open", pool, hello.replica_id)
        self._start(self._read(pool, hello.replica_id, stream, stream.cancel))

    def _want_frontend(self, pool: str, key: str, frontend: Any, path: str) -> None:
        if key not in self._frontends:
            self._frontends.add(key)
            self._start(self._open_frontend(pool, key, frontend, path))

    async def _open_frontend(self, pool: str, key: str, frontend: Any, path: str) -> None:
        """A channel to one of a replica's engine frontends (engine/frontend.py): over its
        socket (`path`, on this node), else a Ray actor call, not a Serve one, the frontend
        being named. One that fails to open is forgotten until a replica names it again."""
        cancel: Callable[[], None] | None = None
        try:
            try:
                stream, cancel = await self._frontend_channel(frontend, path)
                hello = cast(ChannelHello, await asyncio.wait_for(anext(stream), HELLO_TIMEOUT_S))
            except Exception as e:
                logger.warning("pool %s: stream channel to a frontend failed: %r", pool, e)
                self._known[pool].pop(key, None)
                if cancel is not None:
                    cancel()
                return
            if not hello.accepted:
                cancel()  # (the frontend ended it: closes this end of a socket)
                return
            logger.debug("pool %s: stream channel to frontend %s open", pool, hello.replica_id)
            self._open[pool].add(hello.replica_id)
            if path:
                self._by_socket.add(hello.replica_id)
            await self._read(pool, hello.replica_id, stream, cancel)
        finally:
            self._frontends.discard(key)

    async def _frontend_channel(
        self, frontend: Any, path: str
    ) -> tuple[AsyncIterator[Any], Callable[[], None]]:
        """A frontend channel's messages, and how to close it."""
        if path:
            return await direct.channel_messages(path, self._ingress_id)
        import ray

        call = frontend.channel.options(num_returns="streaming").remote(self._ingress_id)

        def cancel() -> None:
            if ray.is_initialized():
                ray.cancel(call)

        return _values(call), cancel

    def _start(self, reader: Any) -> None:
        task = asyncio.get_running_loop().create_task(reader)
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)

    async def _read(self, pool: str, replica_id: str, stream: Any, cancel: Any) -> None:
        try:
            async for batch in stream:
                streams = self._streams
                for key, chunk in cast(Batch, batch):
                    target = streams.get(key)
                    if target is not None:
                        target.deliver(chunk)
        except asyncio.CancelledError:
            cancel()
            raise
        except Exception as e:  # the replica is gone: its requests fail on their own calls
            logger.info("pool %s: stream channel to %s closed: %r", pool, replica_id, e)
        finally:
            self._open[pool].discard(replica_id)
            self._by_socket.discard(replica_id)

    def stop(self) -> None:
        for task in (*self._opening.values(), *self._readers):
            task.cancel()


async def _values(call: Any) -> AsyncIterator[Any]:
    """The values of a Ray streaming call (an ObjectRefGenerator), as they come."""
    async for ref in call:
        yield await ref
