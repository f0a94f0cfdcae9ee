"""What a benchmark runs against: the bare engine in-process, or any OpenAI-compatible URL.

    engine:<profile>   vLLM AsyncLLM built from a profile, in this process (the baseline)
    app:<url>          this app over HTTP (sends the SLO class header)
    url:<url>          any OpenAI-compatible server (a peer, e.g. `vllm serve`)

Each request is timed at the client: time to first token, gaps between chunks, end to end.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from serve_app.bench.workload import RequestSpec
from serve_app.profiles import (
    ResolvedProfile,
    detect_platform,
    engine_env,
    find_profile,
    load_profile,
    profiles_dir,
)
from serve_app.routing.config import SLOClass
from serve_app.timing import SERVER_TIMING_HEADER, parse_server_timing, parse_stream_timing


@dataclass
class Sample:
    index: int
    slo_class: str
    ok: bool
    error: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None  # to the end of the answer, a refusal's too
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunk_gaps_ms: list[float] = field(default_factory=list)
    status: int | None = None  # HTTP status (HTTP targets)
    pool: str | None = None  # x-serve-pool: the pool that served it (the app)
    predicted_ttft_ms: float | None = None  # x-route-predicted-ttft-ms (the app)
    predicted_tpot_ms: float | None = None  # x-route-predicted-tpot-ms (the app)
    route_reason: str | None = None  # x-route-reason (the app)
    stages: dict[str, float] | None = None  # the app's TTFT stages, ms (serve_app/timing.py)

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


def _new_sample(spec: RequestSpec) -> Sample:
    return Sample(spec.index, spec.slo_class, ok=False, prompt_tokens=len(spec.prompt_token_ids))


class Target(Protocol):
    name: str

    async def start(self) -> None: ...

    async def run_one(self, spec: RequestSpec) -> Sample: ...

    async def stop(self) -> None: ...


class EngineTarget:
    """The bare engine: vLLM AsyncLLM from a profile, driven in-process."""

    def __init__(self, profile: str | ResolvedProfile, name: str | None = None) -> None:
        label = profile if isinstance(profile, str) else profile.name
        self.name = name or f"engine:{label}"
        self._profile = profile
        self._engine: object | None = None

    async def start(self) -> None:
        from serve_app.engine.vllm_engine import VLLMEngine

        profile = self._profile
        if isinstance(profile, str):
            profile = load_profile(find_profile(profile, profiles_dir())).resolve(detect_platform())
        os.environ.update(engine_env(profile))  # the same threads as the app's replicas
        engine = VLLMEngine(profile)
        await engine.start()
        self._engine = engine

    async def run_one(self, spec: RequestSpec) -> Sample:
        from serve_app.engine.protocol import GenerationRequest
        from serve_app.engine.vllm_engine import VLLMEngine

        assert isinstance(self._engine, VLLMEngine)
        request = GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=spec.prompt_token_ids,
            max_tokens=spec.max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        sample = Sample(
            spec.index, spec.slo_class, ok=False, prompt_tokens=len(spec.prompt_token_ids)
        )
        started = last = time.perf_counter()
        try:
            async for chunk in self._engine.generate(request):
                now = time.perf_counter()
                if chunk.num_tokens:
                    if sample.ttft_ms is None:
                        sample.ttft_ms = (now - started) * 1e3
                    else:
                        sample.chunk_gaps_ms.append((now - last) * 1e3)
                    last = now
                sample.output_tokens = chunk.completion_tokens
        except Exception as e:  # recorded as an error sample; the run goes on
            sample.error = f"{type(e).__name__}: {e}"[:200]
            return sample
        sample.e2e_ms = (time.perf_counter() - started) * 1e3
        sample.ok = True
        return sample

    async def stop(self) -> None:
        from serve_app.engine.vllm_engine import VLLMEngine

        if isinstance(self._engine, VLLMEngine):
            self._engine.shutdown()


class HTTPTarget:
    """An OpenAI-compatible /v1/completions endpoint, streamed."""

    def __init__(
        self,
        url: str,
        name: str,
        send_slo_class: bool,
        model: str | None = None,
        route_policy: str | None = None,
        slo_targets: Mapping[str, SLOClass] | None = None,
    ) -> None:
        """`slo_targets`: send each class's targets as x-slo-ttft-ms / x-slo-tpot-ms too (the
        workload, not the app's configured classes, then defines the SLO)."""
        self.name = name
        self._url = url.rstrip("/")
        self._send_slo_class = send_slo_class
        self._route_policy = route_policy
        self._slo_headers = {
            name: {
                header: str(round(value))
                for header, value in (("x-slo-ttft-ms", c.ttft_ms), ("x-slo-tpot-ms", c.tpot_ms))
                if value is not None
            }
            for name, c in (slo_targets or {}).items()
        }
        self._model = model
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # aiohttp, as vLLM's own benchmark client uses: on a host whose cores the server also
        # needs, the client's per-chunk cost shows up in the figures, so keep it small.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=600)
        self._session = aiohttp.ClientSession(self._url, connector=connector, timeout=timeout)
        if self._model is None:
            async with self._session.get("/v1/models") as r:
                self._model = (await r.json())["data"][0]["id"]

    async def run_one(self, spec: RequestSpec) -> Sample:
        assert self._session is not None
        body = {
            "model": self._model,
            "prompt": spec.prompt_token_ids,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"x-slo-class": spec.slo_class} if self._send_slo_class else {}
        headers.update(self._slo_headers.get(spec.slo_class, {}))
        if self._route_policy:
            headers["x-route-policy"] = self._route_policy
        sample = _new_sample(spec)
        started = last = time.perf_counter()
        chunks = 0
        try:
            async with self._session.post("/v1/completions", json=body, headers=headers) as r:
                sample.status = r.status
                sample.pool = r.headers.get("x-serve-pool")
                if predicted := r.headers.get("x-route-predicted-ttft-ms"):
                    sample.predicted_ttft_ms = float(predicted)
                if predicted := r.headers.get("x-route-predicted-tpot-ms"):
                    sample.predicted_tpot_ms = float(predicted)
                sample.route_reason = r.headers.get("x-route-reason")
                if timing := r.headers.get(SERVER_TIMING_HEADER):
                    sample.stages = parse_server_timing(timing)
                if r.status != 200:
                    sample.error = f"HTTP {r.status}"
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        # the app's refusal names its reason (routing.policy.RejectReason)
                        sample.error += f" {(await r.json(content_type=None))['error']['code']}"
                    # how long the refusal took (a request held before it is refused waits)
                    sample.e2e_ms = (time.perf_counter() - started) * 1e3
                    return sample
                async for raw in r.content:
                    now = time.perf_counter()
                    line = raw.strip()
                    if (stages := parse_stream_timing(line)) is not None:
                        sample.stages = stages  # the whole breakdown, emit included
                        continue
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if usage := event.get("usage"):
                        sample.output_tokens = usage["completion_tokens"]
                    # a chunk is a token arrival even when its text is empty (a token that
                    # decodes to nothing yet, e.g. part of a multi-byte character)
                    if event.get("choices"):
                        if sample.ttft_ms is None:
                            sample.ttft_ms = (now - started) * 1e3
                        else:
                            sample.chunk_gaps_ms.append((now - last) * 1e3)
                        last = now
                        chunks += 1
        except (aiohttp.ClientError, TimeoutError) as e:
            sample.error = type(e).__name__
            return sample
        sample.e2e_ms = (time.perf_counter() - started) * 1e3
        sample.output_tokens = sample.output_tokens or chunks
        sample.ok = sample.ttft_ms is not None
        if not sample.ok:
            sample.error = "no tokens"
        return sample

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()


def make_target(spec: str) -> Target:
    """engine:<profile> | app[@<policy>]:<url> | url:<url>; policy: slo, round-robin, single=<pool>
    (sent as x-route-policy; the app must allow it, see routing.allow_policy_header)."""
    kind, _, rest = spec.partition(":")
    kind, _, policy = kind.partition("@")
    if kind == "engine" and rest:
        return EngineTarget(rest)
    if kind == "app" and rest:
        route_policy = policy.replace("=", ":") if policy else None
        name = f"app@{policy}" if policy else f"app:{rest}"
        return HTTPTarget(rest, name=name, send_slo_class=True, route_policy=route_policy)
    if kind == "url" and rest:
        return HTTPTarget(rest, name=f"url:{rest}", send_slo_class=False)
    raise ValueError(
        f"target '{spec}': expected engine:<profile>, app[@<policy>]:<url> or url:<url>"
    )
