"""The engine's stages from vLLM's per-request timestamps (RequestOutput.metrics), and how a
request the engine failed is told from one that failed on its own."""

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.v1.engine.exceptions import EngineGenerateError

from serve_app.engine import vllm_engine
from serve_app.engine.protocol import ApiCall, ApiKind, EngineDeadError, StreamChunk
from serve_app.engine.vllm_engine import OpenAILayer, _WatchedClient, engine_stages
from serve_app.timing import Stage


def test_stages_come_from_vllm_timestamps_bracketed_by_the_replica() -> None:
    metrics = SimpleNamespace(queued_ts=10.002, scheduled_ts=10.010, first_token_ts=10.030)
    stages = engine_stages(SimpleNamespace(metrics=metrics), started=10.0, now=10.031)
    assert stages == {
        Stage.ENGINE_IN: pytest.approx(2.0),
        Stage.QUEUE: pytest.approx(8.0),
        Stage.PREFILL: pytest.approx(20.0),
        Stage.ENGINE_OUT: pytest.approx(1.0),
    }


@pytest.mark.parametrize(
    "metrics",
    [
        None,  # stats not logged
        SimpleNamespace(queued_ts=1.0, scheduled_ts=0.0, first_token_ts=0.0),  # not scheduled
        SimpleNamespace(),  # a vLLM without these fields
    ],
)
def test_no_stages_without_timestamps(metrics: object) -> None:
    assert engine_stages(SimpleNamespace(metrics=metrics), 0.0, 1.0) is None


class _DyingLLM:
    """An AsyncLLM whose engine fails each request before its first output, and is seen dead
    `dead_after_s` later (by vLLM's thread watching the engine core), or never (None)."""

    def __init__(self, dead_after_s: float | None) -> None:
        self.errored = False
        self._dead_after_s = dead_after_s

    def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        async def stream() -> AsyncIterator[Any]:
            if self._dead_after_s is not None:
                loop = asyncio.get_running_loop()
                loop.call_later(self._dead_after_s, setattr, self, "errored", True)
            raise EngineGenerateError()
            yield  # an async generator

        return stream()


class _Completions:
    """vLLM's completion serving class, as far as OpenAILayer uses it: it asks the engine for
    the request's outputs when called, and streams an engine failure as an error event."""

    def __init__(self, client: Any) -> None:
        self._client = client

    async def create_completion(self, request: Any, raw: Any) -> AsyncIterator[str]:
        outputs = self._client.generate(None, SamplingParams(), request.request_id)

        async def events() -> AsyncIterator[str]:
            try:
                async for _ in outputs:
                    yield 'data: {"choices": []}\n\n'
            except Exception:
                yield 'data: {"error": {"message": "engine failed", "code": 500}}\n\n'
            yield "data: [DONE]\n\n"

        return events()


async def _streamed_completion(llm: Any) -> list[StreamChunk]:
    """A streamed completion's chunks, through OpenAILayer and vLLM's completion class (as far
    as it goes, _Completions) over the AsyncLLM `llm`."""
    state = SimpleNamespace(
        openai_serving_chat=SimpleNamespace(),
        openai_serving_completion=_Completions(_WatchedClient(llm)),
    )
    layer = OpenAILayer(state, llm)
    call = ApiCall(ApiKind.COMPLETION, SimpleNamespace(stream=True, request_id="r1"), [])
    return [chunk async for chunk in layer.serve(call, timed=False)]


@pytest.mark.parametrize("dead_after_s", [0.0, 0.05, None])
def test_a_stream_the_engine_failed_before_output_is_routed_again_once_it_is_dead(
    dead_after_s: float | None,
) -> None:
    """vLLM fails the requests of a dead engine from its output handler, which may run before
    the thread watching the engine core marks the engine dead: the replica waits that long
    before taking the failure for the request's own (an error event, as vLLM's server sends)."""
    llm = _DyingLLM(dead_after_s)
    if dead_after_s is None:
        events = asyncio.run(_streamed_completion(llm))
        assert "engine failed" in (events[0].data or "")
    else:
        with pytest.raises(EngineDeadError):
            asyncio.run(_streamed_completion(llm))


class _CachedLLM:
    """An AsyncLLM that finds `cached` of the prompt's tokens in its prefix cache and then
    makes three tokens, one output each, cumulative as the completion layer asks (vLLM reports
    the hits on every output)."""

    errored = False

    def __init__(self, cached: int) -> None:
        self._cached = cached

    def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        async def stream() -> AsyncIterator[Any]:
            for i in range(3):
                yield SimpleNamespace(
                    request_id=request_id,
                    prompt_token_ids=[1] * 3000,
                    num_cached_tokens=self._cached,
                    outputs=[
                        SimpleNamespace(index=0, token_ids=[7] * (i + 1), finish_reason="length")
                    ],
                    finished=i == 2,
                    metrics=None,
                )

        return stream()


def test_the_first_token_s_chunk_says_how_much_of_the_prompt_the_prefix_cache_held() -> None:
    """The replica's prefill rate counts only the prompt tokens the engine computed."""
    llm = _CachedLLM(cached=2496)
    with_tokens = [c for c in asyncio.run(_streamed_completion(llm)) if c.num_tokens]
    assert with_tokens[0].cached_tokens == 2496
    assert all(c.cached_tokens == 0 for c in with_tokens[1:])
    assert sum(c.num_tokens for c in with_tokens) == 3


class _SwallowingCompletions:
    """vLLM's completion serving class on a non-streamed request: a cancellation while it
    waits for the engine becomes a 400 "Client disconnected" answer, not a cancellation."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()

    async def create_completion(self, request: Any, raw: Any) -> Any:
        watch = vllm_engine._WATCH.get()
        assert watch is not None
        watch.first.set()  # its first token is out: the layer now waits for the whole answer
        self.waiting.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return ErrorResponse(
                error=ErrorInfo(message="Client disconnected", type="BadRequestError", code=400)
            )
        raise AssertionError("not cancelled")


def test_a_request_cancelled_while_vllm_serves_it_ends_cancelled_not_with_vllm_s_400() -> None:
    """The replica cancels its requests when its engine dies (and Serve cancels one whose caller
    left): the request must end cancelled, so the replica fails it as an engine failure (503 or
    routed again), not with the 400 vLLM's layer makes of the cancellation."""
    completions = _SwallowingCompletions()
    state = SimpleNamespace(
        openai_serving_chat=SimpleNamespace(), openai_serving_completion=completions
    )
    layer = OpenAILayer(state, _DyingLLM(None))  # type: ignore[arg-type]
    call = ApiCall(ApiKind.COMPLETION, SimpleNamespace(stream=False, request_id="r1"), [])

    async def main() -> list[StreamChunk]:
        async def serve() -> list[StreamChunk]:
            return [chunk async for chunk in layer.serve(call, timed=False)]

        task = asyncio.create_task(serve())
        await completions.waiting.wait()
        await asyncio.sleep(0.01)  # the layer has told of the first token and awaits the answer
        task.cancel()
        return await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_vllm_s_prometheus_logger_is_dropped_and_the_replica_s_kept() -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    prometheus = object.__new__(PrometheusStatLogger)  # (its metrics: never built here)
    ours = object()
    llm: Any = SimpleNamespace(logger_manager=SimpleNamespace(stat_loggers=[ours, prometheus]))
    vllm_engine.drop_prometheus_logger(llm)
    assert llm.logger_manager.stat_loggers == [ours]
    vllm_engine.drop_prometheus_logger(SimpleNamespace(logger_manager=None))  # type: ignore[arg-type]


def test_the_engine_core_processes_are_read_from_vllm_s_manager() -> None:
    """The processes a replica pins on a GPU host: those vLLM's manager started, the ended ones
    left out, nothing without a manager."""
    import subprocess
    import sys

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        manager = SimpleNamespace(processes=[running, ended, SimpleNamespace(pid=None)])
        found = vllm_engine.engine_core_processes(manager)
        assert [p.pid for p in found] == [running.pid]
        assert vllm_engine.engine_core_processes(None) == []
        llm: Any = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(
            engine_manager=manager)))  # fmt: skip
        assert vllm_engine._manager_of(llm) is manager
    finally:
        running.kill()
        running.wait()


def test_pinning_moves_the_engine_core_or_gives_the_core_back(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With engine core processes listed, they are pinned to the claimed core and the claim is
    kept; with none, the core goes back to the reservation (another replica can claim it) and a
    warning says so."""
    import os
    import subprocess
    import sys

    from serve_app.engine import cpu_layout

    cpu = sorted(os.sched_getaffinity(0))[-1]
    held = cpu_layout.claim(1, [cpu], tmp_path)
    assert held is not None
    with caplog.at_level("WARNING"):
        assert vllm_engine.pin_engine_core(None, held) is None
    assert "no engine core process found" in caplog.text
    again = cpu_layout.claim(1, [cpu], tmp_path)  # free again
    assert again is not None
    again.release()

    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held = cpu_layout.claim(1, [cpu], tmp_path)
        assert held is not None
        kept = vllm_engine.pin_engine_core(SimpleNamespace(processes=[core]), held)
        assert kept is held
        assert os.sched_getaffinity(core.pid) == {cpu}
        assert cpu_layout.claim(1, [cpu], tmp_path) is None  # still held
        held.release()
    finally:
        core.kill()
        core.wait()
