import asyncio
import time

from serve_app.bench.memory import MemoryProbe
from serve_app.bench.report import markdown_table, ratio_table
from serve_app.bench.runner import (
    conc_counts,
    rotated,
    run_targets,
    run_workload,
    summarize,
    workloads_for,
)
from serve_app.bench.targets import Sample
from serve_app.bench.workload import Arrival, Lengths, RequestSpec, Workload
from serve_app.routing.config import SLOClass

WORKLOAD = Workload(
    name="w",
    arrival=Arrival(kind="closed", concurrency=3),
    prompt_tokens=Lengths(value=8),
    output_tokens=Lengths(value=5),
    slo_mix={"fast": 1, "slow": 1},
    slo_classes={"fast": SLOClass(ttft_ms=15), "slow": SLOClass()},
    requests=20,
    duration_s=30,
)


class FakeTarget:
    """Answers after a delay that depends on the request (scripted, for the runner's logic)."""

    name = "fake"

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def run_one(self, spec: RequestSpec) -> Sample:
        await asyncio.sleep(0.001)
        if spec.index == 7:
            return Sample(spec.index, spec.slo_class, ok=False, error="HTTP 500")
        ttft = 10.0 if spec.index % 2 else 20.0
        return Sample(
            spec.index,
            spec.slo_class,
            ok=True,
            ttft_ms=ttft,
            e2e_ms=ttft + 4 * 2.0,
            output_tokens=spec.max_tokens,
            chunk_gaps_ms=[2.0] * 4,
        )


def test_summary_figures() -> None:
    result = asyncio.run(run_workload(FakeTarget(), WORKLOAD, MemoryProbe(), progress=False))
    row = summarize(result)
    assert row["requests"] == 20 and row["errors"] == 1
    assert row["error_kinds"] == ["HTTP 500"]
    assert row["ttft_ms"]["p50"] in (10.0, 20.0)
    assert row["tpot_ms"]["p50"] == 2.0
    assert row["itl_ms"]["p99"] == 2.0
    assert row["output_tok_s"] > 0
    # "fast" requests meet their 15 ms TTFT only when odd; "slow" has no target (all met but 7)
    fast = [s for s in result.samples if s.slo_class == "fast"]
    expected_fast = sum(1 for s in fast if s.ok and s.ttft_ms == 10.0) / len(fast)
    assert row["slo_attainment"]["fast"] == expected_fast
    met = sum(1 for s in result.samples if s.ok and (s.slo_class == "slow" or s.ttft_ms == 10.0))
    assert abs(row["goodput_req_s"] - met / result.wall_s) < 1e-6


def test_ratio_table_compares_at_equal_concurrency() -> None:
    base = {"target": "engine", "concurrency": 1, "rate": None, "output_tok_s": 100.0}
    base |= {"ttft_ms": {"p50": 10.0, "p99": 20.0}}
    app = {**base, "target": "app", "output_tok_s": 97.0, "ttft_ms": {"p50": 12.5, "p99": 30.0}}
    table = ratio_table([base, app], "engine")
    assert "| app | 1 | None | 0.970 | +2.5 | +10.0 |" in table
    assert "engine" in markdown_table([base | {"requests": 1, "errors": 0}])


class BlockingTarget(FakeTarget):
    """Holds the client's event loop (synchronous work) for 60 ms in each request."""

    async def run_one(self, spec: RequestSpec) -> Sample:
        time.sleep(0.06)  # noqa: ASYNC251 - blocking on purpose
        return await super().run_one(spec)


def test_the_client_loop_lag_is_measured() -> None:
    idle = asyncio.run(run_workload(FakeTarget(), WORKLOAD, MemoryProbe(), progress=False))
    busy = asyncio.run(run_workload(BlockingTarget(), WORKLOAD, MemoryProbe(), progress=False))
    assert idle.client_lag_ms is not None and busy.client_lag_ms is not None
    assert busy.client_lag_ms["max"] is not None and busy.client_lag_ms["max"] >= 40
    assert summarize(busy)["client_loop_lag_ms"] == busy.client_lag_ms
    assert (idle.client_lag_ms["p50"] or 0) < 40


def test_requests_per_concurrency_size_each_closed_loop() -> None:
    runs = workloads_for(WORKLOAD, "1,16,256", None, conc_counts("256=2560,16=480"))
    assert [(w.arrival.concurrency, w.requests) for w in runs] == [(1, 20), (16, 480), (256, 2560)]
    assert [w.requests for w in workloads_for(WORKLOAD, "4", None)] == [20]


class NamedTarget(FakeTarget):
    def __init__(self, name: str) -> None:
        self.name = name


def test_each_repeat_starts_with_the_next_target() -> None:
    targets = [NamedTarget("a"), NamedTarget("b"), NamedTarget("c")]
    short = WORKLOAD.model_copy(update={"requests": 3})
    rows = asyncio.run(run_targets(targets, [short], 4))
    order = [(r["repeat"], r["target"]) for r in rows]
    assert order == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "b"), (1, "c"), (1, "a"),
        (2, "c"), (2, "a"), (2, "b"),
        (3, "a"), (3, "b"), (3, "c"),
    ]  # fmt: skip


def test_rotation_of_no_items_is_empty() -> None:
    assert rotated([], 3) == [] and rotated([1, 2], 3) == [2, 1]
