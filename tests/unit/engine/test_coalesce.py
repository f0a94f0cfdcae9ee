from serve_app.engine.coalesce import MAX_GAP_S, MIN_BUDGET, TARGET_LAG_MS, MessageBudget


def test_budget_shrinks_when_consumers_lag_and_recovers() -> None:
    budget = MessageBudget(2000)
    assert budget.update(None) == 2000  # no report: unchanged
    for _ in range(50):
        budget.update(TARGET_LAG_MS * 3)
    assert budget.current == MIN_BUDGET  # floored
    for _ in range(5):
        budget.update(1.0)
    assert MIN_BUDGET < budget.current < 2000
    for _ in range(10):
        budget.update(1.0)
    assert budget.current == 2000  # never above the profile's ceiling


def test_gap_is_each_streams_share_of_the_budget() -> None:
    budget = MessageBudget(1000)
    assert budget.gap_s(1) == 0.001
    assert budget.gap_s(32) == 0.032


def test_a_stream_is_never_held_longer_than_the_cap() -> None:
    """At the floor, 200 streams each waited 200 / 50 = 4 s between messages: a whole completion
    held back after its first token, its TPOT missed for it (the H200 goodput runs)."""
    budget = MessageBudget(16000)
    for _ in range(50):
        budget.update(TARGET_LAG_MS * 3)
    assert budget.current == MIN_BUDGET
    assert budget.gap_s(200) == MAX_GAP_S
    assert budget.gap_s(1) == 1 / MIN_BUDGET  # under the cap: each stream's share
