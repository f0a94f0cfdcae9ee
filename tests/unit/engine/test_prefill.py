"""Prefill accounting: queued tokens, the measured rate, forgetting it."""

import pytest

from serve_app.engine.prefill import PrefillMeter, RecentRate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prefill(meter: PrefillMeter, clock: Clock, tokens: int, s: float, cached: int = 0) -> None:
    """One request alone: queued, its first token `s` later."""
    since = meter.queued(tokens)
    clock.now += s
    meter.prefilled(tokens, since, cached)


def test_rate_is_tokens_over_the_time_prefill_was_pending() -> None:
    clock = Clock()
    meter = PrefillMeter(min_tokens=1000, weight=1.0, forget_after_s=30, clock=clock)
    assert meter.rate() is None
    first = meter.queued(3000)
    clock.now += 0.5
    second = meter.queued(1000)
    assert meter.queued_tokens == 4000
    clock.now += 0.5
    meter.prefilled(3000, first)
    meter.prefilled(1000, second)
    clock.now += 10  # idle: not counted as prefill time
    prefill(meter, clock, 100, 0.1)
    assert meter.queued_tokens == 0
    assert meter.rate() == pytest.approx(4100 / 1.1)  # busy 0.5 + 0.5 + 0.1 s


def test_small_windows_wait_for_enough_tokens_and_old_rates_are_forgotten() -> None:
    clock = Clock()
    meter = PrefillMeter(min_tokens=1000, weight=1.0, forget_after_s=30, clock=clock)
    prefill(meter, clock, 500, 0.1)
    assert meter.rate() is None  # 500 tokens: not enough to measure
    prefill(meter, clock, 500, 0.1)
    assert meter.rate() == pytest.approx(1000 / 0.2)
    clock.now += 31
    assert meter.rate() is None


def test_a_window_that_never_fills_forgets_its_old_requests() -> None:
    clock = Clock()
    meter = PrefillMeter(min_tokens=1000, weight=1.0, forget_after_s=30, clock=clock)
    prefill(meter, clock, 600, 0.1)
    clock.now += 40
    prefill(meter, clock, 600, 0.2)
    assert meter.rate() is None  # the first 600 are 40 s old: 600 tokens in the window
    prefill(meter, clock, 600, 0.2)
    assert meter.rate() == pytest.approx(1200 / 0.4)


def test_dropped_requests_leave_the_queue() -> None:
    meter = PrefillMeter(clock=Clock())
    meter.queued(200)
    meter.dropped(200)
    assert meter.queued_tokens == 0


def test_recent_rate_counts_a_sliding_window() -> None:
    clock = Clock()
    rate = RecentRate(window_s=5, clock=clock)
    for _ in range(10):
        rate.add()
    assert rate.per_s() == 2.0
    clock.now += 6
    assert rate.per_s() == 0.0


def test_prompt_tokens_found_in_the_prefix_cache_are_not_counted_as_prefilled() -> None:
    """A prompt mostly in the prefix cache comes back at once: counted whole, its tokens would
    make the rate the cache's, far above what a new prompt's prefill takes."""
    clock = Clock()
    meter = PrefillMeter(min_tokens=1000, weight=1.0, forget_after_s=30, clock=clock)
    prefill(meter, clock, 3000, 0.5)
    prefill(meter, clock, 3000, 0.1, cached=2500)
    assert meter.queued_tokens == 0
    assert meter.rate() == pytest.approx(3500 / 0.6)


def test_requests_that_computed_a_few_tokens_measure_nothing() -> None:
    """Prompts found whole in the prefix cache (all but a few tokens), pending back to back
    while each waits its step: neither their tokens nor their time count, else the rate would
    be a few tokens a step, a small fraction of what the engine prefills."""
    clock = Clock()
    meter = PrefillMeter(min_tokens=1000, weight=1.0, forget_after_s=30, clock=clock)
    for _ in range(200):
        prefill(meter, clock, 100, 0.05, cached=96)
    assert meter.rate() is None
    since = meter.queued(2000)
    cached = [meter.queued(100) for _ in range(10)]
    clock.now += 0.4
    for queued_at in cached:
        meter.prefilled(100, queued_at, cached=96)
    meter.prefilled(2000, since)
    assert meter.queued_tokens == 0
    assert meter.rate() == pytest.approx(2000 / 0.4)
