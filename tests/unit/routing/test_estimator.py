"""Decode slack: how much more delay a streaming request can take and still meet its TPOT."""

import pytest

from serve_app.routing.estimator import Decoding, decode_slack_ms

T0 = 1000.0


def decoding(tokens: int = 1, target: float = 40.0, max_tokens: int = 51) -> Decoding:
    return Decoding(target, max_tokens, predicted_tpot_ms=20.0, first_at=T0, tokens=tokens)


def test_before_it_has_a_pace_of_its_own_the_prediction_stands_in() -> None:
    d = decoding()
    # 50 more tokens at the predicted 20 ms against a budget of 50 x 40 ms
    assert d.slack_ms(T0) == pytest.approx(2000 - 1000)


def test_a_request_on_pace_for_its_target_has_no_slack_left() -> None:
    d = decoding(tokens=11)
    assert d.pace_ms(T0 + 0.4) == pytest.approx(40.0)
    assert d.slack_ms(T0 + 0.4) == pytest.approx(0.0, abs=1e-6)


def test_a_fast_request_can_absorb_the_time_it_is_ahead() -> None:
    d = decoding(tokens=11)  # 10 tokens in 100 ms: 10 ms each, 40 more to come
    assert d.slack_ms(T0 + 0.1) == pytest.approx(2000 - 100 - 40 * 10)


def test_the_smallest_slack_of_those_that_can_still_make_it() -> None:
    late = decoding(tokens=11)  # 10 tokens in 1 s: 100 ms each, it misses whatever happens
    fine = decoding(tokens=11, target=100.0)
    assert late.slack_ms(T0 + 1.0) < 0
    assert decode_slack_ms([late, fine], T0 + 1.0) == pytest.approx(fine.slack_ms(T0 + 1.0))
    assert decode_slack_ms([late], T0 + 1.0) is None
    assert decode_slack_ms([], T0) is None


def test_a_finished_request_has_only_the_time_it_is_under_budget() -> None:
    d = decoding(tokens=51)
    assert d.slack_ms(T0 + 1.0) == pytest.approx(2000 - 1000)
