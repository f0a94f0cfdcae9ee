"""The latency model's learning, and decode slack: how much more delay a streaming request can
take and still meet its TPOT."""

import pytest

from serve_app.routing.config import LatencyPrior
from serve_app.routing.estimator import (
    Decoding,
    LatencyModel,
    Load,
    Queued,
    decode_pace_ms,
    decode_slack_ms,
    queued_slack_ms,
)

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


def test_a_queued_request_has_its_whole_budget_less_its_decode_at_the_predicted_pace() -> None:
    doc = Queued(tpot_target_ms=150, max_tokens=25, predicted_tpot_ms=50, prompt_tokens=3000)
    assert doc.slack_ms() == pytest.approx(24 * 100)
    assert queued_slack_ms([doc], ms_per_prefill_token=0.2) == pytest.approx(2400)


def test_the_prompts_queued_after_each_request_spend_its_slack_and_no_one_elses() -> None:
    """Three documents queued in turn: the first decodes while the other two prefill, the last
    while nothing queued after it does. At 0.2 ms a token each 3,000-token prompt costs 600 ms."""
    docs = [Queued(150, 25, 50, 3000) for _ in range(3)]  # 2,400 ms of slack each
    assert queued_slack_ms(docs, 0.2) == pytest.approx(2400 - 2 * 600)
    # a request that cannot meet its target anyway is not protected, but its prompt still
    # stalls the ones queued before it
    hopeless = Queued(40, 10, 60, 3000)
    assert hopeless.slack_ms() < 0
    assert queued_slack_ms([docs[0], hopeless], 0.2) == pytest.approx(2400 - 600)
    assert queued_slack_ms([hopeless], 0.2) is None
    # six queued: the prompts after the first already spend more than its 2,400 ms, so it
    # misses whatever comes; the second has none left to give
    assert queued_slack_ms([Queued(150, 25, 50, 3000) for _ in range(6)], 0.2) == pytest.approx(0)
    assert queued_slack_ms([], 0.2) is None


def test_a_queued_request_past_its_ttft_deadline_is_not_protected() -> None:
    """Its first token is late: it has missed its SLO, so its TPOT is no longer admission's to
    keep (and a request whose answer never comes stops holding the pool shut). Its prompt
    still stalls the ones queued before it."""
    early = Queued(150, 25, 50, 3000, dispatched_at=T0, ttft_deadline=T0 + 5)
    late = Queued(150, 25, 50, 3000, dispatched_at=T0 + 1, ttft_deadline=T0 + 2)
    assert queued_slack_ms([early, late], 0.2, now=T0 + 1.5) == pytest.approx(2400 - 600)
    assert queued_slack_ms([late], 0.2, now=T0 + 1.5) == pytest.approx(2400)
    assert queued_slack_ms([early, late], 0.2, now=T0 + 3) == pytest.approx(2400 - 600)
    assert queued_slack_ms([late], 0.2, now=T0 + 3) is None
    assert queued_slack_ms([early, late], 0.2, now=T0 + 6) is None
    # without a TTFT target it is protected until it ends
    assert queued_slack_ms([Queued(150, 25, 50, 3000)], 0.2, now=T0 + 1e6) == pytest.approx(2400)


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


# The pool's measured prefill rate: 0.02 ms a token (50k tokens/s)
RATED = LatencyModel(
    LatencyPrior(ttft_base_ms=20, ttft_ms_per_waiting_request=1, ttft_ms_per_running_request=0),
    measured_ms_per_token=0.02,
)


def _engine(prompt_tokens: int, load: Load) -> tuple[float, float]:
    """The engine of the H200 sweep, as its timestamps told it: a document's own prefill ran 4x
    faster than the pool's measured rate, the queue ahead 1.5x slower (queue, prefill) ms."""
    queue_ms = 1.5 * 0.02 * load.queued_tokens
    prefill_ms = 0.25 * (20 + 0.02 * prompt_tokens)
    return queue_ms, prefill_ms


def test_the_wait_in_the_queue_and_the_own_prefill_are_learned_apart() -> None:
    """Documents (7,000 tokens) and short interactive requests on one pool: one factor over the
    whole engine time settles between the two shapes and predicts a short request behind a
    queue of documents too low (1.6x at the median on one H200). Learned apart, by the engine's
    queue and prefill timestamps, each shape is predicted as the engine runs it."""
    model = RATED
    path_ms = 10.0
    for i in range(200):
        prompt, load = (7000, Load(queued_tokens=14_000)) if i % 3 else (200, Load())
        queue_ms, prefill_ms = _engine(prompt, load)
        ttft_ms = path_ms + queue_ms + prefill_ms
        model = model.learn(prompt, load, ttft_ms, None, 0.2, T0, path_ms, queue_ms)
    short_behind_docs = Load(queued_tokens=14_000)
    queue_ms, prefill_ms = _engine(200, short_behind_docs)
    truth = path_ms + queue_ms + prefill_ms
    assert model.predict(200, short_behind_docs, T0).ttft_ms == pytest.approx(truth, rel=0.02)
    doc_truth = path_ms + sum(_engine(7000, short_behind_docs))
    assert model.predict(7000, short_behind_docs, T0).ttft_ms == pytest.approx(doc_truth, rel=0.02)
    assert model.factors(T0).wait == pytest.approx(1.5, rel=0.01)
    assert model.factors(T0).ttft == pytest.approx(0.25, rel=0.01)


def test_a_wait_nobody_predicted_is_the_request_s_own() -> None:
    """An empty queue predicts no wait, so a time in the queue cannot teach the wait factor
    (a ratio to nothing): it counts as the request's own engine time."""
    model = RATED.learn(200, Load(), 100.0, None, 1.0, T0, path_ms=10.0, queue_ms=30.0)
    assert model.factors(T0).wait == 1.0
    own = 20 + 0.02 * 200
    assert model.factors(T0).ttft == pytest.approx(90 / own)


def test_without_the_engine_s_stages_both_factors_learn_the_whole() -> None:
    model = RATED.learn(200, Load(queued_tokens=1000), 96.0, None, 1.0, T0)
    raw = RATED.unscaled(200, Load(queued_tokens=1000)).ttft_ms
    assert model.factors(T0).ttft == model.factors(T0).wait == pytest.approx(96 / raw)


def test_a_model_that_predicts_no_own_time_learns_nothing_from_the_split() -> None:
    """A prior with no base and no per-token cost predicts 0 ms of the request's own work: a
    measurement cannot scale that (no division by zero), and the model stays as it was."""
    free = LatencyModel(LatencyPrior(ttft_base_ms=0, ttft_ms_per_prompt_token=0))
    learned = free.learn(10, Load(waiting=0.25), 50.0, None, 1.0, T0, path_ms=10.0, queue_ms=5.0)
    assert learned.factors(T0) == free.factors(T0)


def test_a_pools_pace_is_the_median_of_its_measured_decodes() -> None:
    assert decode_pace_ms([]) is None
    assert decode_pace_ms([None, None]) is None
    assert decode_pace_ms([30.0, None, 10.0, 20.0]) == 20.0
    now = 1000.0
    d = Decoding(tpot_target_ms=100, max_tokens=10, predicted_tpot_ms=5, first_at=now)
    d.advance(2, now + 0.04)
    assert d.measured_pace_ms() is None and d.pace_ms() == 5  # one gap: the prediction
    d.advance(3, now + 0.10)
    assert d.measured_pace_ms() == pytest.approx(50)


def test_its_pace_follows_each_new_chunk() -> None:
    d = Decoding(tpot_target_ms=50, max_tokens=100, predicted_tpot_ms=20, first_at=0.0)
    for i in range(2, 5):  # three chunks 10 ms apart
        d.advance(i, 0.01 * (i - 1))
    assert d.pace_ms() == pytest.approx(10.0)
    for i in range(5, 9):  # four more, 30 ms apart: the median moves with them
        d.advance(i, 0.03 + 0.03 * (i - 4))
    assert d.pace_ms() == pytest.approx(30.0)
