"""Direct dispatch: requests over a kept Unix socket, ingress -> pool replica (on by default;
SERVE_APP_DIRECT_DISPATCH=0 in the replicas' and ingresses' environment turns it off).

The replica listens on a socket of its own; an ingress on its node keeps one connection to it
and writes each request there instead of making a Serve call. The replica runs the same
`generate()` and sends back on that connection the chunks it serves itself (not on the stream
channel: a Serve call's message costs more than a frame here), its error, its end; a cancel
frame aborts it. Streams an engine frontend serves come on that frontend's channel, as they do
for a Serve call; an ingress on the frontend's node takes that channel over a socket of the
frontend's (`ChannelServer`), not a Ray call. Frames: (kind, request id, payload), pickled,
length-prefixed; what one turn of the replica's event loop produced for a connection (the
streams one engine step woke) goes out in one write.

The same protocol carries a replica's requests to its engine frontends: each frontend listens
as a replica does (`DirectServer`), and the replica keeps one connection to each
(`DirectConnection`, the client end an ingress uses too).

Stopping (Serve's scale-down or redeploy) is a drain, as Serve's own is for its calls: the
replica stops listening and sends each connection a draining frame, after which that ingress
sends it no more requests (it goes by Serve, whose routers already left the replica out), and
the replica's stop waits for the requests it holds to end.

The socket is in Linux's abstract namespace: it has no file, so nothing is left behind however
the replica's process ends, and it vanishes with the process. Any local process could connect
to such a name, so the replica answers only processes of its own user (SO_PEERCRED), as a
socket file in a private directory would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pickle
import secrets
import socket
import struct
from collections.abc import AsyncGenerator, Callable
from typing import Any

from serve_app.engine.protocol import EngineDeadError, GenerationRequest, StreamChunk

logger = logging.getLogger("ray.serve")

FRAME = struct.Struct("!I")
ENV = "SERVE_APP_DIRECT_DISPATCH"
REQUEST, CANCEL, CHUNK, END, ERROR = "request", "cancel", "chunk", "end", "error"
DRAINING = "draining"  # replica -> ingress: send no more requests here


def enabled() -> bool:
    """Whether direct dispatch is on in this process (SERVE_APP_DIRECT_DISPATCH, default 1)."""
    return os.environ.get(ENV, "1") != "0"


async def receive(reader: asyncio.StreamReader) -> Any:
    """One length-prefixed pickle."""
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    return pickle.loads(await reader.readexactly(size))


def encode(value: Any) -> bytes:
    data = pickle.dumps(value)
    return FRAME.pack(len(data)) + data


def send(writer: asyncio.StreamWriter, value: Any) -> None:
    writer.write(encode(value))


async def read_frame(reader: asyncio.StreamReader) -> tuple[str, str, Any]:
    frame: tuple[str, str, Any] = await receive(reader)
    return frame


def write_frame(writer: asyncio.StreamWriter, kind: str, key: str, payload: Any = None) -> None:
    send(writer, (kind, key, payload))


class Outbox:
    """The frames for one connection, written together at the next turn of the loop."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._frames: list[bytes] = []

    def put(self, kind: str, key: str, payload: Any = None) -> None:
        frame = encode((kind, key, payload))  # raises here if the payload does not pickle
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._flush)
        self._frames.append(frame)

    def _flush(self) -> None:
        frames, self._frames = self._frames, []
        if not self._writer.is_closing():
            self._writer.write(b"".join(frames))


def _forget(tasks: dict[str, asyncio.Task[None]], key: str, _: object) -> None:
    tasks.pop(key, None)


async def connect(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a replica's socket (made here for uvloop's sake, as in `start`)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, path)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_unix_connection(sock=sock)


async def listen(path: str, serve: Any) -> asyncio.AbstractServer:
    """A server on abstract socket `path`, `serve` called for each connection."""
    # bound here, not by the event loop: uvloop (Serve's replicas run on it) takes the name as
    # a C string, and an abstract one starts with a NUL
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    return await asyncio.start_unix_server(serve, sock=sock)


def socket_path(kind: str) -> str:
    """A new abstract socket name for this process."""
    return f"\0serve-app-{kind}-{os.getpid()}-{secrets.token_hex(8)}"


def _peer_uid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return None
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def own_user(writer: asyncio.StreamWriter) -> bool:
    """Whether the connection's peer runs as this process's user; if not, it is closed."""
    if _peer_uid(writer) == os.getuid():
        return True
    logger.warning("direct dispatch: refused a connection from another user")
    writer.close()
    return False


class DirectServer:
    """The serving end (a pool replica's, or an engine frontend's): runs `generate` for every
    request a connection brings."""

    def __init__(
        self,
        generate: Callable[[GenerationRequest], AsyncGenerator[StreamChunk, None]],
        kind: str = "direct",
    ) -> None:
        """`kind` names the socket (`serve-app-<kind>-...`): "direct" a pool replica's."""
        self._generate = generate
        self.path = socket_path(kind)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._running: set[asyncio.Task[None]] = set()  # requests in flight, every connection
        self.draining = False

    @property
    def in_flight(self) -> int:
        """Requests this replica holds that came over its socket (Serve does not count them)."""
        return len(self._running)

    async def start(self) -> None:
        self._server = await listen(self.path, self._serve)

    def drain(self) -> None:
        """Stop listening and tell every connection: its ingress sends no more requests here.
        Requests already sent (one may cross the frame) run on; `drained()` waits for them."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            with contextlib.suppress(Exception):
                write_frame(writer, DRAINING, "")

    async def drained(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the requests in flight to end; then close every
        connection (requests still running are aborted). True if none was cut short."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=timeout_s)
        cut = self.in_flight
        for writer in list(self._writers):
            writer.close()
        return cut == 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not own_user(writer):
            return
        self._writers.add(writer)
        if self.draining:  # connected as the replica began to stop
            write_frame(writer, DRAINING, "")
        tasks: dict[str, asyncio.Task[None]] = {}
        outbox = Outbox(writer)
        try:
            while True:
                kind, key, payload = await read_frame(reader)
                if kind == REQUEST:
                    task = asyncio.get_running_loop().create_task(
                        self._run(payload, outbox, writer)
                    )
                    tasks[key] = task
                    self._running.add(task)
                    task.add_done_callback(functools.partial(_forget, tasks, key))
                    task.add_done_callback(self._running.discard)
                elif kind == CANCEL and key in tasks:
                    tasks[key].cancel()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the ingress went away: its requests are aborted below
        finally:
            for task in list(tasks.values()):
                task.cancel()
            self._writers.discard(writer)
            writer.close()

    async def _run(
        self, request: GenerationRequest, outbox: Outbox, writer: asyncio.StreamWriter
    ) -> None:
        key = request.request_id
        try:
            # closed on any way out, so that the engine aborts the request at once
            async with contextlib.aclosing(self._generate(request)) as chunks:
                async for chunk in chunks:
                    outbox.put(CHUNK, key, chunk)
                    await writer.drain()  # waits while the ingress reads slower than this
            outbox.put(END, key)
        except asyncio.CancelledError:
            raise  # cancelled by the ingress, or its connection closed: generate() aborted it
        except Exception as e:
            try:
                outbox.put(ERROR, key, e)
            except Exception:  # not picklable: its kind is lost, its message kept
                outbox.put(ERROR, key, RuntimeError(repr(e)[:1000]))


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


class ChannelServer:
    """An engine frontend's stream channels (engine/channel.py) over a socket of its own: an
    ingress on its node connects, sends its id, and reads the channel's messages (the hello,
    then batches) as frames; closing the connection closes the channel, as cancelling the Ray
    call does. Saves the ingress Ray's handling of a streaming call's every item."""

    def __init__(self, serve: Callable[[str], AsyncGenerator[Any, None]]) -> None:
        self._serve_channel = serve
        self.path = socket_path("channel")
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await listen(self.path, self._serve)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not own_user(writer):
            return
        try:
            ingress_id = await receive(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        pump = asyncio.ensure_future(self._pump(ingress_id, writer))
        gone = asyncio.ensure_future(reader.read())  # b"": the ingress closed it
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pump.cancel()
            gone.cancel()
            writer.close()
        for task in (pump, gone):
            error = task.exception() if task.done() and not task.cancelled() else None
            if error is not None and not isinstance(error, ConnectionError):
                logger.warning("stream channel to ingress %s failed: %r", ingress_id, error)

    async def _pump(self, ingress_id: str, writer: asyncio.StreamWriter) -> None:
        # closed at once however this ends: the channel is no longer open to this ingress
        async with contextlib.aclosing(self._serve_channel(ingress_id)) as messages:
            async for message in messages:
                send(writer, message)
                await writer.drain()


async def channel_messages(
    path: str, ingress_id: str
) -> tuple[AsyncGenerator[Any, None], Callable[[], None]]:
    """An ingress's end of a ChannelServer's channel: its messages, and how to close it."""
    reader, writer = await connect(path)
    send(writer, ingress_id)

    async def messages() -> AsyncGenerator[Any, None]:
        try:
            while True:
                yield await receive(reader)
        except asyncio.IncompleteReadError:
            return  # the channel ended (idle, or the frontend stopped)
        finally:
            writer.close()

    return messages(), writer.close
