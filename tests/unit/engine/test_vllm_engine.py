"""The engine's stages from vLLM's per-request timestamps (RequestOutput.metrics)."""

from types import SimpleNamespace

import pytest

from serve_app.engine.vllm_engine import engine_stages
from serve_app.timing import Stage


def test_stages_come_from_vllm_timestamps_bracketed_by_the_replica() -> None:
    metrics = SimpleNamespace(queued_ts=10.002, scheduled_ts=10.010, first_token_ts=10.030)
    stages = engine_stages(SimpleNamespace(metrics=metrics), started=10.0, now=10.031)
    assert stages == {
        Stage.ENGINE_IN: pytest.approx(2.0),
        Stage.QUEUE: pytest.approx(8.0),
        Stage.PREFILL: pytest.approx(20.0),
        Stage.ENGINE_OUT: pytest.approx(1.0),
    }


@pytest.mark.parametrize(
    "metrics",
    [
        None,  # stats not logged
        SimpleNamespace(queued_ts=1.0, scheduled_ts=0.0, first_token_ts=0.0),  # not scheduled
        SimpleNamespace(),  # a vLLM without these fields
    ],
)
def test_no_stages_without_timestamps(metrics: object) -> None:
    assert engine_stages(SimpleNamespace(metrics=metrics), 0.0, 1.0) is None
