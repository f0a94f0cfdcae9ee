"""A run's TTFT breakdown from the app's per-request stages."""

import pytest

from serve_app.bench.stages import breakdown, table
from serve_app.bench.targets import Sample


def sample(client_ttft: float, stages: dict[str, float] | None, ok: bool = True) -> Sample:
    return Sample(0, "interactive", ok=ok, ttft_ms=client_ttft, stages=stages)


def test_shares_of_the_client_ttft_add_up_with_what_lies_outside() -> None:
    samples = [
        # proxy 1 + ingress TTFT 10 + emit 1 of a 14 ms client TTFT: 2 ms outside
        sample(14.0, {"proxy": 1.0, "ingress": 2.0, "queue": 3.0, "prefill": 5.0, "ttft": 10.0,
                      "emit": 1.0}),
        sample(26.0, {"proxy": 1.0, "ingress": 2.0, "queue": 15.0, "prefill": 5.0, "ttft": 22.0,
                      "emit": 1.0}),
        sample(99.0, None),  # not timed (another server): left out
        sample(50.0, {"ttft": 1.0}, ok=False),  # failed: left out
    ]  # fmt: skip
    b = breakdown(samples)
    assert b is not None and b["n"] == 2 and b["client_ttft_ms_mean"] == 20.0
    stages = b["stages"]
    assert list(stages) == ["proxy", "ingress", "queue", "prefill", "emit", "outside"]
    assert stages["queue"]["mean"] == 9.0 and stages["queue"]["share"] == pytest.approx(0.45)
    assert stages["outside"]["mean"] == 2.0
    assert sum(s["share"] for s in stages.values()) == pytest.approx(1.0)
    assert "| app | 4 | – | 2 | 20.0 |" in table([{"target": "app", "concurrency": 4,
                                                   "ttft_stages": b}])  # fmt: skip
    assert "| app | 4 | 2 | 2 | 20.0 |" in table([{"target": "app", "concurrency": 4,
                                                   "repeat": 2, "ttft_stages": b}])  # fmt: skip


def test_a_stage_some_requests_skipped_counts_zero_for_them() -> None:
    b = breakdown([sample(10.0, {"proxy": 2.0, "ttft": 8.0}), sample(10.0, {"ttft": 10.0})])
    assert b is not None and b["stages"]["proxy"]["mean"] == 1.0


def test_no_timed_samples_no_breakdown() -> None:
    assert breakdown([sample(10.0, None)]) is None
    assert table([{"target": "vllm", "concurrency": 1, "ttft_stages": None}]) == ""
