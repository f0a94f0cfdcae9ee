import json

from serve_app.ingress.errors import BadRequest, SLOUnmeetable, error_body, error_response


def test_openai_shape() -> None:
    body = error_body(BadRequest("bad max_tokens", param="max_tokens", code="x"))
    assert body == {
        "error": {
            "message": "bad max_tokens",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "x",
        }
    }


def test_messages_are_bounded() -> None:
    body = error_body(BadRequest("x" * 10_000))
    assert len(json.dumps(body)) < 500
    assert body["error"]["message"].endswith("...")


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    r = error_response(SLOUnmeetable("busy", retry_after_s=0.2))
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert error_response(SLOUnmeetable("busy", retry_after_s=2.1)).headers["retry-after"] == "3"


def test_engine_errors_map_each_kind_to_its_status() -> None:
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    from serve_app.engine.protocol import EngineDeadError, EngineRequestError
    from serve_app.ingress.errors import PoolFull, ReplyLost, ServiceUnavailable, engine_error

    assert engine_error(EngineRequestError("bad stop")).status_code == 400
    full = engine_error(BackPressureError(num_queued_requests=9, max_queued_requests=8))
    assert isinstance(full, PoolFull) and full.status_code == 503 and full.retry_after_s
    dead = engine_error(EngineDeadError("gone"))
    assert isinstance(dead, ServiceUnavailable) and not isinstance(dead, PoolFull)
    assert engine_error(ActorDiedError()).status_code == 503
    assert engine_error(RuntimeError("boom")).status_code == 500
    # Serve's gRPC stream closed without the replica's accept/reject answer: retriable, and
    # not the replica's fault
    lost = engine_error(RuntimeError("Unexpected error (StatusCode.OK): ."))
    assert isinstance(lost, ReplyLost) and lost.status_code == 503
    dead_alike = EngineDeadError("Unexpected error (StatusCode.OK)")
    assert not isinstance(engine_error(dead_alike), ReplyLost)
    assert "boom" not in engine_error(RuntimeError("boom")).message  # no internals leak


def test_error_bodies_survive_unencodable_client_input() -> None:
    from serve_app.ingress.errors import ModelNotFound

    r = error_response(ModelNotFound("model '\ud981x' is not served here", param="model"))
    assert r.status_code == 404
    assert json.loads(r.body)["error"]["param"] == "model"
