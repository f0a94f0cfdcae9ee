"""Decode slack: how much more delay a streaming request can take and still meet its TPOT."""

import pytest

from serve_app.routing.estimator import Decoding, decode_slack_ms

T0 = 1000.0


def decoding(
    tokens: int = 1, target: float = 40.0, max_tokens: int = 51, over_s: float = 0.0
) -> Decoding:
    """A decode that got `tokens` tokens one by one, evenly over `over_s` after its first."""
    d = Decoding(target, max_tokens, predicted_tpot_ms=20.0, first_at=T0)
    for i in range(2, tokens + 1):
        d.advance(i, T0 + over_s * (i - 1) / (tokens - 1))
    return d


def test_before_it_has_a_pace_of_its_own_the_prediction_stands_in() -> None:
    d = decoding()
    # 50 more tokens at the predicted 20 ms against a budget of 50 x 40 ms
    assert d.slack_ms(T0) == pytest.approx(2000 - 1000)


def test_a_request_on_pace_for_its_target_has_no_slack_left() -> None:
    d = decoding(tokens=11, over_s=0.4)
    assert d.pace_ms() == pytest.approx(40.0)
    assert d.slack_ms(T0 + 0.4) == pytest.approx(0.0, abs=1e-6)


def test_a_fast_request_can_absorb_the_time_it_is_ahead() -> None:
    d = decoding(tokens=11, over_s=0.1)  # 10 tokens in 100 ms: 10 ms each, 40 more to come
    assert d.slack_ms(T0 + 0.1) == pytest.approx(2000 - 100 - 40 * 10)


def test_the_smallest_slack_of_those_that_can_still_make_it() -> None:
    late = decoding(tokens=11, over_s=1.0)  # 10 tokens in 1 s: 100 ms each, it misses anyway
    fine = decoding(tokens=11, target=100.0, over_s=0.5)
    assert late.slack_ms(T0 + 1.0) < 0
    assert decode_slack_ms([late, fine], T0 + 1.0) == pytest.approx(fine.slack_ms(T0 + 1.0))
    assert decode_slack_ms([late], T0 + 1.0) is None
    assert decode_slack_ms([], T0) is None


def test_a_finished_request_has_only_the_time_it_is_under_budget() -> None:
    d = decoding(tokens=51, over_s=1.0)
    assert d.slack_ms(T0 + 1.0) == pytest.approx(2000 - 1000)


def test_a_stall_it_sat_through_is_spent_budget_not_its_pace() -> None:
    # 10 ms per token, then one 1 s prefill of another request, then 10 ms per token again
    d = decoding(target=100.0)
    at = T0
    for i in range(2, 12):
        at += 1.0 if i == 6 else 0.01
        d.advance(i, at)
    assert d.pace_ms() == pytest.approx(10.0)
    # 50 x 100 ms of budget, 1.09 s spent, 40 tokens to come at 10 ms
    assert d.slack_ms(at) == pytest.approx(5000 - 1090 - 400)


def test_a_chunk_of_several_tokens_counts_its_gap_per_token() -> None:
    d = decoding()
    d.advance(5, T0 + 0.08)  # 4 tokens in one chunk after 80 ms
    d.advance(5, T0 + 0.09)  # no new token: nothing to learn
    d.advance(7, T0 + 0.12)
    assert list(d.gaps_ms) == pytest.approx([20.0, 20.0])
    assert d.tokens == 7
