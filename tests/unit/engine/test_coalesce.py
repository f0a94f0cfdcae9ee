from serve_app.engine.coalesce import MIN_BUDGET, TARGET_LAG_MS, MessageBudget


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
    assert budget.gap_s(64) == 0.064
