"""Request bodies: text the model cannot see is a 400 naming the field, not an engine failure."""

import json

import pytest
from pydantic import ValidationError

from serve_app.ingress.schemas import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize(
    ("raw", "model", "field"),
    [
        (r'{"prompt": "\ud800"}', CompletionRequest, "prompt"),
        (r'{"prompt": "hi", "stop": ["\udfff"]}', CompletionRequest, "stop"),
        (r'{"prompt": "hi", "stop": "a\ud800"}', CompletionRequest, "stop"),
        (
            r'{"messages": [{"role": "user", "content": "\udc00"}]}',
            ChatCompletionRequest,
            "messages",
        ),
    ],
)
def test_lone_surrogates_are_refused_by_field(raw: str, model: type, field: str) -> None:
    body = json.loads(raw)  # FastAPI parses with the standard library, which lets them through
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    error = e.value.errors()[0]
    assert error["loc"][0] == field and "surrogate" in error["msg"]


def test_ordinary_unicode_passes() -> None:
    body = CompletionRequest.model_validate({"prompt": "你好 🌍", "stop": ["。"]})
    assert body.prompt == "你好 🌍"
