"""The ingress's request pipeline: everything between the HTTP layer (api.py) and the pools.

Per request: admit it from its headers alone while the body is still unread (`admit`, called by
the guard middleware: under overload what routing would refuse for any prompt is refused at
once), check the body with vLLM's request models and render the prompt with vLLM's render tier,
route it by SLO, dispatch it to the pool's replica, retry once on another replica if that one
died before any output, and pass on what the replica answers while tracking load, learning
latencies and recording metrics.

The pools and the board are Serve deployment handles, or in-process stand-ins
(serve_app/local.py); the renderer is vLLM's (engine/vllm_engine.RenderTier) or the fake
engine's (engine/fake.py). Nothing here needs Ray or vLLM to run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    MutableMapping,
)
from dataclasses import replace
from typing import Any, Protocol, cast

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from serve_app.config import IngressConfig
from serve_app.constants import READY_RETRY_AFTER_S, STATS_PERIOD_S
from serve_app.engine import direct as direct_dispatch
from serve_app.engine.protocol import (
    ApiCall,
    ApiKind,
    EngineDeadError,
    GenerationRequest,
    StreamChunk,
)
from serve_app.ingress.channels import CallCancelled, IngressChannels
from serve_app.ingress.direct import DirectDispatch
from serve_app.ingress.errors import (
    BadRequest,
    EngineFailure,
    ModelNotFound,
    PoolFull,
    ReplyLost,
    ServeError,
    ServiceUnavailable,
    engine_error,
    reject_error,
)
from serve_app.ingress.guard import Guard
from serve_app.ingress.metrics import IngressMetrics, Outcome, outcome_of
from serve_app.ingress.routed import ADMISSION, Admission, Routed, RouteHeaders
from serve_app.ingress.schemas import Extensions
from serve_app.pool_state import IngressPost
from serve_app.routing.config import Policy
from serve_app.routing.estimator import Decoding, Queued
from serve_app.routing.policy import Decision, Reject, RejectReason, RequestFeatures, RouteTo
from serve_app.routing.router import Router
from serve_app.routing.slo import (
    CLASS_HEADER,
    SLO,
    SLOHeaderError,
    parse_route_policy,
    parse_slo,
    route_headers,
)
from serve_app.timing import (
    PROXY_START_HEADER,
    SERVER_TIMING_HEADER,
    Stage,
    elapsed_ms,
    proxy_ms,
    stream_timing,
)

logger = logging.getLogger("ray.serve")

PROXY_START = PROXY_START_HEADER.encode()
BOARD_TIMEOUT_S = 1.0  # a board call slower than this is abandoned (routing goes on without it)
DONE = "data: [DONE]\n\n"  # a stream's last event
JSON = "application/json"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class Renderer(Protocol):
    """Request validation and prompt rendering: vLLM's render tier, or the fake engine's."""

    def schema(self, kind: ApiKind, ref_template: str) -> dict[str, Any]: ...

    def parse(self, kind: ApiKind, body: dict[str, Any]) -> Any: ...

    async def render(self, kind: ApiKind, request: Any) -> ApiCall | tuple[int, str]: ...


class ChunkStream(Protocol):
    """A replica's answer as a pool handle streams it (Serve's DeploymentResponseGenerator)."""

    def __aiter__(self) -> AsyncIterator[StreamChunk]: ...

    def cancel(self) -> None: ...


# nginx's status for a request whose client left before the answer; nobody reads it
CLIENT_CLOSED_REQUEST = 499


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however the response ends.

    Starlette's leaves the iterator suspended when the client goes away (the send fails, or the
    sending task is cancelled) for the garbage collector to close, and the engine request under
    it generates on until then: at once when nothing else refers to it, but only at the next
    collection when a reference cycle (a frame, a traceback) holds it, which an ingress gone
    idle may not run for minutes."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _failed_replica(e: BaseException) -> str:
    """Which replica a failure came from, as far as Ray's error says (its actor or process)."""
    for attr in ("actor_id", "_actor_id", "pid"):
        value = getattr(e, attr, None)
        if value:
            return f"{attr}:{value}"
    return "unknown"


def _max_tokens(call: ApiCall) -> int | None:
    """The completion length the request asks for (None: the rest of the context)."""
    request = call.request
    asked: int | None = getattr(request, "max_completion_tokens", None)
    return asked if asked is not None else cast(int | None, request.max_tokens)


def _with_truncation(data: str, truncated: int) -> str:
    """vLLM's body or usage event, its usage with how many prompt tokens truncation cut."""
    body = json.loads(data)
    body["usage"]["truncated_prompt_tokens"] = truncated
    return json.dumps(body)


def _event(chunk: StreamChunk, truncated: int | None) -> bytes:
    data = chunk.data or ""
    if truncated is not None and data.startswith("data: {") and '"usage":{' in data:
        data = f"data: {_with_truncation(data[6:], truncated)}\n\n"
    return data.encode()


class RequestPipeline:
    """Route → dispatch → retry once → track → learn → metrics, for one ingress replica.

    `pools` maps each pool to a handle of its replicas (`handle.generate.remote(request)`
    streams StreamChunks and can be cancelled), `board` is the pool-state board's handle
    (`exchange`, pool_state.PoolStateBoard). Call `start()` on the event loop that
    serves.
    """

    def __init__(
        self,
        config: IngressConfig,
        pools: Mapping[str, Any],
        board: Any,
        renderer: Renderer,
        ingress_id: str = "local",
    ) -> None:
        self._config = config
        self._pools = dict(pools)
        self._board = board
        self._tier = renderer
        self._router = Router(
            {name: p.max_model_len for name, p in config.pools.items()},
            config.routing,
            {name: p.step_tokens for name, p in config.pools.items()},
            ingress_id,
        )
        self._protecting = False  # the last post to the board protected something
        self.metrics = IngressMetrics(
            frozenset(config.routing.classes), config.routing.default_class
        )
        self.guard = Guard(config.limits, config.auth)
        # Worst lag of the chunks each pool sent since the last refresh: read by the pools'
        # replicas (through the board) to size their message budgets (engine/coalesce.py).
        self._lag_ms: dict[str, float] = {}
        # Requests refused for want of each pool's capacity since the last refresh: demand the
        # pools' autoscaling counts (through the board).
        self._refused: dict[str, int] = {}
        self._ingress_id = ingress_id
        self._channels = IngressChannels(
            self._pools,
            ingress_id,
            [n for n, p in config.pools.items() if p.stream_channel],
            _node_id(),
        )
        self._held = 0  # requests waiting for a pool that protects its running requests
        self._direct = DirectDispatch(_node_id()) if direct_dispatch.enabled() else None
        self._poll: asyncio.Event | None = None  # the next poll of the held requests
        self._refresher: asyncio.Task[None] | None = None

    @property
    def renderer(self) -> Renderer:
        return self._tier

    async def start(self) -> None:
        """Take the pools' state from the board once, then keep refreshing it (routing needs
        it). Serve sends a replica requests as soon as it runs: without that first answer an
        ingress started beside others (scale-up, redeploy) sees no pool ready and refuses its
        first requests with 503 while its siblings serve them. A board that does not answer
        within BOARD_TIMEOUT_S does not hold the start: the refresh loop keeps asking."""
        if self.guard.key_count:
            logger.info(
                "API keys: %d configured; requests without a valid key get 401",
                self.guard.key_count,
            )
        else:
            logger.warning(
                "API keys: none configured (set $%s or auth.api_keys_file): the API is open to "
                "anyone who can reach it",
                self._config.auth.api_keys_env,
            )
        try:
            await self.refresh()
        except Exception:
            logger.warning("pool state: the board did not answer at start", exc_info=True)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        self._channels.stop()
        if self._direct is not None:
            self._direct.stop()

    async def refresh(self) -> None:
        """One exchange with the board: report lag, refusals and what admission protects, take
        the pools' state. What it carried is lost if the call fails (the next one carries
        what came since), as a post the board missed would be."""
        lags, self._lag_ms = self._lag_ms, {}
        refused, self._refused = self._refused, {}
        protected = None
        if self._config.routing.protect_across_ingresses:  # else no ingress reads the posts
            now_protected = self._router.protected()
            if now_protected or self._protecting:  # an empty post withdraws the last one
                protected = now_protected
                self._protecting = bool(now_protected)
        post = IngressPost(self._ingress_id, lags or None, refused or None, protected)
        snapshot = await asyncio.wait_for(self._board.exchange.remote(post), BOARD_TIMEOUT_S)
        self._router.update(snapshot)
        if self._direct is not None:
            self._direct.follow(p for snap in snapshot.values() for _, p in snap.placements)

    async def _refresh_forever(self) -> None:
        while True:  # (start() took the first answer)
            await asyncio.sleep(STATS_PERIOD_S)
            try:
                await self.refresh()
            except Exception:
                # routing goes on with the last known pools (Router.views) until the board is back
                logger.warning("pool state refresh failed", exc_info=True)

    def _refusal(self, decision: Reject) -> ServeError:
        """Count a routing refusal (metrics; demand for the pool that lacked capacity)."""
        self.metrics.route("none", decision.reason.value)
        if decision.demand_pool is not None:
            pool = decision.demand_pool
            self._refused[pool] = self._refused.get(pool, 0) + 1
        return reject_error(decision)

    # --- probes and metadata -------------------------------------------------------------

    def ready(self) -> JSONResponse:
        """Readiness: every pool that keeps replicas has at least one live engine."""
        snaps = self._router.snapshots
        loading = [
            name
            for name, info in self._config.pools.items()
            if info.min_replicas > 0 and not snaps[name].ready
        ]
        pools = {name: s.replicas for name, s in snaps.items()}
        if loading:
            return JSONResponse(
                {"status": "loading", "pools_not_ready": loading, "replicas": pools},
                status_code=503,
                headers={"Retry-After": str(READY_RETRY_AFTER_S)},
            )
        return JSONResponse({"status": "ready", "replicas": pools})

    def pools(self) -> dict[str, object]:
        """Each pool's state as routing sees it: replicas, queues, KV use, learned factors."""
        out: dict[str, object] = {}
        now = time.time()
        by_socket = self._channels.by_socket()
        for view in self._router.views(now):
            factors = view.model.factors(now)  # as routing uses them now
            snap = self._router.snapshots[view.name]
            channels = self._channels.open_to(view.name)
            out[view.name] = {
                "replicas": view.replicas,
                "waiting": view.waiting,
                "running": view.running,
                "queued_prefill_tokens": view.queued_tokens,
                "prefill_tok_s": snap.prefill_tok_s,
                "kv_cache_usage": snap.kv_cache_usage,
                "prefix_cache_hit_rate": snap.prefix_cache_hit_rate,
                "max_model_len": view.max_model_len,
                "ttft_factor": factors.ttft,
                "wait_factor": factors.wait,
                "tpot_factor": factors.tpot,
                "path_ms": view.model.path(now),
                "decode_slack_ms": view.decode_slack_ms,  # theirs and their device-mates'
                "queued_slack_ms": view.queued_slack_ms,
                "decode_pace_ms": view.decode_pace_ms,  # its decoding requests' pace: TPOT floor
                # what the other ingresses protect here (counted in the two slacks above)
                "protected_by_other_ingresses": {
                    ingress: {
                        "queued": len(p.queued),
                        "decode_slack_ms": p.decode_slack_ms,
                        "decode_pace_ms": p.decode_pace_ms,
                    }
                    for ingress, p in snap.protected
                    if ingress != self._ingress_id
                },
                "shares_device_with": [
                    p for p in self._router.sharing(view.name) if p != view.name
                ],
                "ttft_ms_recent_p50": snap.ttft_ms_recent_p50,
                "tpot_ms_recent_p50": snap.tpot_ms_recent_p50,
                "updated_at": snap.updated_at,
                "placement": [
                    {
                        "replica": rid,
                        "node_id": p.node_id,
                        "node_ip": p.node_ip,
                        "gpu_ids": list(p.gpu_ids),
                        # this ingress's stream channel to it is open (engine/channel.py)
                        "stream_channel": rid in channels,
                        # ... and to its engine frontends (engine/frontend.py)
                        "frontend_channels": sum(c.startswith(f"{rid}/") for c in channels),
                        # ... of which over the frontend's socket (engine/direct.ChannelServer)
                        "frontend_channels_by_socket": sum(
                            c.startswith(f"{rid}/") for c in channels & by_socket
                        ),
                        # this ingress sends it requests over its socket (engine/direct.py)
                        "direct_dispatch": self._direct is not None
                        and self._direct.connected(p.dispatch_path),
                    }
                    for rid, p in snap.placements
                ],
            }
        return out

    def models(self) -> dict[str, object]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self._config.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "serve-app",
                    "max_model_len": max(p.max_model_len for p in self._config.pools.values()),
                }
            ],
        }

    # --- generation ----------------------------------------------------------------------

    async def serve(self, kind: ApiKind, request: Request) -> Response:
        try:
            call, truncated = await self._render(kind, request)
            if isinstance(call, Response):
                return call
            return await self._generate(call, truncated, request)
        except ServeError as e:
            self._count_refusal(e.status_code, request)
            raise

    async def _render(
        self, kind: ApiKind, request: Request
    ) -> tuple[ApiCall | Response, int | None]:
        """The request checked by vLLM's models and rendered to tokens by vLLM's render tier
        (or vLLM's error, as its server answers it), with head + tail truncation applied."""
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise BadRequest("body: invalid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("body: must be a JSON object", code="invalid_json")
        try:
            extensions = Extensions.take(body)
            api_request = self._tier.parse(kind, body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        self._check_model(extensions.model)
        if isinstance(api_request, tuple):
            rendered: ApiCall | tuple[int, str] = api_request
        else:
            rendered = await self._tier.render(kind, api_request)
        if not isinstance(rendered, ApiCall):
            status, error = rendered
            self._count_refusal(status, request)
            return Response(error, status_code=status, media_type=JSON), None
        truncation = extensions.truncation(self._config.truncation)
        if truncation is None:
            return rendered, None
        # before routing: the router sees the length the engine will
        cut = 0
        for engine_input in rendered.inputs:
            engine_input["prompt_token_ids"], n = truncation.apply(engine_input["prompt_token_ids"])
            cut += n
        return rendered, cut

    def _count_refusal(self, status_code: int, request: Request) -> None:
        routed: Routed | None = getattr(request.state, "routed", None)
        pool, slo_class = (routed.pool, routed.slo.slo_class) if routed else ("none", "")
        slo_class = slo_class or request.headers.get(CLASS_HEADER, "")
        self.metrics.request(pool, slo_class, outcome_of(status_code))

    def admit(self, scope: MutableMapping[str, Any]) -> ServeError | None:
        """A generation request's Admission, kept in its scope's state; under overload, its
        refusal from the headers alone when routing would refuse it anyway.

        Predicted latency only grows with prompt length and max_tokens, so if the smallest
        possible request (1 prompt token, 1 new token) is refused — pools saturated, no replica,
        or the SLO unmeetable even so — the real one would be too: answer now, before reading,
        parsing and rendering the body (most of a request's cost at the ingress).
        """
        if scope["path"] not in GENERATION_PATHS:
            return None
        stamp = next((v for k, v in scope["headers"] if k == PROXY_START), None)
        admission = Admission(
            arrived=time.perf_counter(),
            proxy_ms=proxy_ms(stamp.decode("latin-1") if stamp else None, time.time()),
        )
        scope.setdefault("state", {})[ADMISSION] = admission
        try:
            admission.headers = self._parse_route_headers(scope["headers"])
        except SLOHeaderError:
            return None  # the route step answers with the header named
        slo, policy, policy_arg = admission.headers
        smallest = RequestFeatures(prompt_tokens=1, max_tokens=1)
        decision = self._router.decide(smallest, slo, time.time(), policy, policy_arg, commit=False)
        if isinstance(decision, RouteTo) or decision.status == 400:
            return None
        admission.refusal = self._refusal(decision)
        self.metrics.request("none", slo.slo_class, outcome_of(admission.refusal.status_code))
        return admission.refusal

    def _check_limits(self, prompt_tokens: int, max_tokens: int | None) -> None:
        limits = self._config.limits
        if limits.max_prompt_tokens is not None and prompt_tokens > limits.max_prompt_tokens:
            raise BadRequest(
                f"prompt has {prompt_tokens} tokens; this endpoint accepts at most "
                f"{limits.max_prompt_tokens}",
                param="input_tokens",
                code="prompt_too_long",
            )
        if (
            limits.max_tokens is not None
            and max_tokens is not None
            and max_tokens > limits.max_tokens
        ):
            raise BadRequest(
                f"max_tokens {max_tokens} exceeds this endpoint's limit of {limits.max_tokens}",
                param="max_tokens",
                code="max_tokens_too_large",
            )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._config.served_model_name:
            raise ModelNotFound(
                f"model '{model[:100]}' is not served here; "
                f"this endpoint serves '{self._config.served_model_name}'",
                param="model",
                code="model_not_found",
            )

    def _parse_route_headers(self, raw: list[tuple[bytes, bytes]]) -> RouteHeaders:
        headers = route_headers(raw)
        slo = parse_slo(headers, self._config.routing)
        policy, policy_arg = parse_route_policy(headers, self._config.routing, self._config.pools)
        return RouteHeaders(slo, policy, policy_arg)

    def _may_hold(self, decision: Decision, slo: SLO) -> bool:
        """A pool would meet the SLO once its running requests can spare the prefill, and the
        TTFT target leaves time to wait another poll for that."""
        poll_ms = self._config.routing.hold_poll_ms
        return (
            isinstance(decision, Reject)
            and decision.reason is RejectReason.PROTECTS_RUNNING
            and decision.wait_ttft_ms is not None
            and slo.ttft_ms is not None
            and decision.wait_ttft_ms + poll_ms <= slo.ttft_ms
        )

    async def _decide(
        self, features: RequestFeatures, slo: SLO, policy: Policy, policy_arg: str | None
    ) -> Decision:
        """Route the request; if the pools that would meet its SLO protect their running
        requests, hold it (up to `max_held` per ingress) and decide again every poll, against
        what is left of its TTFT target, rather than refuse what a short wait would serve.

        The held requests are decided again together, oldest first, at one poll every
        `hold_poll_ms`: one view of the pools serves them all (routing/router.py), and one
        that goes in is dispatched before the next is decided."""
        decision = self._router.decide(features, slo, time.time(), policy, policy_arg)
        if self._held >= self._config.routing.max_held or not self._may_hold(decision, slo):
            return decision
        assert slo.ttft_ms is not None
        self._held += 1
        held = time.perf_counter()
        try:
            while True:
                await self._next_poll()
                left = replace(slo, ttft_ms=slo.ttft_ms - elapsed_ms(held, time.perf_counter()))
                decision = self._router.decide(features, left, time.time(), policy, policy_arg)
                if not self._may_hold(decision, left):
                    return decision
        finally:
            self._held -= 1

    async def _next_poll(self) -> None:
        """Wait for the next poll of the held requests (the first to wait sets it)."""
        if self._poll is None:
            self._poll = poll = asyncio.Event()

            def fire() -> None:
                self._poll = None
                poll.set()  # wakes its waiters in the order they came

            asyncio.get_running_loop().call_later(self._config.routing.hold_poll_ms / 1e3, fire)
        await self._poll.wait()

    async def _route(self, call: ApiCall, prompt_tokens: int, request: Request) -> Routed:
        tokenized = time.perf_counter()
        admission = Admission.of(request)
        parsed = admission.headers if admission is not None else None
        if parsed is None:
            try:
                parsed = self._parse_route_headers(request.scope["headers"])
            except SLOHeaderError as e:
                raise BadRequest(str(e), param=e.header) from None
        slo, policy, policy_arg = parsed
        asked = _max_tokens(call)
        features = RequestFeatures(
            prompt_tokens=prompt_tokens,
            max_tokens=asked or self._config.default_max_tokens,
            max_tokens_set=asked is not None,
        )
        decision = await self._decide(features, slo, policy, policy_arg)
        if not isinstance(decision, RouteTo):
            raise self._refusal(decision)
        self.metrics.route(decision.pool, decision.reason.value)
        started = admission.arrived if admission is not None else tokenized
        decided = time.perf_counter()
        routed = Routed(
            request_id=call.request.request_id,
            pool=decision.pool,
            reason=decision.reason.value,
            slo=slo,
            load=decision.load,
            prompt_tokens=prompt_tokens,
            started=started,
            # the TTFT the client will see: its time here so far (a hold at admission
            # included) and what the decision predicts from now on
            predicted_ttft_ms=elapsed_ms(started, decided) + decision.predicted.ttft_ms,
            tokenized=tokenized,
            decided=decided,
            proxy_ms=admission.proxy_ms if admission is not None else None,
            stages={} if self._config.server_timing else None,
            max_tokens=features.max_tokens,
            predicted_tpot_ms=decision.predicted.tpot_ms,
        )
        request.state.routed = routed
        return routed

    async def _generate(self, call: ApiCall, truncated: int | None, request: Request) -> Response:
        prompt_tokens = sum(len(i["prompt_token_ids"]) for i in call.inputs)
        self._check_limits(prompt_tokens, _max_tokens(call))
        for attempt in range(2):
            routed = await self._route(call, prompt_tokens, request)
            routed.truncated = truncated
            snap = self._router.snapshots.get(routed.pool)
            if snap is not None:  # channels are opened when there are streams to carry
                self._channels.want(routed.pool, (rid for rid, _ in snap.placements))
            carried = self._channels.may_carry(routed.request_id)
            gen = GenerationRequest(
                request_id=routed.request_id,
                prompt_token_ids=[],
                max_tokens=0,  # the request's own (vLLM's serving layer reads it)
                sent_at=time.time() if self._config.server_timing else 0.0,
                api=call,
                channel=self._channels.ingress_id if carried else "",
            )
            if routed.slo.tpot_ms is not None:
                now = time.time()
                ttft_ms = routed.slo.ttft_ms
                routed.queued = Queued(
                    routed.slo.tpot_ms,
                    routed.max_tokens,
                    routed.predicted_tpot_ms,
                    routed.prompt_tokens,
                    now,
                    None
                    if ttft_ms is None
                    else now + (ttft_ms - elapsed_ms(routed.started, time.perf_counter())) / 1e3,
                )
            self._router.dispatched(routed.pool, routed.prompt_tokens, routed.queued)
            direct = None
            if self._direct is not None and snap is not None:
                limit = self._config.pools[routed.pool].max_ongoing_requests
                direct = self._direct.pick(snap.placements, limit)
            routed.dispatched_at = time.time()
            own: Any
            if direct is not None:
                own = direct.call(gen)
                routed.assigned_at = routed.dispatched_at
            else:
                own = self._pools[routed.pool].generate.remote(gen)
                routed.watch_assignment(own)
            stream = self._channels.stream(routed.request_id, own, carried)
            chunks = self._track(routed, stream, request.is_disconnected)
            try:
                # Wait for the first chunk before answering, so that a refusal by the engine
                # still gets its own status code rather than a 200 with an error event.
                first = await anext(chunks)
                break
            except StopAsyncIteration:
                raise EngineFailure("the engine returned no output") from None
            except ServeError:
                raise
            except Exception as e:
                err = engine_error(e)
                if err.status_code >= 500 and not isinstance(err, ServiceUnavailable):
                    logger.warning(
                        "request %s: pool %s failed before output: %s",
                        routed.request_id,
                        routed.pool,
                        repr(e)[:1000],
                    )
                if attempt or not isinstance(err, ServiceUnavailable) or isinstance(err, PoolFull):
                    raise err from None
                # The replica died (engine or actor), or Serve lost its answer, before any
                # output: nothing reached the client, so route again (without a dead replica).
                logger.warning(
                    "request %s: pool %s replica failed before output (%s); routing again",
                    routed.request_id,
                    routed.pool,
                    type(e).__name__,
                )
                if not isinstance(err, ReplyLost):
                    self._router.replica_failed(routed.pool, _failed_replica(e), time.time())
        if first.status != 200:  # vLLM's serving layer refused it: its status and body
            await chunks.aclose()
            self._count_refusal(first.status, request)
            headers = {k: v for k, v in routed.headers.items() if k != SERVER_TIMING_HEADER}
            return Response(first.data, status_code=first.status, media_type=JSON, headers=headers)
        if call.request.stream:
            events = self._sse(routed, first, chunks)
            return ClosingStreamingResponse(
                events, media_type="text/event-stream", headers=routed.headers
            )
        last = first
        try:
            while last.data is None:  # the first token is out; the body comes at the end
                last = await anext(chunks)
        except StopAsyncIteration:  # ended without its body
            if await request.is_disconnected():  # the client left (_track counted it)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            raise EngineFailure("the engine ended the request without its answer") from None
        except ServeError:
            raise
        except Exception as e:  # the engine or its replica died mid-generation: 503, not 500
            raise engine_error(e) from None
        finally:
            await chunks.aclose()  # client gone mid-generation: abort now, not at collection
        if last.status >= 500:  # vLLM's serving layer failed after the first token: the engine
            raise engine_error(EngineDeadError(last.data or "the engine failed"))
        if last.status != 200:
            return Response(last.data, status_code=last.status, media_type=JSON)
        if routed.stages is not None:
            routed.stages["total"] = elapsed_ms(routed.started, time.perf_counter())
        body = last.data if truncated is None else _with_truncation(last.data, truncated)
        return Response(body, media_type=JSON, headers=routed.headers)

    async def _track(
        self,
        routed: Routed,
        stream: ChunkStream,
        client_gone: Callable[[], Awaitable[bool]],
    ) -> AsyncGenerator[StreamChunk, None]:
        """The pool's chunks, with local load accounting and latency learning around them.

        When the client goes away Serve cancels the request's call to the replica as well, and
        that cancellation can reach the stream before the client's does: a call cancelled on
        the replica's side while `client_gone()` says so ends the stream as a disconnect, not
        as a failure."""
        first_at: float | None = None
        last: StreamChunk | None = None
        failed = False  # the stream raised: whoever answers the client counts the outcome
        try:
            async for chunk in stream:
                if chunk.status != 200:  # vLLM's serving layer refused it: nothing to learn
                    yield chunk
                    return
                if chunk.sent_at:
                    lag_ms = (time.time() - chunk.sent_at) * 1e3
                    if lag_ms > self._lag_ms.get(routed.pool, 0.0):
                        self._lag_ms[routed.pool] = lag_ms
                if first_at is None:
                    first_at = time.perf_counter()
                    routed.first_chunk(chunk, first_at)
                    if routed.stages is not None:
                        self.metrics.stages(routed.pool, routed.slo.slo_class, routed.stages)
                    if routed.slo.tpot_ms is not None:
                        routed.decoding = Decoding(
                            routed.slo.tpot_ms,
                            routed.max_tokens,
                            routed.predicted_tpot_ms,
                            time.time(),
                            max(1, chunk.completion_tokens),
                        )
                    self._router.first_token(
                        routed.pool, routed.prompt_tokens, routed.decoding, routed.queued
                    )
                    ttft_ms, path_ms, queue_ms = routed.learned_ttft()
                    # learn at once: in a burst, completions come too late to correct admission
                    self._router.learn(
                        routed.pool,
                        routed.prompt_tokens,
                        routed.load,
                        ttft_ms,
                        None,
                        None,
                        path_ms,
                        queue_ms,
                    )
                elif routed.decoding is not None:
                    routed.decoding.advance(chunk.completion_tokens, time.time())
                last = chunk
                yield chunk
        except CallCancelled:
            if not await client_gone():
                failed = True
                raise
        except Exception:
            failed = True
            raise
        finally:
            self._router.finished(
                routed.pool,
                routed.prompt_tokens,
                got_first_token=first_at is not None,
                decoding=routed.decoding,
                queued=routed.queued,
            )
            if first_at is not None and last is not None and last.finish_reason is not None:
                self._finished(routed, first_at, last)
            else:
                stream.cancel()  # the client went away or we failed: abort the engine request
                if first_at is not None and not failed:
                    self.metrics.request(routed.pool, routed.slo.slo_class, Outcome.DISCONNECTED)

    def _finished(self, routed: Routed, first_at: float, last: StreamChunk) -> None:
        """A request served to its end: learn its latencies and record them."""
        ttft_ms = (first_at - routed.started) * 1e3
        tpot_ms = None
        if last.completion_tokens > 1:
            tpot_ms = (time.perf_counter() - first_at) * 1e3 / (last.completion_tokens - 1)
        if tpot_ms is not None:
            self._router.learn(routed.pool, routed.prompt_tokens, routed.load, None, tpot_ms)
        slo = routed.slo
        met = (slo.ttft_ms is None or ttft_ms <= slo.ttft_ms) and (
            slo.tpot_ms is None or tpot_ms is None or tpot_ms <= slo.tpot_ms
        )
        self.metrics.request(routed.pool, slo.slo_class, Outcome.SERVED)
        self.metrics.served(
            routed.pool,
            slo.slo_class,
            ttft_ms,
            tpot_ms,
            met,
            last.prompt_tokens,
            last.completion_tokens,
        )

    async def _sse(
        self, routed: Routed, first: StreamChunk, rest: AsyncGenerator[StreamChunk, None]
    ) -> AsyncIterator[bytes]:
        """vLLM's events as its server streams them. The first token's breakdown, `emit`
        included, follows as an SSE comment before the end (clients skip comments)."""
        try:
            yield _event(first, routed.truncated)
            if routed.stages is not None:  # the first bytes are with the HTTP server now
                emit_ms = elapsed_ms(routed.first_at, time.perf_counter())
                routed.stages[Stage.EMIT] = emit_ms
                self.metrics.stages(routed.pool, routed.slo.slo_class, {Stage.EMIT: emit_ms})
            async for chunk in rest:
                if chunk.data == DONE and routed.stages is not None:
                    yield stream_timing(routed.stages)
                yield _event(chunk, routed.truncated)
        except Exception as e:
            # Headers are sent: the error travels as an event, then the stream ends.
            err = e if isinstance(e, ServeError) else engine_error(e)
            logger.warning("request %s failed mid-stream: %s", routed.request_id, type(e).__name__)
            self.metrics.request(routed.pool, routed.slo.slo_class, outcome_of(err.status_code))
            error = {
                "error": {"message": err.message, "type": err.error_type, "code": err.status_code}
            }
            yield f"data: {json.dumps(error)}\n\n{DONE}".encode()
        finally:
            await rest.aclose()  # client gone (this generator closed): abort the engine now
