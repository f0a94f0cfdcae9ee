"""Direct dispatch (prototype): requests over a kept Unix socket, ingress -> pool replica.

The replica listens on a socket of its own; an ingress on its node keeps one connection to it
and writes each request there instead of making a Serve call. The replica runs the same
`generate()` and sends back on that connection what the request's own Serve call would carry
(its chunks when no stream channel does, its error, its end); a cancel frame aborts it.
Frames: (kind, request id, payload), pickled, length-prefixed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pickle
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app.engine.protocol import GenerationRequest, StreamChunk

logger = logging.getLogger("ray.serve")

FRAME = struct.Struct("!I")
ENV = "SERVE_APP_DIRECT_DISPATCH"
REQUEST, CANCEL, CHUNK, END, ERROR = "request", "cancel", "chunk", "end", "error"


async def read_frame(reader: asyncio.StreamReader) -> tuple[str, str, Any]:
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    frame: tuple[str, str, Any] = pickle.loads(await reader.readexactly(size))
    return frame


def write_frame(writer: asyncio.StreamWriter, kind: str, key: str, payload: Any = None) -> None:
    data = pickle.dumps((kind, key, payload))
    writer.write(FRAME.pack(len(data)) + data)


def _forget(tasks: dict[str, asyncio.Task[None]], key: str, _: object) -> None:
    tasks.pop(key, None)


class DirectServer:
    """The replica's end: runs `generate` for every request a connection brings."""

    def __init__(
        self, generate: Callable[[GenerationRequest], AsyncIterator[StreamChunk]], path: str
    ) -> None:
        self._generate = generate
        self.path = path
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                kind, key, payload = await read_frame(reader)
                if kind == REQUEST:
                    task = asyncio.get_running_loop().create_task(self._run(payload, writer))
                    tasks[key] = task
                    task.add_done_callback(functools.partial(_forget, tasks, key))
                elif kind == CANCEL and key in tasks:
                    tasks[key].cancel()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the ingress went away: its requests are aborted below
        finally:
            for task in list(tasks.values()):
                task.cancel()
            writer.close()

    async def _run(self, request: GenerationRequest, writer: asyncio.StreamWriter) -> None:
        key = request.request_id
        try:
            async for chunk in self._generate(request):
                write_frame(writer, CHUNK, key, chunk)
                await writer.drain()
            write_frame(writer, END, key)
        except asyncio.CancelledError:
            raise  # cancelled by the ingress, or its connection closed: generate() aborted it
        except Exception as e:
            try:
                write_frame(writer, ERROR, key, e)
            except Exception:  # not picklable: its kind is lost, its message kept
                write_frame(writer, ERROR, key, RuntimeError(repr(e)[:1000]))
