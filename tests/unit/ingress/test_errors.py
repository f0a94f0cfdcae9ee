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
