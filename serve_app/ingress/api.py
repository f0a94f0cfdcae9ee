"""The ingress's HTTP layer: an OpenAI-compatible API over the request pipeline.

`create_app(pipeline)` is the FastAPI app (probes, routes, exception handlers, the guard
middleware); `Ingress` is the Serve deployment that builds the pipeline over the pools' and the
board's handles and serves that app. Every routed response carries `x-serve-pool` and
`x-route-reason`; what happens to a request is in pipeline.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.config import IngressConfig
from serve_app.engine.protocol import ApiKind
from serve_app.ingress.errors import BadRequest, NotFound, ServeError, error_response
from serve_app.ingress.guard import GuardMiddleware
from serve_app.ingress.metrics import Outcome
from serve_app.ingress.pipeline import Renderer, RequestPipeline
from serve_app.ingress.routed import Routed
from serve_app.routing.slo import CLASS_HEADER
from serve_app.timing import SERVER_TIMING_HEADER


def create_app(pipeline: RequestPipeline) -> FastAPI:
    """The HTTP API of one ingress replica, serving through `pipeline`."""
    app = FastAPI(title="serve-app", description="SLO-aware OpenAI-compatible LLM endpoint")
    app.add_middleware(GuardMiddleware, guard=pipeline.guard, admit=pipeline.admit)

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, err: ServeError) -> JSONResponse:
        """An API error; one raised after routing says which pool the request was sent to."""
        routed: Routed | None = getattr(request.state, "routed", None)
        if routed is None:
            return error_response(err)
        headers = {k: v for k, v in routed.headers.items() if k != SERVER_TIMING_HEADER}
        return error_response(err, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        pipeline.metrics.request(
            "none", request.headers.get(CLASS_HEADER, ""), Outcome.CLIENT_ERROR
        )
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # loc is (body, byte offset): no parameter
            return error_response(BadRequest("body: invalid JSON", code="invalid_json"))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return error_response(BadRequest(f"{where}: {first.get('msg', 'invalid')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        """Framework errors (unknown path, wrong method) in the same OpenAI shape as ours."""
        if isinstance(err.__cause__, ServeError):  # raised while reading the body (its limit)
            return error_response(err.__cause__)
        kind = NotFound if err.status_code == 404 else BadRequest
        error = kind(str(err.detail)[:200], code=f"http_{err.status_code}")
        error.status_code = err.status_code
        return error_response(error, dict(err.headers or {}))

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the generation endpoints' bodies: the renderer's request
        models (vLLM's, or the fake engine's) and their parts under components."""
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        template = "#/components/schemas/{model}"
        for path, kind in (
            ("/v1/completions", ApiKind.COMPLETION),
            ("/v1/chat/completions", ApiKind.CHAT),
        ):
            body = pipeline.renderer.schema(kind, template)
            schemas.update(body.pop("$defs", {}))
            name = str(body.get("title", kind.value))
            schemas[name] = body
            content = {"application/json": {"schema": {"$ref": template.format(model=name)}}}
            doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the ingress is up (engines may still be loading)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: every pool that keeps replicas has at least one live engine."""
        return pipeline.ready()

    @app.get("/pools")
    async def pools() -> dict[str, object]:
        """Each pool's state as routing sees it: replicas, queues, KV use, learned factors."""
        return pipeline.pools()

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return pipeline.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await pipeline.serve(ApiKind.COMPLETION, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await pipeline.serve(ApiKind.CHAT, request)

    return app


async def _renderer(config: IngressConfig) -> Renderer:
    if config.engine == "fake":
        from serve_app.engine.fake import FakeRenderer

        return FakeRenderer(config.served_model_name)
    from serve_app.engine.vllm_engine import RenderTier  # vLLM: imported where it is used

    return await RenderTier.start(config.model, config.served_model_name)


@serve.deployment
@serve.ingress()
class Ingress:
    """One ingress replica: the request pipeline over the pools' handles, served over HTTP."""

    async def __init__(  # type: ignore[misc]
        self,
        config: IngressConfig,
        pools: dict[str, DeploymentHandle[Any]],
        board: DeploymentHandle[Any],
    ) -> None:
        # Token streams from the pools travel over Serve's gRPC transport (a message per chunk
        # on one gRPC stream) rather than as Ray objects (an object, its ownership bookkeeping
        # and a task event per chunk), pickled with the standard pickler: chunks are plain
        # slotted dataclasses.
        streams = {
            name: handle.options(
                stream=True,
                _by_reference=False,
                request_serialization="pickle",
                response_serialization="pickle",
            )
            for name, handle in pools.items()
        }
        ingress_id = serve.get_replica_context().replica_id.unique_id
        self._pipeline = RequestPipeline(
            config, streams, board, await _renderer(config), ingress_id
        )
        await self._pipeline.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self._pipeline)
