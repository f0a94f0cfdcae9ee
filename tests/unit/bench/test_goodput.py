"""The goodput bench's arithmetic: arrival-window goodput, attainment, calibration, goals."""

from serve_app.bench.goodput import (
    calibration,
    goals,
    pools_idle,
    record,
    request_rows,
    routing_state,
    stall_trace,
    summarize,
)
from serve_app.bench.runner import RunResult
from serve_app.bench.targets import Sample
from serve_app.bench.workload import Arrival, Lengths, Workload, expand
from serve_app.routing.config import SLOClass

WORKLOAD = Workload(
    name="w",
    arrival=Arrival(kind="poisson", rate=10),
    prompt_tokens=Lengths(value=8),
    output_tokens=Lengths(value=5),
    slo_mix={"interactive": 1, "standard": 1},
    slo_classes={"interactive": SLOClass(ttft_ms=100), "standard": SLOClass(ttft_ms=1000)},
    requests=40,
    duration_s=30,
)


def sample(i: int, cls: str, ttft: float | None, status: int = 200, pool: str = "a") -> Sample:
    ok = status == 200 and ttft is not None
    return Sample(
        i,
        cls,
        ok=ok,
        ttft_ms=ttft,
        e2e_ms=(ttft or 0) + 40,
        output_tokens=5,
        status=status,
        pool=pool if ok else None,
        predicted_ttft_ms=50.0 if ok else None,
    )


def result(samples: list[Sample], wall_s: float = 100.0) -> RunResult:
    return RunResult("app@slo", WORKLOAD, samples, wall_s=wall_s, peak_mem_gib=None)


def test_goodput_counts_met_requests_per_second_of_arrivals_not_of_the_drain() -> None:
    specs = expand(WORKLOAD)
    samples = [
        sample(s.index, s.slo_class, 50.0 if s.index % 4 else None, 200 if s.index % 4 else 429)
        for s in specs
    ]
    row = record(result(samples, wall_s=100.0), "slo", 1.0, 0, "test machine")
    window = specs[-1].arrival_s
    met = sum(1 for s in specs if s.index % 4)
    assert row["goodput_req_s"] == met / window  # a long drain (wall 100 s) changes nothing
    assert row["refused"] == 10 and row["offered"] == 40
    assert row["attainment_offered"] == met / 40
    assert row["attainment_admitted"] == 1.0  # every admitted request met its SLO
    for key in ("policy", "rate", "repeat", "ttft_ms", "tpot_ms", "machine"):
        assert key in row
    assert row["machine"] == "test machine" and row["rate"] == 10


def test_goodput_of_windowed_arrivals_is_per_second_of_the_whole_window() -> None:
    windowed = WORKLOAD.with_arrival(Arrival(kind="poisson", rate=4, window_s=10))
    specs = expand(windowed)
    samples = [sample(s.index, s.slo_class, 50.0) for s in specs]
    run = RunResult("app@slo", windowed, samples, 100.0, None, specs[-1].arrival_s)
    row = record(run, "slo", 1.0, 0, "m")
    assert specs[-1].arrival_s < 10
    assert row["window_s"] == 10 and row["goodput_req_s"] == 40 / 10


def test_request_rows_give_each_request_its_arrival_and_what_it_got() -> None:
    specs = expand(WORKLOAD)
    samples = [
        sample(s.index, s.slo_class, 50.0 if s.index else None, 200 if s.index else 429)
        for s in reversed(specs)
    ]
    samples[0].chunk_gaps_ms = [3.0, 9.0, 4.0]
    rows = request_rows(result(samples), "slo", 1.0, 2)
    assert [r["index"] for r in rows] == [s.index for s in specs]  # in arrival order
    assert [r["arrival_s"] for r in rows] == [s.arrival_s for s in specs]
    refused, last = rows[0], rows[-1]
    assert refused["status"] == 429 and not refused["met_slo"] and refused["pool"] is None
    assert last["max_gap_ms"] == 9.0 and last["repeat"] == 2 and last["policy"] == "slo"
    assert last["met_slo"] and last["ttft_ms"] == 50.0


def test_the_stall_trace_counts_prefills_of_the_same_class_on_the_same_pool() -> None:
    def row(index: int, cls: str, arrival: float, ttft: float, e2e: float, met: bool,
            pool: str = "thr") -> dict[str, object]:  # fmt: skip
        return {"policy": "slo", "multiple": 1.0, "repeat": 0, "index": index, "slo_class": cls,
                "arrival_s": arrival, "ttft_ms": ttft, "e2e_ms": e2e, "met_slo": met,
                "pool": pool}  # fmt: skip

    rows = [
        row(0, "doc", 0.0, 100, 5000, False),  # decodes 0.1-5.0 s: docs 1, 2 and 3 start in it
        row(1, "doc", 0.5, 500, 1500, True),  # 1.0-1.5 s: none
        row(2, "doc", 1.0, 1000, 1400, True),  # first token at 2.0 s
        row(3, "doc", 2.5, 500, 900, True),  # first token at 3.0 s
        row(4, "doc", 0.2, 1000, 2000, True, pool="other"),  # another pool: counted apart
        row(5, "chat", 0.2, 100, 4000, True),  # another class: not a doc's stall
        {**row(6, "doc", 0.3, 0, 0, False), "ttft_ms": None, "e2e_ms": None},  # refused
    ]
    text = stall_trace(rows)
    assert "| slo | 1 | 0 | doc | 4/4 | 0/0 | 0/0 | 0/1 |" in text  # docs 1-4: none
    assert "| slo | 1 | 0 | chat | 1/1 | 0/0 | 0/0 | 0/0 |" in text


def test_attainment_per_class_uses_each_class_target() -> None:
    samples = [sample(0, "interactive", 150.0), sample(1, "standard", 150.0)]
    row = record(result(samples), "slo", 1.0, 0, "m")
    assert row["by_class"]["interactive"]["attainment_offered"] == 0.0
    assert row["by_class"]["standard"]["attainment_offered"] == 1.0


def test_refusals_are_counted_per_class_by_the_reason_the_app_gave() -> None:
    samples = [sample(i, "standard", None, status=429) for i in range(3)]
    samples[0].error = "HTTP 429 protects-running"
    samples[1].error = "HTTP 429 saturated"
    samples[2].error = "HTTP 429 protects-running"
    samples.append(sample(3, "interactive", None, status=503))
    row = record(result(samples), "slo", 1.0, 0, "m")
    assert row["by_class"]["standard"]["refused_by"] == {
        "429 protects-running": 2,
        "429 saturated": 1,
    }
    assert row["by_class"]["interactive"]["refused_by"] == {"503": 1}


def test_calibration_compares_predicted_and_observed_ttft_per_pool() -> None:
    samples = [sample(i, "interactive", 50.0 + 10 * i, pool="a") for i in range(10)]
    samples.append(sample(10, "interactive", 25.0, pool="b"))
    cal = calibration(samples)
    assert cal["a"]["n"] == 10
    assert cal["a"]["median_abs_error_ms"] == 45.0  # |obs - 50| over 0, 10, ..., 90
    assert cal["b"]["median_observed_over_predicted"] == 0.5
    samples.append(sample(11, "standard", 100.0, pool="b"))
    by_class = calibration(samples, by_class=True)
    assert sorted(by_class) == ["a/interactive", "b/interactive", "b/standard"]
    assert by_class["b/standard"]["median_observed_over_predicted"] == 2.0


def row(policy: str, multiple: float, goodput: float, admitted: float = 1.0) -> dict[str, object]:
    return {
        "policy": policy,
        "multiple": multiple,
        "rate": 10 * multiple,
        "repeat": 0,
        "goodput_req_s": goodput,
        "refused": 0,
        "ttft_ms": {"p50": 1.0, "p99": 2.0},
        "calibration": {},
        "by_class": {
            "interactive": {"attainment_offered": admitted, "attainment_admitted": admitted}
        },
    }


def test_goals_are_checked_against_every_repeat() -> None:
    records = [
        row("slo", 1.0, 10.0),
        row("slo", 2.0, 9.5),
        row("slo", 2.0, 8.0),  # a repeat at 2x below 90 % of the peak: missed
        row("round-robin", 1.0, 9.0),
        row("round-robin", 2.0, 4.0),
    ]
    text = goals(records)  # type: ignore[arg-type]
    assert "at 2× capacity, SLO goodput ≥ 90 % of its peak (10.00): min over runs 8.00" in text
    assert "= 80% → missed" in text
    assert "min ratio 2.00 → met" in text  # 8.0 / 4.0 ≥ 1.5
    assert "min ratio 1.11 → met" in text  # 10 / 9 at the knee
    report = summarize(records)  # type: ignore[arg-type]
    assert "| slo | 2 | 20.00 | 2 | 8.75 (8.00–9.50) |" in report


def test_goals_name_the_slo_policy_by_its_placement() -> None:
    """A sweep of `slo:best-fit` against the baselines is checked like one of `slo`; SLO
    variants side by side are each checked against the baselines, not against each other."""
    records = [
        row("slo:best-fit", 1.0, 10.0),
        row("slo:best-fit", 2.0, 9.5),
        row("round-robin", 1.0, 9.0),
        row("round-robin", 2.0, 4.0),
    ]
    text = goals(records)  # type: ignore[arg-type]
    assert text.startswith("Goals for slo:best-fit")
    assert "min ratio 2.38 → met" in text  # 9.5 / 4.0 at 2x
    assert "min ratio 1.11 → met" in text  # against round-robin, not against itself
    both = [
        *records,
        row("slo:headroom:decoding", 1.0, 12.0),
        row("slo:headroom:decoding", 2.0, 5.0),
    ]
    text = goals(both)  # type: ignore[arg-type]
    first, second = text.split("Goals for ")[1:]
    assert first.startswith("slo:best-fit") and "min ratio 1.11 → met" in first
    assert second.startswith("slo:headroom:decoding")
    assert "min ratio 1.33 → met" in second  # 12 / 9 at the knee: not against best fit's 10
    assert "min ratio 1.25 → missed" in second  # 5 / 4 at 2x


def test_records_say_where_each_pool_s_first_tokens_went() -> None:
    timed = [sample(i, "interactive", 60.0, pool=("a", "b")[i % 2]) for i in range(4)]
    for s in timed:
        s.stages = {"queue": 20.0, "prefill": 30.0, "ttft": 55.0}
    row = record(result([*timed, sample(9, "standard", None, 429)]), "slo", 2.0, 0, "m")
    assert set(row["ttft_stages"]) == {"a", "b"}
    assert row["ttft_stages"]["a"]["stages"]["queue"]["share"] == 20.0 / 60.0
    assert "slo @ a | 2×" in summarize([row])


def test_the_report_gives_the_client_s_worst_loop_lag_per_rate() -> None:
    rows = []
    for repeat, (p99, most) in enumerate([(5.0, 20.0), (300.0, 1500.0)]):
        run = result([sample(0, "interactive", 60.0)])
        run.client_lag_ms = {"p50": 0.5, "p90": 1.0, "p99": p99, "max": most}
        rows.append(record(run, "slo", 2.0, repeat, "m"))
    assert rows[1]["client_loop_lag_ms"]["max"] == 1500.0
    assert "p99 / max ms (worst run per rate): 2×: 300 / 1500." in summarize(rows)


def test_a_report_of_one_file_keeps_its_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from serve_app.bench import goodput

    row = record(result([sample(0, "interactive", 60.0)]), "slo", 1.0, 0, "m")
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"probe": {"capacity_req_s": 2.5}, "records": [row]}))
    workload = tmp_path / "w.yaml"
    workload.write_text(WORKLOAD.model_dump_json())
    argv = ["--workload", str(workload), "--report", str(src), "--machine", "m"]
    goodput.main([*argv, "--out", str(tmp_path / "out"), "--name", "x"])
    assert json.loads((tmp_path / "out" / "x.json").read_text())["probe"] == {"capacity_req_s": 2.5}


def test_every_run_of_a_sweep_gets_prompts_of_its_own(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Policies, rates and repeats replay one workload; with prefix caching on, a run after
    another would be served from the cache the earlier one filled."""
    import argparse
    import asyncio

    from serve_app.bench import goodput

    salts: list[int] = []

    async def run(target, workload, probe, progress=True):  # type: ignore[no-untyped-def]
        salts.append(workload.content_salt)
        return result([sample(0, "interactive", 60.0)])

    async def idle(
        url: str, timeout_s: float = 120
    ) -> tuple[bool, float, dict[str, dict[str, int]]]:
        # the second run starts on a busy fleet
        return len(salts) != 1, 0.5 * len(salts), {"a": {"path_ms": len(salts)}}

    class Target:
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            pass

        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

    monkeypatch.setattr(goodput, "run_workload", run)
    monkeypatch.setattr(goodput, "_idle", idle)

    async def state(url: str) -> dict[str, dict[str, int]]:
        return {"a": {"path_ms": -len(salts)}}

    monkeypatch.setattr(goodput, "_routing_state", state)
    monkeypatch.setattr(goodput, "HTTPTarget", Target)
    args = argparse.Namespace(
        capacity=2.0, machine="m", multiples="1,2", repeats_at="2", repeats=1, extra_repeats=1,
        policies="slo,round-robin", out=None, name="x", url="http://127.0.0.1:1",
        window_s=1.0, drain_s=1.0,
    )  # fmt: skip
    _, records = asyncio.run(goodput.sweep(args, WORKLOAD))
    assert len(salts) == 6 and len(set(salts)) == 6  # (1 + 2 repeats) x 2 policies
    # each record says whether its run started on an idle fleet, and how long that took
    assert [r["started_idle"] for r in records] == [True, False, True, True, True, True]
    assert [r["settle_s"] for r in records] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert [r["pools_at_start"]["a"]["path_ms"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["pools_at_end"]["a"]["path_ms"] for r in records] == [-1, -2, -3, -4, -5, -6]


def test_pools_are_idle_only_when_no_ingress_waits_for_a_request_there() -> None:
    idle = {
        "waiting": 0,
        "running": 0,
        "decode_slack_ms": None,
        "queued_slack_ms": None,
        "protected_by_other_ingresses": {},
    }
    assert pools_idle({"a": idle, "b": idle})
    assert not pools_idle({"a": idle, "b": {**idle, "waiting": 1}})
    # the engines are idle, but an ingress still waits for requests it dispatched there
    assert not pools_idle({"a": {**idle, "queued_slack_ms": 3.2}})
    others = {"i2": {"queued": 91, "decode_slack_ms": None, "decode_pace_ms": None}}
    assert not pools_idle({"a": {**idle, "protected_by_other_ingresses": others}})
    others["i2"]["queued"] = 0
    assert pools_idle({"a": {**idle, "protected_by_other_ingresses": others}})


def test_a_run_keeps_the_routing_state_it_started_with() -> None:
    others = {"i2": {"queued": 91, "decode_slack_ms": None, "decode_pace_ms": None}}
    pools = {
        "throughput": {
            "waiting": 0,
            "running": 0,
            "path_ms": 3175.9,
            "ttft_factor": 1.1,
            "wait_factor": 0.7,
            "tpot_factor": 0.5,
            "decode_slack_ms": None,
            "queued_slack_ms": 3.2,
            "protected_by_other_ingresses": others,
            "placement": [{"replica": "r1"}],
        }
    }
    state = routing_state(pools)["throughput"]
    assert state["path_ms"] == 3175.9 and state["queued_slack_ms"] == 3.2
    assert state["others_queued"] == 91 and "placement" not in state
