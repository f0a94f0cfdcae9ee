"""Direct dispatch, the ingress's end (engine/direct.py): one kept connection per pool replica
of this node that listens, requests written there instead of Serve calls.

A request goes direct only while every replica the board lists for its pool is on this node and
connected (else Serve balances over all of them), to the one with the fewest of this ingress's
calls, and only while that one has fewer than `limit` (the pool's max_ongoing_requests): past it
the request goes by Serve, which queues it or refuses it as it would any call. A replica that
said it is draining gets no more; it stays known, so that it is not opened again, until the
board no longer lists it (`follow`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from serve_app.engine.direct import (
    CANCEL,
    DRAINING,
    END,
    REQUEST,
    connect,
    read_frame,
    write_frame,
)
from serve_app.engine.protocol import EngineDeadError, GenerationRequest, Placement, StreamChunk

logger = logging.getLogger("ray.serve")

_END = object()


class DirectCall:
    """One request's own call over a connection: its chunks, then its end or its error."""

    def __init__(self, connection: DirectConnection, key: str) -> None:
        self._connection = connection
        self._key = key
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> DirectCall:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, StreamChunk):
            return item
        self._done = True
        self._connection.ended(self._key)
        if isinstance(item, BaseException):
            raise item
        raise StopAsyncIteration

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._connection.cancel(self._key)


class DirectConnection:
    def __init__(self, path: str, reader: asyncio.StreamReader, writer: Any) -> None:
        self.path = path
        self._reader = reader
        self._writer = writer
        self.calls: dict[str, DirectCall] = {}
        self.closed = False
        self.draining = False  # the replica is stopping: no more requests to it
        self._task = asyncio.get_running_loop().create_task(self._read())

    def call(self, request: GenerationRequest) -> DirectCall:
        call = DirectCall(self, request.request_id)
        self.calls[request.request_id] = call
        write_frame(self._writer, REQUEST, request.request_id, request)
        return call

    def ended(self, key: str) -> None:
        self.calls.pop(key, None)

    def cancel(self, key: str) -> None:
        if self.calls.pop(key, None) is not None and not self.closed:
            write_frame(self._writer, CANCEL, key)

    async def _read(self) -> None:
        try:
            while True:
                kind, key, payload = await read_frame(self._reader)
                if kind == DRAINING:
                    self.draining = True
                    logger.info("direct dispatch to %r: the replica is draining", self.path)
                    continue
                call = self.calls.get(key)
                if call is not None:  # a chunk, or the exception its call raised
                    call.queue.put_nowait(_END if kind == END else payload)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            logger.info("direct dispatch to %r closed: %r", self.path, e)
        finally:
            self.closed = True
            for call in list(self.calls.values()):
                call.queue.put_nowait(EngineDeadError("the replica's connection closed"))
            self.calls.clear()
            self._writer.close()

    def close(self) -> None:
        self._task.cancel()


class DirectDispatch:
    """This ingress's connections, by socket path; the replica with the fewest of its calls."""

    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self._connections: dict[str, DirectConnection] = {}
        self._opening: dict[str, asyncio.Task[None]] = {}  # held: the loop keeps weak refs

    def pick(
        self, placements: Iterable[tuple[str, Placement]], limit: int | None = None
    ) -> DirectConnection | None:
        """The connection with the fewest of this ingress's calls, if every replica listed is
        on this node and connected (draining ones left out), and it has room; else None (the
        request goes by Serve). Connections missing are opened meanwhile."""
        best: DirectConnection | None = None
        reachable = True
        for _, placement in placements:
            path = placement.dispatch_path
            if not path or placement.node_id != self._node_id:
                return None
            connection = self._connections.get(path)
            if connection is not None and connection.draining:
                continue
            if connection is None or connection.closed:
                self._open(path)
                reachable = False
            elif best is None or len(connection.calls) < len(best.calls):
                best = connection
        if not reachable or best is None:
            return None
        return best if limit is None or len(best.calls) < limit else None

    def connected(self, path: str) -> bool:
        connection = self._connections.get(path)
        return connection is not None and not connection.closed and not connection.draining

    def follow(self, placements: Iterable[Placement]) -> None:
        """The board's replicas, every pool's: open a connection to each on this node that
        listens (before a request needs it), and forget those to replicas no longer listed
        once no call of this ingress is on them (a draining replica's streams run on after the
        board drops it)."""
        keep = set()
        for placement in placements:
            path = placement.dispatch_path
            if path and placement.node_id == self._node_id:
                keep.add(path)
                if path not in self._connections:
                    self._open(path)
        for path, connection in list(self._connections.items()):
            if path not in keep and (connection.closed or not connection.calls):
                del self._connections[path]
                connection.close()

    def _open(self, path: str) -> None:
        if path in self._opening:
            return

        async def open_() -> None:
            try:
                reader, writer = await connect(path)
                self._connections[path] = DirectConnection(path, reader, writer)
            except OSError as e:
                logger.warning("direct dispatch to %r failed to open: %r", path, e)
                await asyncio.sleep(1.0)
            finally:
                self._opening.pop(path, None)

        self._opening[path] = asyncio.get_running_loop().create_task(open_())

    def stop(self) -> None:
        for task in list(self._opening.values()):
            task.cancel()
        for connection in self._connections.values():
            connection.close()
