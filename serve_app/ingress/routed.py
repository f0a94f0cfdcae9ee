"""One request's record in the ingress, from its headers to its last chunk: what admission
learned before its body was read (`Admission`), and where routing sent it, what was predicted,
when each step happened and the first token's stages (`Routed`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from starlette.requests import Request

from serve_app.engine.protocol import StreamChunk
from serve_app.ingress.errors import ServeError
from serve_app.ingress.truncation import TRUNCATED_HEADER
from serve_app.routing.config import Policy
from serve_app.routing.estimator import Decoding, Load, Queued
from serve_app.routing.slo import SLO
from serve_app.timing import (
    ENGINE_STAGES,
    SERVER_TIMING_HEADER,
    TTFT,
    Stage,
    elapsed_ms,
    format_server_timing,
)

ADMISSION = "admission"  # the key of a request's Admission in its ASGI scope's state


class RouteHeaders(NamedTuple):
    """A request's SLO and routing-policy headers, parsed."""

    slo: SLO
    policy: Policy
    policy_arg: str | None


@dataclass(slots=True)
class Admission:
    """What the ingress learned of a request from its headers before reading its body.

    Made by `RequestPipeline.admit` (the guard middleware calls it) and read by the route step:
    when the request arrived (its TTFT, measured and learned from, includes the time queued in
    the ingress, parsing and rendering), its time in Serve's proxy, and its parsed route
    headers (None when they were invalid: the route step then answers 400 naming the header).
    """

    arrived: float  # perf_counter
    proxy_ms: float | None = None
    headers: RouteHeaders | None = None
    refusal: ServeError | None = field(default=None)

    @staticmethod
    def of(request: Request) -> Admission | None:
        admission: Admission | None = request.scope.get("state", {}).get(ADMISSION)
        return admission


@dataclass(slots=True)
class Routed:
    request_id: str
    pool: str
    reason: str
    slo: SLO
    load: Load
    prompt_tokens: int
    started: float  # perf_counter: the ingress saw the request
    predicted_ttft_ms: float
    tokenized: float  # perf_counter: its prompt was tokens
    decided: float  # perf_counter: routed
    proxy_ms: float | None = None
    # ms per stage of the first token's way (serve_app/timing.py); None when not timed
    stages: dict[str, float] | None = None
    first_at: float = 0.0  # perf_counter: the first chunk reached the ingress
    truncated: int | None = None  # prompt tokens cut, when the request asked for truncation
    max_tokens: int = 0  # the completion length routing predicted for
    predicted_tpot_ms: float = 0.0
    # until its first token, then from it on, when its SLO sets a TPOT target
    queued: Queued | None = None
    decoding: Decoding | None = None
    dispatched_at: float = 0.0  # time.time(): handed to Serve
    assigned_at: float | None = None  # time.time(): a replica of the pool took it (when known)

    @property
    def headers(self) -> dict[str, str]:
        headers = {
            "x-serve-pool": self.pool,
            "x-route-reason": self.reason,
            "x-route-predicted-ttft-ms": f"{self.predicted_ttft_ms:.1f}",
            "x-route-predicted-tpot-ms": f"{self.predicted_tpot_ms:.1f}",
        }
        if self.stages is not None:
            headers[SERVER_TIMING_HEADER] = format_server_timing(self.stages)
        if self.truncated is not None:
            headers[TRUNCATED_HEADER] = str(self.truncated)
        return headers

    def first_chunk(self, chunk: StreamChunk, now: float) -> None:
        """The first chunk arrived (perf_counter `now`): the stages of its way, when timed."""
        self.first_at = now
        if self.stages is None:
            return
        stages = self.stages
        if self.proxy_ms is not None:
            stages[Stage.PROXY] = self.proxy_ms
        stages[Stage.INGRESS] = elapsed_ms(self.started, self.tokenized)
        stages[Stage.ROUTE] = elapsed_ms(self.tokenized, self.decided)
        remote = chunk.stages or {}
        for stage in (Stage.DISPATCH, *ENGINE_STAGES):
            if stage in remote:
                stages[stage] = remote[stage]
        if chunk.sent_at:
            stages[Stage.RETURN] = elapsed_ms(chunk.sent_at, time.time())
        stages[TTFT] = elapsed_ms(self.started, now)

    def learned_ttft(self) -> tuple[float, float | None, float | None]:
        """What routing learns from: the TTFT since the proxy received the request (where it
        said when) less its time at routing, the part of that outside the queues and the
        prefill, and its time queued (those two when the engine said how long its stages
        took). A request held at routing waited for admission, which decides each later
        request afresh: learned as part of the path, its hold would be predicted for every
        later request there, and the holds and refusals that prediction makes would teach
        longer ones. Queued counts its wait in Serve's queue for a replica with a free slot
        (`slot_wait_ms`) with its wait in the engine's: a wait behind the requests ahead, which
        routing predicts from them (the wait factor), not a path every request takes (the
        wait that round-robin's documents met there taught tens of seconds of path)."""
        ttft_ms = elapsed_ms(self.started, self.first_at) - elapsed_ms(self.tokenized, self.decided)
        stages = self.stages or {}
        ttft_ms += stages.get(Stage.PROXY, 0.0)
        if Stage.QUEUE in stages and Stage.PREFILL in stages:
            queue_ms = stages[Stage.QUEUE] + self.slot_wait_ms()
            return ttft_ms, max(0.0, ttft_ms - queue_ms - stages[Stage.PREFILL]), queue_ms
        return ttft_ms, None, None

    def slot_wait_ms(self) -> float:
        """Its time from its dispatch until a replica took it: in Serve's queue while every
        replica of the pool had `max_ongoing_requests` (0 when not known)."""
        if self.assigned_at is None or not self.dispatched_at:
            return 0.0
        return max(0.0, (self.assigned_at - self.dispatched_at) * 1e3)

    def watch_assignment(self, response: Any) -> None:
        """Note when Serve hands `response`'s call (from `.remote()`) to a replica. Serve has
        no public hook for it; its response's assignment future says (Ray 2.60), else none is
        noted."""
        future = getattr(response, "_replica_result_future", None)
        if future is not None:
            future.add_done_callback(self._assigned)

    def _assigned(self, _: object) -> None:
        self.assigned_at = time.time()  # on Serve's router loop (a thread of its own, or ours)
