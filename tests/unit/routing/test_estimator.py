"""Decode slack and prefill headroom: how much more delay the requests of a pool can take and
still meet their TPOT targets."""

import pytest

from serve_app.routing.estimator import Decoding, prefill_headroom_ms

T0 = 1000.0


def decoding(
    tokens: int = 1, target: float = 40.0, max_tokens: int = 51, prompt: int = 0
) -> Decoding:
    return Decoding(target, max_tokens, 20.0, prompt, first_at=T0, tokens=tokens)


def waiting(prompt: int, target: float = 40.0, max_tokens: int = 51) -> Decoding:
    return Decoding(target, max_tokens, 20.0, prompt)


def test_before_it_has_a_pace_of_its_own_the_prediction_stands_in() -> None:
    # 50 more tokens at the predicted 20 ms against a budget of 50 x 40 ms
    assert decoding().slack_ms(T0) == pytest.approx(2000 - 1000)
    assert waiting(100).slack_ms(T0 + 5) == pytest.approx(2000 - 1000)  # no decode time spent


def test_a_request_on_pace_for_its_target_has_no_slack_left() -> None:
    d = decoding(tokens=11)
    assert d.pace_ms(T0 + 0.4) == pytest.approx(40.0)
    assert d.slack_ms(T0 + 0.4) == pytest.approx(0.0, abs=1e-6)


def test_a_fast_request_can_absorb_the_time_it_is_ahead() -> None:
    d = decoding(tokens=11)  # 10 tokens in 100 ms: 10 ms each, 40 more to come
    assert d.slack_ms(T0 + 0.1) == pytest.approx(2000 - 100 - 40 * 10)


def test_a_finished_request_has_only_the_time_it_is_under_budget() -> None:
    assert decoding(tokens=51).slack_ms(T0 + 1.0) == pytest.approx(2000 - 1000)


def test_decoding_requests_are_stalled_by_all_the_queued_prefill() -> None:
    fast = decoding(tokens=11)  # slack 1,500 ms at T0 + 0.1
    assert prefill_headroom_ms([fast], 0, 1.0, T0 + 0.1) == pytest.approx(1500)
    assert prefill_headroom_ms([fast], 1000, 1.0, T0 + 0.1) == pytest.approx(500)
    assert prefill_headroom_ms([], 1000, 1.0, T0) is None


def test_a_waiting_request_is_stalled_only_by_the_prompts_dispatched_after_it() -> None:
    first, second = waiting(3000), waiting(3000)  # slack 1,000 ms each
    # the first decodes while the second prefills (3,000 tokens at 0.2 ms); the second, last in
    # the queue, shares its steps with no prefill yet
    headroom = prefill_headroom_ms([first, second], 6000, 0.2, T0)
    assert headroom == pytest.approx(1000 - 600)


def test_requests_that_miss_anyway_protect_no_one() -> None:
    late = decoding(tokens=11)  # 10 tokens in 1 s: 100 ms each, it misses whatever happens
    fine = decoding(tokens=11, target=100.0)
    assert late.slack_ms(T0 + 1.0) < 0
    assert prefill_headroom_ms([late, fine], 0, 1.0, T0 + 1.0) == pytest.approx(
        fine.slack_ms(T0 + 1.0)
    )
    assert prefill_headroom_ms([late], 0, 1.0, T0 + 1.0) is None
