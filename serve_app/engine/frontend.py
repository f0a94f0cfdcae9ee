"""Engine frontends: more processes serving one engine's streams, as `vllm serve
--api-server-count` has.

Every stream costs Python work in the process that serves it, at every engine step: vLLM's
output processing (detokenization), its OpenAI layer (one SSE event per output) and the stream
channel. With one process per engine that process's event loop is the limit at high concurrency
on a GPU (docs/results/streaming.md: the pool replica at 0.91 of a core at concurrency 256 on
one H100, its streams coalesced to 53 ms between events). With `pool.frontends` = F > 1 the
replica starts the engine core for F clients (vllm_engine.launch_engine_core), is itself the
first, and starts F - 1 `EngineFrontend` actors on its node, each one more AsyncLLM client with
vLLM's OpenAI layer and stream channels of its own.

Requests still reach the replica (by direct dispatch or Serve: routing, queueing, autoscaling
and cancellation stay as they are); it serves a request itself or hands it to the frontend with
the fewest streams, over that frontend's socket with direct dispatch on (engine/direct.py's
protocol: a frame each way, not a Ray actor call). A frontend sends the stream's chunks on its
channel to the request's ingress (the channel hello of the replica names the frontends; the
ingress opens a channel to each: over the frontend's socket when it is on the ingress's node
and direct dispatch is on, engine/direct.ChannelServer, else by a Ray call) and tells the
replica only of the first token and the end (receipts), so the replica's per-stream work is
two messages, whatever the stream's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serve_app.engine import direct
from serve_app.engine.channel import Batch, ChannelHello, Channels, receipt, relay
from serve_app.engine.coalesce import MessageBudget
from serve_app.engine.protocol import (
    Engine,
    EngineDeadError,
    EngineRequestError,
    EngineStats,
    GenerationRequest,
    StreamChunk,
)
from serve_app.profiles import ResolvedProfile

if TYPE_CHECKING:
    from serve_app.engine.vllm_engine import ClientSlot

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True, slots=True)
class FrontendSockets:
    """Where a frontend listens ("": not on a socket; its Ray calls only)."""

    channel: str = ""  # ingresses on its node take their stream channels here
    dispatch: str = ""  # its replica sends it requests here (engine/direct.py's protocol)


class EngineFrontend:
    """One more client of a replica's engine, in a Ray actor of its own (started by Frontends)."""

    def __init__(
        self,
        profile: ResolvedProfile,
        name: str,
        slot: ClientSlot | None = None,
        engine: Engine | None = None,
    ) -> None:
        """`name`: `<replica id>/<index>`; the engine is a client at `slot` (or given, in tests)."""
        if engine is None:
            from serve_app.engine.vllm_engine import VLLMEngine  # vLLM imports only here

            engine = VLLMEngine(profile, slot)
        self._engine = engine
        self._channels = Channels(name)
        ceiling = profile.pool.stream_messages_per_s
        self._budget = MessageBudget(ceiling) if ceiling is not None else None
        self._streams = 0
        self._channel_server: direct.ChannelServer | None = None
        self._dispatch_server: direct.DirectServer | None = None

    async def start(self) -> FrontendSockets:
        """Start the engine client and, with direct dispatch on, the frontend's sockets."""
        await self._engine.start()
        if not direct.enabled():
            return FrontendSockets()
        self._channel_server = direct.ChannelServer(self.channel)
        self._dispatch_server = direct.DirectServer(self.generate, kind="frontend")
        await self._channel_server.start()
        await self._dispatch_server.start()
        return FrontendSockets(self._channel_server.path, self._dispatch_server.path)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StreamChunk, None]:
        """The request's chunks: on this frontend's channel to its ingress when there is one
        (yielding receipts of the first token and the end), else yielded."""
        received = time.time()
        self._streams += 1
        channel = self._channels.acquire(request.channel)
        first = True
        try:
            chunks = self._engine.generate(request)
            async for chunk, carried in relay(
                chunks, request, channel, received, self._budget, lambda: self._streams
            ):
                if not carried:
                    yield chunk
                elif (first and chunk.num_tokens) or chunk.finish_reason is not None:
                    yield receipt(chunk)
                if chunk.num_tokens:
                    first = False
        finally:
            self._streams -= 1
            if channel is not None:
                channel.streams -= 1

    async def channel(self, ingress_id: str) -> AsyncGenerator[ChannelHello | Batch, None]:
        async for message in self._channels.serve(ingress_id):
            yield message

    def stats(self) -> EngineStats:
        """The engine's scheduler state as of the last step whose stats reached this client."""
        return self._engine.stats()

    def shutdown(self) -> None:
        if self._channel_server is not None:
            self._channel_server.stop()
        if self._dispatch_server is not None:
            self._dispatch_server.drain()
        self._engine.shutdown()


class Frontends:
    """A replica's engine frontends: started beside it, chosen per request, stopped with it."""

    def __init__(self, handles: list[Any], sockets: Sequence[FrontendSockets] = ()) -> None:
        self.handles = tuple(handles)
        self.sockets = tuple(sockets)  # each one's (none: all by Ray calls)
        # the replica's connection to each one's dispatch socket (None: by Ray calls)
        self._connections: list[direct.DirectConnection | None] = [None] * len(self.handles)
        self._streams = [0] * len(handles)  # forwarded to each, in flight
        self._stats = EngineStats()  # the freshest a frontend saw
        self.dead: str | None = None  # why, once a frontend's process is gone

    @classmethod
    async def start(
        cls, profile: ResolvedProfile, slots: list[ClientSlot], replica_id: str, node_id: str
    ) -> Frontends:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 100_000}
        if node_id:  # the engine core's sockets are IPC paths on this node
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        if gpus:  # vLLM's client finds its platform as the replica does
            env = {"CUDA_VISIBLE_DEVICES": gpus, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
            options["runtime_env"] = {"env_vars": env}
        actor: Any = ray.remote(EngineFrontend)
        handles = [
            actor.options(**options).remote(profile, f"{replica_id}/{s.index}", s) for s in slots
        ]
        frontends = cls(handles)
        try:
            sockets = await asyncio.gather(*(h.start.remote() for h in handles))
        except BaseException:
            frontends.stop()
            raise
        frontends.sockets = tuple(sockets)
        await frontends.connect()
        return frontends

    async def connect(self) -> None:
        """Connect to each frontend's dispatch socket (they run on this node); one that fails
        gets its requests by Ray calls."""
        for i, sockets in enumerate(self.sockets):
            if not sockets.dispatch:
                continue
            try:
                reader, writer = await direct.connect(sockets.dispatch)
            except OSError as e:
                logger.warning("engine frontend %d: its socket failed, Ray calls: %r", i + 1, e)
                continue
            self._connections[i] = direct.DirectConnection(sockets.dispatch, reader, writer)

    @property
    def channel_sockets(self) -> tuple[str, ...]:
        """Each frontend's channel socket, as the channel hello names them."""
        return tuple(s.channel for s in self.sockets)

    def pick(self, others: int) -> int:
        """Where the next stream goes: the process serving the fewest (0: the replica; ties go
        to it). `others`: the replica's streams in flight besides this one, forwarded included."""
        streams = [others - sum(self._streams), *self._streams]
        return streams.index(min(streams))

    async def forward(self, index: int, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """The request served by frontend `index` (1-based): its chunks or receipts, over its
        socket (a frame each way, as an ingress's direct dispatch) or else by a Ray call."""
        connection = self._connections[index - 1]
        if connection is not None and not connection.closed:
            call = connection.call(request)
            self._streams[index - 1] += 1
            try:
                async for chunk in call:
                    yield chunk
            except EngineDeadError as e:  # its engine's, or its process gone (the socket)
                raise EngineDeadError(f"engine frontend {index} died: {e}"[:300]) from None
            finally:
                self._streams[index - 1] -= 1
                call.cancel()  # (a call that ended: nothing to do)
            return
        async for chunk in self._forward_by_ray(index, request):
            yield chunk

    async def _forward_by_ray(
        self, index: int, request: GenerationRequest
    ) -> AsyncIterator[StreamChunk]:
        import ray

        self._streams[index - 1] += 1
        stream = self.handles[index - 1].generate.options(num_returns="streaming").remote(request)
        ended = False
        try:
            async for ref in stream:
                yield await ref
            ended = True
        except ray.exceptions.RayActorError as e:  # the frontend's process is gone
            raise EngineDeadError(f"engine frontend {index} died: {e}"[:300]) from None
        except ray.exceptions.RayTaskError as e:
            # Ray's error is also of its cause's class, made on the fly; the caller gets the
            # cause itself (it travels on to the ingress as the replica's own would)
            cause = e.cause
            if isinstance(cause, EngineDeadError | EngineRequestError):
                raise type(cause)(str(cause)) from None
            raise
        finally:
            self._streams[index - 1] -= 1
            if not ended and ray.is_initialized():  # cancelled (the client left, or the
                with contextlib.suppress(Exception):  # engine died): abort it there
                    ray.cancel(stream)

    async def poll_stats(self, timeout_s: float) -> None:
        """Ask the frontends for the engine's scheduler state (vLLM sends each step's stats to
        one of its clients only); note a frontend whose process is gone."""
        from ray.exceptions import RayActorError

        calls = [asyncio.ensure_future(h.stats.remote()) for h in self.handles]
        done, pending = await asyncio.wait(calls, timeout=timeout_s)
        for call in pending:
            call.cancel()
        for index, call in enumerate(calls, start=1):
            if call not in done:
                continue
            error = call.exception()
            if error is None:
                self._stats = freshest(self._stats, call.result())
            elif isinstance(error, RayActorError) and self.dead is None:
                self.dead = f"engine frontend {index} died: {error}"[:300]

    def stats(self, own: EngineStats) -> EngineStats:
        """The freshest of the replica's own view and what the frontends last saw."""
        return own if not own.healthy else freshest(own, self._stats)

    def stop(self) -> None:
        import ray

        for connection in self._connections:
            if connection is not None:
                connection.close()
        if not ray.is_initialized():  # (unit tests: handles in this process)
            return
        for handle in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(handle)


def freshest(a: EngineStats, b: EngineStats) -> EngineStats:
    return b if b.recorded_at > a.recorded_at else a
