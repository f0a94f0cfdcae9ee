"""One error taxonomy, mapped to HTTP status and OpenAI-shaped bodies in one function.

Bodies are bounded: messages are cut to a few hundred characters, never echo long input, and
never carry paths or tracebacks.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from serve_app.engine.protocol import EngineDeadError, EngineRequestError
from serve_app.ingress.channels import CallCancelled
from serve_app.routing.policy import Reject

_MAX_MESSAGE_CHARS = 300


class ServeError(Exception):
    """Base of every error the API returns on purpose."""

    status_code = 500
    error_type = "internal_server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


class BadRequest(ServeError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(ServeError):
    status_code = 401
    error_type = "authentication_error"


class PayloadTooLarge(ServeError):
    status_code = 413
    error_type = "invalid_request_error"


class RequestTimeout(ServeError):
    status_code = 408
    error_type = "timeout_error"


class HeadersTooLarge(ServeError):
    status_code = 431
    error_type = "invalid_request_error"


class NotFound(ServeError):
    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    pass


class SLOUnmeetable(ServeError):
    """No pool can meet the request's latency objective now; retry later or ask best effort."""

    status_code = 429
    error_type = "rate_limit_error"


class ServiceUnavailable(ServeError):
    """No replica can take the request now (engines loading, pool empty, engine dead)."""

    status_code = 503
    error_type = "service_unavailable"


class PoolFull(ServiceUnavailable):
    """The pool's replicas and its queue are full (Serve's max_queued_requests)."""


class ReplyLost(ServiceUnavailable):
    """Serve's gRPC transport ended a pool call without the replica's accept/reject answer
    (a stream closed with no initial metadata): the call is over and the replica is fine."""


# How Ray Serve's replica_result says it: RuntimeError(f"Unexpected error ({code}): ...")
_LOST_REPLY_PREFIX = "Unexpected error (StatusCode."


class EngineFailure(ServeError):
    status_code = 500
    error_type = "internal_server_error"


def error_body(err: ServeError) -> dict[str, Any]:
    message = err.message
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
    return {
        "error": {
            "message": message,
            "type": err.error_type,
            "param": err.param,
            "code": err.code,
        }
    }


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message quoting client input (a model name, a header)
    may hold lone surrogates, which UTF-8 cannot encode (JSONResponse would fail with a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(err: ServeError, headers: dict[str, str] | None = None) -> JSONResponse:
    all_headers = dict(headers or {})
    if err.retry_after_s is not None:
        all_headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return _AsciiJSONResponse(error_body(err), status_code=err.status_code, headers=all_headers)


def reject_error(decision: Reject) -> ServeError:
    """A routing refusal as an API error: 400 (length), 429 (SLO / saturated), 503 (no replica)."""
    if decision.status == 400:
        return BadRequest(decision.message, param=decision.param, code=decision.reason.value)
    if decision.status == 429:
        return SLOUnmeetable(
            decision.message, code=decision.reason.value, retry_after_s=decision.retry_after_s
        )
    return ServiceUnavailable(
        decision.message, code=decision.reason.value, retry_after_s=decision.retry_after_s
    )


def engine_error(e: BaseException) -> ServeError:
    """What a pool call raised (through Ray) as an API error; each kind has its own status."""
    if isinstance(e, EngineRequestError):
        return BadRequest(str(e.args[0] if e.args else e))
    if isinstance(e, BackPressureError):
        return PoolFull("the pool is at capacity; retry shortly", code="pool_full", retry_after_s=1)
    if isinstance(e, EngineDeadError | RayActorError):
        return ServiceUnavailable("the engine replica serving this request failed", retry_after_s=1)
    if type(e) is RuntimeError and str(e).startswith(_LOST_REPLY_PREFIX):
        return ReplyLost("the engine replica's answer was lost on the way", retry_after_s=1)
    if isinstance(e, CallCancelled):
        return ReplyLost("the engine replica cancelled the call", retry_after_s=1)
    return EngineFailure("the engine failed to generate")
