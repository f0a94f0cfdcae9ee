"""Runs a workload against a target, bounded in requests and time, and summarises the samples."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from tqdm import tqdm

from serve_app.bench import stages
from serve_app.bench.memory import MemoryProbe
from serve_app.bench.stats import percentiles
from serve_app.bench.targets import Sample, Target
from serve_app.bench.workload import Arrival, RequestSpec, Workload, expand

LAG_PERIOD_S = 0.01  # the client's event-loop probe: a 10 ms timer, how late it fires


class LoopLag:
    """How late the benchmark client's own event loop runs a 10 ms timer, over a run: time a
    response waits in the client before it is read counts in the TTFT the client measures, so a
    busy client shows as serving-path time unless measured."""

    def __init__(self) -> None:
        self.late_ms: list[float] = []

    async def sample_forever(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(LAG_PERIOD_S)
            self.late_ms.append(max(0.0, (time.perf_counter() - asked - LAG_PERIOD_S) * 1e3))

    def summary(self) -> dict[str, float | None]:
        return {**percentiles(self.late_ms), "max": max(self.late_ms, default=None)}


@dataclass
class RunResult:
    target: str
    workload: Workload
    samples: list[Sample]
    wall_s: float
    peak_mem_gib: float | None
    last_arrival_s: float | None = None  # open loops: when the last request was offered
    client_lag_ms: dict[str, float | None] | None = None  # LoopLag.summary() over the run

    @property
    def arrival_window_s(self) -> float:
        """The time over which requests were offered: the window of windowed arrivals, the
        last arrival of other open loops (a queue drained after it is not offered load), the
        whole run of a closed one."""
        if self.workload.arrival.kind == "closed":
            return self.wall_s
        if self.workload.arrival.window_s is not None:
            return self.workload.arrival.window_s
        last = self.last_arrival_s
        if last is None:
            last = expand(self.workload)[-1].arrival_s
        return max(last, 1e-9)


async def _closed_loop(
    target: Target, specs: list[RequestSpec], concurrency: int, deadline: float, bar: tqdm
) -> list[Sample]:
    queue = list(reversed(specs))
    samples: list[Sample] = []

    async def user() -> None:
        while queue and time.monotonic() < deadline:
            samples.append(await target.run_one(queue.pop()))
            bar.update(1)

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return samples


async def _open_loop(
    target: Target, specs: list[RequestSpec], started: float, deadline: float, bar: tqdm
) -> list[Sample]:
    samples: list[Sample] = []

    async def one(spec: RequestSpec) -> None:
        samples.append(await target.run_one(spec))
        bar.update(1)

    tasks = []
    for spec in specs:
        delay = started + spec.arrival_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.monotonic() >= deadline:
            break
        tasks.append(asyncio.create_task(one(spec)))
    remaining = max(0.0, deadline - time.monotonic())
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=remaining)
        for task in pending:  # past the time bound: stop waiting, count them as errors
            task.cancel()
    return samples


async def run_workload(
    target: Target, workload: Workload, probe: MemoryProbe, progress: bool = True
) -> RunResult:
    specs = expand(workload)
    # One untimed request first, as vLLM's client does: connection set-up and first-call costs
    # are not the serving path's steady state.
    await target.run_one(specs[0])
    sampler = asyncio.create_task(probe.sample_forever())
    lag = LoopLag()
    lag_sampler = asyncio.create_task(lag.sample_forever())
    # disable=None: a bar on a terminal only, not in a log file
    bar = tqdm(total=len(specs), desc=target.name, disable=None if progress else True, leave=False)
    started = time.monotonic()
    deadline = started + workload.duration_s
    try:
        if workload.arrival.kind == "closed":
            assert workload.arrival.concurrency is not None
            samples = await _closed_loop(target, specs, workload.arrival.concurrency, deadline, bar)
        else:
            samples = await _open_loop(target, specs, started, deadline, bar)
    finally:
        bar.close()
        sampler.cancel()
        lag_sampler.cancel()
    wall_s = time.monotonic() - started
    finished = {s.index for s in samples}
    samples += [
        Sample(s.index, s.slo_class, ok=False, error="not finished within duration_s")
        for s in specs
        if s.index not in finished
    ]
    return RunResult(
        target.name,
        workload,
        samples,
        wall_s,
        probe.peak_gib,
        specs[-1].arrival_s,
        lag.summary(),
    )


def met_slo(sample: Sample, workload: Workload) -> bool:
    if not sample.ok:
        return False
    slo = workload.slo_classes.get(sample.slo_class)
    if slo is None:
        return True
    ttft_ok = slo.ttft_ms is None or (sample.ttft_ms or 0) <= slo.ttft_ms
    tpot = sample.tpot_ms
    return ttft_ok and (slo.tpot_ms is None or tpot is None or tpot <= slo.tpot_ms)


def summarize(result: RunResult) -> dict[str, Any]:
    ok = [s for s in result.samples if s.ok]
    wall = max(result.wall_s, 1e-9)
    attainment: dict[str, float] = {}
    for cls in sorted({s.slo_class for s in result.samples}):
        in_class = [s for s in result.samples if s.slo_class == cls]
        attainment[cls] = sum(met_slo(s, result.workload) for s in in_class) / len(in_class)
    errors = [s.error for s in result.samples if not s.ok]
    return {
        "target": result.target,
        "workload": result.workload.name,
        "concurrency": result.workload.arrival.concurrency,
        "rate": result.workload.arrival.rate,
        "requests": len(result.samples),
        "errors": len(errors),
        "error_kinds": sorted({e for e in errors if e}),
        "ttft_ms": percentiles([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        "tpot_ms": percentiles([t for s in ok if (t := s.tpot_ms) is not None]),
        "itl_ms": percentiles([g for s in ok for g in s.chunk_gaps_ms]),
        "e2e_ms": percentiles([s.e2e_ms for s in ok if s.e2e_ms is not None]),
        "output_tok_s": sum(s.output_tokens for s in ok) / wall,
        "req_s": len(ok) / wall,
        # SLO-met requests per second of offered load (DistServe), not of a drain
        "goodput_req_s": sum(met_slo(s, result.workload) for s in result.samples)
        / result.arrival_window_s,
        "slo_attainment": attainment,
        "peak_mem_gib": result.peak_mem_gib,
        "wall_s": result.wall_s,
        "ttft_stages": stages.breakdown(result.samples),
        "client_loop_lag_ms": result.client_lag_ms,
    }


def conc_counts(text: str) -> dict[int, int]:
    """'64=960,256=2300' -> {64: 960, 256: 2300}."""
    pairs = (item.split("=", 1) for item in text.split(",") if item)
    return {int(conc): int(count) for conc, count in pairs}


def workloads_for(
    base: Workload,
    concurrency: str | None,
    rate: str | None,
    requests: dict[int, int] | None = None,
) -> list[Workload]:
    """The base workload per rate or per concurrency; `requests` sets a concurrency's request
    count (e.g. enough to keep 256 users busy), the base's count elsewhere."""
    if rate:
        poisson = [Arrival(kind="poisson", rate=float(r)) for r in rate.split(",")]
        return [base.with_arrival(arrival) for arrival in poisson]
    if not concurrency:
        return [base]
    counts = requests or {}
    return [
        base.with_arrival(Arrival(kind="closed", concurrency=c)).model_copy(
            update={"requests": counts.get(c, base.requests)}
        )
        for c in map(int, concurrency.split(","))
    ]


T = TypeVar("T")


def rotated(items: list[T], repeat: int) -> list[T]:
    """The order of a repeat's turn: each item goes first in turn (repeat 0: as given), so a
    machine that drifts over an invocation favours none of them."""
    shift = repeat % len(items) if items else 0
    return items[shift:] + items[:shift]


async def run_targets(
    targets: list[Target], workloads: list[Workload], repeats: int
) -> list[dict[str, Any]]:
    """Every (workload, repeat) runs each target in turn, in `rotated` order; repeats stay
    separate rows."""
    probe_rows: list[dict[str, Any]] = []
    for target in targets:
        await target.start()
    runs = 0
    try:
        for workload in workloads:
            for r in range(repeats):
                for target in rotated(targets, r):
                    probe = MemoryProbe()
                    # prompts of its own (same lengths and arrivals): a target or repeat that
                    # runs later is not served from the prefix cache an earlier one filled
                    runs += 1
                    salted = workload.model_copy(update={"content_salt": runs})
                    result = await run_workload(target, salted, probe)
                    row = summarize(result)
                    row["repeat"] = r
                    probe_rows.append(row)
                    print(
                        f"{row['target']:>28} conc={row['concurrency']} rate={row['rate']} "
                        f"tok/s={row['output_tok_s']:,.0f} TTFT p50={row['ttft_ms']['p50']} "
                        f"errors={row['errors']}",
                        flush=True,
                    )
    finally:
        for target in targets:
            await target.stop()
    return probe_rows
