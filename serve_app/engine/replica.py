"""The engine replica: a Serve deployment that owns one engine (one GPU, or a few CPU cores).

It streams generation, reports its scheduler state to the pool state board a few times a second,
and fails Serve's health check when its engine is dead so Serve replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.autoscaling import ARRIVALS_METRIC, DIRECT_METRIC, REFUSED_METRIC, WAITING_METRIC
from serve_app.config import GRACEFUL_SHUTDOWN_TIMEOUT_S
from serve_app.constants import ENGINE_START_TIMEOUT_S, STATS_PERIOD_S
from serve_app.engine import direct
from serve_app.engine.channel import Batch, ChannelHello, Channels, relay
from serve_app.engine.coalesce import MessageBudget
from serve_app.engine.frontend import Frontends
from serve_app.engine.metrics import ReplicaMetrics
from serve_app.engine.prefill import PrefillMeter, RecentRate
from serve_app.engine.protocol import (
    BoardReply,
    Engine,
    EngineDeadError,
    EngineStats,
    GenerationRequest,
    Placement,
    ReplicaReport,
    StreamChunk,
)
from serve_app.profiles import ResolvedProfile

logger = logging.getLogger("ray.serve")

EngineFactory = Callable[[ResolvedProfile], Engine]
_RECENT = 64  # latencies kept per replica for the pool snapshot
# Of a stop's graceful_shutdown_timeout_s, what Serve's own drain (its wait loop of 2 s, at
# least once) and the engine's shutdown keep: the rest is the direct requests' to finish in.
_STOP_MARGIN_S = 5.0


def vllm_engine(profile: ResolvedProfile) -> Engine:
    from serve_app.engine.vllm_engine import VLLMEngine  # vLLM imports only where engines run

    return VLLMEngine(profile)


def _placement() -> Placement:
    import ray

    if not ray.is_initialized():  # outside Ray (unit tests)
        return Placement()
    ctx = ray.get_runtime_context()
    return Placement(
        node_id=ctx.get_node_id(),
        node_ip=ray.util.get_node_ip_address(),
        gpu_ids=tuple(str(i) for i in ctx.get_accelerator_ids().get("GPU", [])),
    )


async def _aclose(chunks: AsyncIterator[StreamChunk]) -> None:
    close = getattr(chunks, "aclose", None)
    if close is not None:
        await close()


class EngineReplica:
    """One engine replica of a pool. Serve deployment options are set by `app.build_app`."""

    async def __init__(  # type: ignore[misc]
        self,
        profile: ResolvedProfile,
        board: DeploymentHandle[Any] | None = None,
        engine_factory: EngineFactory = vllm_engine,
        graceful_shutdown_timeout_s: float = GRACEFUL_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        self._profile = profile
        self._graceful_shutdown_timeout_s = graceful_shutdown_timeout_s
        self._board = board
        self._engine = engine_factory(profile)
        self._ttft_ms: deque[float] = deque(maxlen=_RECENT)
        self._streams = 0  # generate() calls in flight
        ceiling = profile.pool.stream_messages_per_s
        self._budget = MessageBudget(ceiling) if ceiling is not None else None
        self._tpot_ms: deque[float] = deque(maxlen=_RECENT)
        self._prefill = PrefillMeter()
        self._arrivals = RecentRate()
        self._refused_per_s = 0.0  # the pool's refused demand, this replica's share (board)
        try:
            self._replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit tests)
            self._replica_id = f"local-{profile.name}-{id(self)}"
        self._placement = _placement()
        self._channels = Channels(self._replica_id)
        # generate() calls in flight, and why the engine is dead once it is: they all fail then
        self._inflight: set[asyncio.Task[Any]] = set()
        self._dead: str | None = None
        self._frontends: Frontends | None = None
        started = time.monotonic()
        await asyncio.wait_for(self._engine.start(), ENGINE_START_TIMEOUT_S)
        slots = getattr(self._engine, "slots", [])
        if slots:
            self._frontends = await asyncio.wait_for(
                Frontends.start(profile, slots, self._replica_id, self._placement.node_id),
                ENGINE_START_TIMEOUT_S,
            )
            self._channels.frontends = self._frontends.handles
            self._channels.sockets = self._frontends.channel_sockets
            self._channels.node_id = self._placement.node_id
        logger.info(
            "pool %s: engine ready in %.1f s (model %s, %d processes serving it)",
            profile.name,
            time.monotonic() - started,
            profile.model,
            len(slots) + 1,
        )
        self._direct: direct.DirectServer | None = None
        if direct.enabled():
            self._direct = direct.DirectServer(functools.partial(self.generate, on_channel=False))
            await self._direct.start()
            self._placement = replace(self._placement, dispatch_path=self._direct.path)
        self._metrics = ReplicaMetrics(profile.name)
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    async def generate(
        self, request: GenerationRequest, *, on_channel: bool = True
    ) -> AsyncGenerator[StreamChunk, None]:
        """Stream the request's output; cancellation (caller gone) aborts it in the engine.

        When the request's ingress has a channel to this replica (engine/channel.py), the chunks
        go on the channel, together with the other streams', and this call yields nothing: it
        ends when the request does (or raises, as without a channel). With engine frontends
        (engine/frontend.py) the process serving the fewest streams serves it: a frontend sends
        the chunks on its own channel, and tells this replica of the first token and the end.
        `on_channel=False` (a request that came over direct dispatch's socket): the chunks this
        replica serves itself are yielded, to go back on that socket.
        """
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        received = time.time()
        started = time.perf_counter()
        first_at: float | None = None
        last: StreamChunk | None = None
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        self._streams += 1
        prompt_tokens = request.prompt_tokens
        self._arrivals.add()
        queued_at = self._prefill.queued(prompt_tokens)
        # held while the stream runs, even one whose chunks go back on the direct socket: a
        # channel idle for IDLE_S ends, and the ingress would open it again (a Serve call) at
        # its next dispatch
        channel = self._channels.acquire(request.channel)
        served_by = self._frontends.pick(self._streams - 1) if self._frontends is not None else 0
        if served_by:
            assert self._frontends is not None
            chunks = self._frontends.forward(served_by, request)
            budget = None  # the frontend coalesces
        else:
            chunks = self._engine.generate(request)
            budget = self._budget
        carrier = channel if on_channel else None
        relayed = relay(chunks, request, carrier, received, budget, lambda: self._streams)
        try:
            async for chunk, carried in relayed:
                if first_at is None and chunk.num_tokens:
                    first_at = time.perf_counter()
                    self._prefill.prefilled(prompt_tokens, queued_at, chunk.cached_tokens)
                    self._ttft_ms.append((first_at - started) * 1e3)
                last = chunk
                if not carried:
                    yield chunk
        except EngineDeadError as e:
            self._engine_died(str(e))
            raise
        except asyncio.CancelledError:
            if task is None or self._dead is None or not task.cancelling():
                raise
            # cancelled by _engine_died (or its caller left as the engine died): fail as dead
            task.uncancel()
            raise EngineDeadError(self._dead) from None
        finally:
            # Closed here, not left to the garbage collector: a cancel that lands in relay's
            # coalescing sleep leaves the engine's stream suspended, still generating, until a
            # collection finds it (the traceback holding it sits in a reference cycle).
            await relayed.aclose()
            await _aclose(chunks)
            self._inflight.discard(task)  # type: ignore[arg-type]
            self._streams -= 1
            if channel is not None:
                channel.streams -= 1
            if first_at is None:
                self._prefill.dropped(prompt_tokens)
        if first_at is not None and last is not None and last.completion_tokens > 1:
            decode_s = time.perf_counter() - first_at
            self._tpot_ms.append(decode_s * 1e3 / (last.completion_tokens - 1))

    async def channel(self, ingress_id: str) -> AsyncIterator[ChannelHello | Batch]:
        """A stream channel to ingress `ingress_id`: a hello, then batches of chunks."""
        async for message in self._channels.serve(ingress_id):
            yield message

    async def stats(self) -> EngineStats:
        return self._engine_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for custom autoscaling metrics (serve_app.autoscaling reads them)."""
        stats = self._engine_stats()
        return {
            WAITING_METRIC: stats.waiting,
            "engine_running": stats.running,
            ARRIVALS_METRIC: self._arrivals.per_s(),
            REFUSED_METRIC: self._refused_per_s,
            # requests in flight that came by direct dispatch: Serve counts only its own calls
            DIRECT_METRIC: self._direct.in_flight if self._direct is not None else 0,
        }

    async def check_health(self) -> None:
        if self._dead is not None:  # the engine, or one of its frontends
            raise EngineDeadError(self._dead)
        try:
            await self._engine.check_health()
        except EngineDeadError as e:
            self._engine_died(str(e))
            raise

    def _engine_died(self, why: str) -> None:
        """The engine is dead: every request still here fails now, as the first to see it did.
        vLLM fails the requests it holds, but not one that reached it as it died (added after
        its output loop had failed the others), nor one still on its way in: without this they
        would wait until Serve stops the replica, several health checks later."""
        if self._dead is not None:
            return
        self._dead = why or "the engine died"
        current = asyncio.current_task()
        stuck = [t for t in self._inflight if t is not current and not t.done()]
        logger.error(
            "pool %s: engine dead (%s); failing %d requests",
            self._profile.name,
            self._dead,
            len(stuck),
        )
        for t in stuck:
            t.cancel()
        if self._frontends is not None:  # their streams fail with the calls forwarding them
            self._frontends.stop()

    def report(self) -> ReplicaReport:
        return ReplicaReport(
            pool=self._profile.name,
            replica_id=self._replica_id,
            stats=self._engine_stats(),
            max_model_len=self._profile.max_model_len,
            reported_at=time.time(),
            ttft_ms_recent=tuple(self._ttft_ms),
            tpot_ms_recent=tuple(self._tpot_ms),
            placement=self._placement,
            queued_tokens=self._prefill.queued_tokens,
            prefill_tok_s=self._prefill.rate(),
        )

    def _engine_stats(self) -> EngineStats:
        stats = self._engine.stats()
        return stats if self._frontends is None else self._frontends.stats(stats)

    async def _report_forever(self) -> None:
        while True:
            if self._frontends is not None:
                await self._frontends.poll_stats(STATS_PERIOD_S)
                if self._frontends.dead is not None:
                    self._engine_died(self._frontends.dead)
            report = self.report()
            if not report.stats.healthy:
                self._engine_died("the engine is not running")
            self._metrics.update(report.stats)
            if self._board is not None:
                try:
                    reply: BoardReply = await self._board.report.remote(report)
                    self._refused_per_s = reply.refused_per_s
                    if self._budget is not None:
                        self._budget.update(reply.consumer_lag_ms)
                except Exception:  # the board restarts with the app; keep serving meanwhile
                    logger.warning("pool %s: report failed", self._profile.name, exc_info=True)
            await asyncio.sleep(STATS_PERIOD_S)

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Serve's documented shutdown hook: it calls __del__ when the replica stops, after
        draining its own calls, and awaits what it returns. Requests that came by direct
        dispatch are not Serve's to drain: they get the rest of the stop's time to end (the
        ingresses send no more once told), then the engine stops."""
        with contextlib.suppress(Exception):
            self._reporter.cancel()
        with contextlib.suppress(Exception):
            if self._direct is not None:
                self._direct.drain()
                if self._direct.in_flight:
                    asyncio.get_running_loop()  # (raises outside one: garbage collection)
                    return self._stop_after_direct()
        self._stop()
        return None

    async def _stop_after_direct(self) -> None:
        assert self._direct is not None
        timeout_s = max(0.0, self._graceful_shutdown_timeout_s - _STOP_MARGIN_S)
        logger.info(
            "pool %s: stopping; %d direct requests in flight (waiting up to %.0f s)",
            self._profile.name,
            self._direct.in_flight,
            timeout_s,
        )
        try:
            if not await self._direct.drained(timeout_s):
                logger.warning("pool %s: direct requests cut short by the stop", self._profile.name)
        finally:
            self._stop()

    def _stop(self) -> None:
        with contextlib.suppress(Exception):
            if self._frontends is not None:
                self._frontends.stop()
        with contextlib.suppress(Exception):
            self._engine.shutdown()
