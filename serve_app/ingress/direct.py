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

from serve_app.engine.direct import DirectConnection, connect
from serve_app.engine.protocol import Placement

logger = logging.getLogger("ray.serve")


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
