"""What the ingress checks beyond vLLM's models: a 400 naming the field, not an engine failure."""

import json

import pytest
from pydantic import ValidationError

from serve_app.ingress.schemas import Extensions


@pytest.mark.parametrize(
    "raw",
    [r'{"prompt": "hi", "stop": ["\udfff"]}', r'{"prompt": "hi", "stop": "a\ud800"}'],
)
def test_lone_surrogates_in_stop_strings_are_refused(raw: str) -> None:
    body = json.loads(raw)  # the standard library lets them through
    with pytest.raises(ValidationError) as e:
        Extensions.take(body)
    error = e.value.errors()[0]
    assert error["loc"][0] == "stop" and "surrogate" in error["msg"]


@pytest.mark.parametrize("stop", ["", ["a", ""], ["x" * 257]])
def test_empty_or_huge_stop_strings_are_refused(stop: object) -> None:
    with pytest.raises(ValidationError, match="stop sequences"):
        Extensions.take({"prompt": "hi", "stop": stop})


def test_ordinary_requests_pass_untouched() -> None:
    body = {"prompt": "你好 🌍", "stop": ["。"], "logprobs": 2, "model": "m"}
    found = Extensions.take(dict(body))
    assert found.model == "m" and found.stop == ["。"]
