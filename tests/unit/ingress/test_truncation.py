"""Head + tail prompt truncation: what it keeps, and how a request asks for it."""

import pytest
from pydantic import ValidationError

from serve_app.ingress.schemas import Extensions
from serve_app.ingress.truncation import HeadTail

GUIDES = HeadTail()  # 384 + 128


def test_a_long_prompt_keeps_its_first_and_last_tokens() -> None:
    ids = list(range(1000))
    kept, cut = GUIDES.apply(ids)
    assert kept == list(range(384)) + list(range(872, 1000))
    assert cut == 1000 - 512


@pytest.mark.parametrize("n", [0, 1, 511, 512])
def test_a_prompt_that_fits_is_kept_whole(n: int) -> None:
    ids = list(range(n))
    assert GUIDES.apply(ids) == (ids, 0)


def test_head_only_and_tail_only() -> None:
    ids = list(range(10))
    assert HeadTail(head_tokens=3, tail_tokens=0).apply(ids) == ([0, 1, 2], 7)
    assert HeadTail(head_tokens=0, tail_tokens=3).apply(ids) == ([7, 8, 9], 7)
    with pytest.raises(ValidationError, match="at least 1 token"):
        HeadTail(head_tokens=0, tail_tokens=0)


def test_requests_ask_with_true_or_an_object() -> None:
    default = HeadTail(head_tokens=4, tail_tokens=2)
    assert Extensions.take({"prompt": "x"}).truncation(default) is None
    assert Extensions.take({"truncate_prompt": False}).truncation(default) is None
    assert Extensions.take({"truncate_prompt": True}).truncation(default) == default
    body = {"prompt": "x", "truncate_prompt": {"head_tokens": 7, "tail_tokens": 1}}
    assert Extensions.take(body).truncation(default) == HeadTail(head_tokens=7, tail_tokens=1)
    assert body == {"prompt": "x"}  # taken out of the body vLLM's models see


def test_vllm_s_own_tail_truncation_is_left_to_vllm() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 5}
    assert Extensions.take(body).truncation(HeadTail()) is None
    assert body["truncate_prompt_tokens"] == 5


@pytest.mark.parametrize(
    "fields",
    [
        {"truncate_prompt": 1},  # not a boolean: no silent coercion
        {"truncate_prompt": "yes"},
        {"truncate_prompt": {"head_tokens": -1}},
        {"truncate_prompt": {"head": 3}},  # unknown key
        {"truncate_prompt": True, "truncate_prompt_tokens": 5},
    ],
)
def test_bad_truncation_requests_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Extensions.take({"prompt": "x", **fields})
