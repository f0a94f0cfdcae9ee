"""Goodput under SLOs: routing policies side by side on one running app, at rising offered rates.

    python -m serve_app.bench.goodput --url http://127.0.0.1:8000 \\
        --workload workloads/slo-mix.yaml --multiples 0.5,1,1.5,2 --repeats-at 1,2 \\
        --machine "..." --out docs/results/goodput --name cpu

Goodput as DistServe defines it: requests that met every SLO of their class, per second of the
*arrival window* (Poisson arrivals for `--window-s`; the drain after it is not offered load). A
refusal (429/503) is a miss. Per (policy, rate, repeat) one record with attainment over all
offered requests and over the admitted ones, per class, and the router's calibration per pool
(its predicted TTFT, sent back in `x-route-predicted-ttft-ms`, against the TTFT the client saw).
Policies run in turn at each rate (same replicas, `x-route-policy`; the app must set
`routing.allow_policy_header`), and the app is left to drain between runs.

The fleet's capacity (`--capacity`, req/s) is the closed-loop throughput of the workload under
round-robin (`--probe-concurrency` users for `--probe-s`) unless given.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp

from serve_app.bench import stages
from serve_app.bench.memory import MemoryProbe
from serve_app.bench.report import save_figure
from serve_app.bench.runner import RunResult, met_slo, run_workload
from serve_app.bench.stats import percentiles
from serve_app.bench.targets import HTTPTarget, Sample
from serve_app.bench.workload import Arrival, Workload, expand, load_workload

REFUSED = (429, 503)
ATTAINMENT_GOAL = 0.9  # DistServe's goodput rate: the highest rate at which this share meets
KEY_CLASS = "interactive"


def calibration(samples: list[Sample], by_class: bool = False) -> dict[str, dict[str, float | int]]:
    """Per pool (`by_class`: per pool and SLO class, `pool/class`): median |observed -
    predicted| TTFT and the p90 of observed / predicted. Per class, since one pool serves
    requests of different shapes (documents, short chats) that a model may predict unevenly."""
    by_pool: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in samples:
        if s.ok and s.pool and s.ttft_ms is not None and s.predicted_ttft_ms:
            key = f"{s.pool}/{s.slo_class}" if by_class else s.pool
            by_pool[key].append((s.ttft_ms, s.predicted_ttft_ms))
    out: dict[str, dict[str, float | int]] = {}
    for pool, pairs in sorted(by_pool.items()):
        ratios = [obs / pred for obs, pred in pairs]
        out[pool] = {
            "n": len(pairs),
            "median_abs_error_ms": statistics.median(abs(obs - pred) for obs, pred in pairs),
            "p90_observed_over_predicted": percentiles(ratios)["p90"] or 0.0,
            "median_observed_over_predicted": statistics.median(ratios),
        }
    return out


def _refusal(sample: Sample) -> str:
    """A refusal's status and, where the app named it, its reason: `429 protects-running`."""
    return (sample.error or "").removeprefix("HTTP ") or str(sample.status)


def record(
    result: RunResult, policy: str, multiple: float, repeat: int, machine: str
) -> dict[str, Any]:
    samples, workload = result.samples, result.workload
    window = result.arrival_window_s
    refused = [s for s in samples if s.status in REFUSED]
    admitted = [s for s in samples if s.status not in REFUSED]
    ok = [s for s in samples if s.ok]

    def share(group: list[Sample]) -> float | None:
        return sum(met_slo(s, workload) for s in group) / len(group) if group else None

    classes = sorted({s.slo_class for s in samples})
    by_class = {c: [s for s in samples if s.slo_class == c] for c in classes}
    return {
        "policy": policy,
        "rate": workload.arrival.rate,
        "multiple": multiple,
        "repeat": repeat,
        "machine": machine,
        "content_salt": workload.content_salt,  # prompts of this run's own (workload.py)
        "window_s": window,
        "wall_s": result.wall_s,
        "offered": len(samples),
        "served": len(ok),
        "refused": len(refused),
        "failed": len(admitted) - len(ok),
        "goodput_req_s": sum(met_slo(s, workload) for s in samples) / window,
        "attainment_offered": share(samples),
        "attainment_admitted": share(admitted),
        "by_class": {
            c: {
                "offered": len(group),
                "refused": sum(s.status in REFUSED for s in group),
                "refused_by": dict(
                    sorted(_count(_refusal(s) for s in group if s.status in REFUSED).items())
                ),
                "attainment_offered": share(group),
                "attainment_admitted": share([s for s in group if s.status not in REFUSED]),
                "ttft_ms": percentiles([s.ttft_ms for s in group if s.ok and s.ttft_ms]),
                "tpot_ms": percentiles([t for s in group if s.ok and (t := s.tpot_ms)]),
            }
            for c, group in by_class.items()
        },
        "pools": dict(sorted(_count(s.pool or "none" for s in ok).items())),
        "ttft_ms": percentiles([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        "tpot_ms": percentiles([t for s in ok if (t := s.tpot_ms) is not None]),
        "calibration": calibration(samples),
        "calibration_by_class": calibration(samples, by_class=True),
        # per pool: where the first token's time went (the app's Server-Timing stages)
        "ttft_stages": {
            pool: b
            for pool in sorted({s.pool for s in ok if s.pool})
            if (b := stages.breakdown(s for s in ok if s.pool == pool)) is not None
        },
        "slo_classes": {c: v.model_dump() for c, v in workload.slo_classes.items()},
        # how late the client's own loop ran: part of `outside` in ttft_stages when large
        "client_loop_lag_ms": result.client_lag_ms,
    }


def request_rows(
    result: RunResult, policy: str, multiple: float, repeat: int
) -> list[dict[str, Any]]:
    """One row per request of a run (`--samples`): what each request was offered and what it
    got, to trace where a class's misses come from."""
    arrivals = {spec.index: spec.arrival_s for spec in expand(result.workload)}
    return [
        {
            "policy": policy,
            "multiple": multiple,
            "repeat": repeat,
            "index": s.index,
            "slo_class": s.slo_class,
            "arrival_s": arrivals.get(s.index),
            "prompt_tokens": s.prompt_tokens,
            "status": s.status,
            "error": s.error,
            "pool": s.pool,
            "route_reason": s.route_reason,
            "met_slo": met_slo(s, result.workload),
            "predicted_ttft_ms": s.predicted_ttft_ms,
            "predicted_tpot_ms": s.predicted_tpot_ms,
            "ttft_ms": s.ttft_ms,
            "tpot_ms": s.tpot_ms,
            "e2e_ms": s.e2e_ms,
            "output_tokens": s.output_tokens,
            "max_gap_ms": max(s.chunk_gaps_ms, default=None),
            "stages": s.stages,
        }
        for s in sorted(result.samples, key=lambda s: s.index)
    ]


STALL_BUCKETS = 3  # 0, 1, 2, 3 or more prefills of the same class during a decode


def stall_trace(rows: list[dict[str, Any]]) -> str:
    """From `--samples` rows: per run and class, how the admitted requests fared by how many
    prefills of their own class (other requests' first tokens on the same pool) fell within
    their decode, between their first token and their last. The prefills that stall a decode
    are the ones admitted around it; this says how many a request could take within its SLO."""
    runs: dict[tuple[str, float, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        runs[(r["policy"], r["multiple"], r["repeat"])].append(r)
    head = " | ".join(f"{n}{'+' if n == STALL_BUCKETS else ''}" for n in range(STALL_BUCKETS + 1))
    lines = [
        "Met / admitted, by prefills of the same class within the decode "
        "(other requests' first tokens on its pool):",
        "",
        f"| policy | × capacity | repeat | class | {head} |",
        "|---|---|---|---|" + "---|" * (STALL_BUCKETS + 1),
    ]
    for (policy, multiple, repeat), run in sorted(runs.items()):
        timed = [r for r in run if r["ttft_ms"] is not None and r["e2e_ms"] is not None]
        for cls in sorted({r["slo_class"] for r in timed}):
            own = [r for r in timed if r["slo_class"] == cls]
            first_at = {r["index"]: r["arrival_s"] + r["ttft_ms"] / 1e3 for r in own}
            met: dict[int, list[bool]] = defaultdict(list)
            for r in own:
                start, end = first_at[r["index"]], r["arrival_s"] + r["e2e_ms"] / 1e3
                n = sum(
                    1
                    for o in own
                    if o["pool"] == r["pool"]
                    and o["index"] != r["index"]
                    and start < first_at[o["index"]] < end
                )
                met[min(n, STALL_BUCKETS)].append(bool(r["met_slo"]))
            cells = " | ".join(f"{sum(met[n])}/{len(met[n])}" for n in range(STALL_BUCKETS + 1))
            lines.append(f"| {policy} | {multiple:g} | {repeat} | {cls} | {cells} |")
    return "\n".join(lines) + "\n"


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for item in items:
        out[item] += 1
    return out


def pools_idle(pools: dict[str, Any]) -> bool:
    """No pool has requests waiting or running in its engines, and no ingress has any
    dispatched there that it still waits for (the one answering counts its own in `waiting`
    and protects them, the others post theirs): all `GET /pools` says."""
    return all(
        p["waiting"] + p["running"] == 0
        and p["decode_slack_ms"] is None
        and p["queued_slack_ms"] is None
        and not any(o["queued"] for o in p["protected_by_other_ingresses"].values())
        for p in pools.values()
    )


# What a run's record keeps of each pool's state as routing saw it when the run started
START_STATE = (
    "waiting",
    "running",
    "path_ms",
    "ttft_factor",
    "wait_factor",
    "tpot_factor",
    "decode_slack_ms",
    "queued_slack_ms",
)


def routing_state(pools: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each pool's state as one ingress's routing saw it (`GET /pools`), in short: its queues,
    what it learned (path delay and factors relax back after a run, and the next run starts
    with what is left), what it protects, and how many requests the other ingresses post as
    queued there."""
    return {
        name: {key: p.get(key) for key in START_STATE}
        | {"others_queued": sum(o["queued"] for o in p["protected_by_other_ingresses"].values())}
        for name, p in pools.items()
    }


async def _pools(session: aiohttp.ClientSession) -> dict[str, Any]:
    """`GET /pools` of the ingress that answers now."""
    async with session.get("/pools") as r:
        pools: dict[str, Any] = await r.json()
        return pools


async def _routing_state(url: str) -> dict[str, dict[str, Any]]:
    """`routing_state` of the ingress that answers `GET /pools` now."""
    async with aiohttp.ClientSession(url) as session:
        return routing_state(await _pools(session))


async def _idle(url: str, timeout_s: float = 120) -> tuple[bool, float, dict[str, dict[str, Any]]]:
    """Wait until the pools are idle (`pools_idle`: the previous run has drained); whether
    they were, how long it took, and the pools' routing state then. A run that starts on a
    busy fleet says so in its record (`started_idle`): the requests an earlier run left behind
    share its engines, and the ingresses' admission protects the ones still waiting."""
    start = time.monotonic()
    async with aiohttp.ClientSession(url) as session:
        while True:
            pools = await _pools(session)
            waited = time.monotonic() - start
            if pools_idle(pools):
                return True, waited, routing_state(pools)
            if waited >= timeout_s:
                return False, waited, routing_state(pools)
            await asyncio.sleep(0.5)


async def probe_capacity(
    url: str, workload: Workload, concurrency: int, seconds: float, machine: str
) -> dict[str, Any]:
    closed = workload.model_copy(
        update={
            "arrival": Arrival(kind="closed", concurrency=concurrency),
            "requests": 100_000,
            "duration_s": seconds,
        }
    )
    target = HTTPTarget(url, "probe", send_slo_class=False, route_policy="round-robin")
    await target.start()
    try:
        result = await run_workload(target, closed, MemoryProbe(), progress=False)
    finally:
        await target.stop()
    done = [s for s in result.samples if s.ok]
    return {
        "concurrency": concurrency,
        "seconds": result.wall_s,
        "completed": len(done),
        "capacity_req_s": len(done) / result.wall_s,
        "machine": machine,
    }


def is_slo_policy(policy: str) -> bool:
    """`slo` or `slo:<placement>`: SLO routing, as against the baselines."""
    return policy.split(":")[0] == "slo"


def policy_header(policy: str) -> str:
    return policy.replace("=", ":")


async def sweep(
    args: argparse.Namespace, workload: Workload
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    probe: dict[str, Any] = {"capacity_req_s": args.capacity, "machine": args.machine}
    if args.capacity is None:
        probe = await probe_capacity(
            args.url, workload, args.probe_concurrency, args.probe_s, args.machine
        )
        print(
            f"capacity (closed loop, round-robin): {probe['capacity_req_s']:.2f} req/s", flush=True
        )
    capacity = float(probe["capacity_req_s"])
    multiples = [float(m) for m in args.multiples.split(",")]
    extra_at = {float(m) for m in args.repeats_at.split(",")} if args.repeats_at else set()
    policies = args.policies.split(",")
    records: list[dict[str, Any]] = []
    out_file = args.out / f"{args.name}.json" if args.out else None
    rows_file = args.out / f"{args.name}.samples.jsonl" if args.out and args.samples else None
    if rows_file is not None:
        rows_file.parent.mkdir(parents=True, exist_ok=True)
        rows_file.write_text("")
    runs = 0
    for multiple in multiples:
        rate = capacity * multiple
        requests = max(1, math.ceil(rate * args.window_s))
        offered = workload.model_copy(
            update={
                # exactly `requests` arrivals in the window: every repeat offers the same rate
                "arrival": Arrival(kind="poisson", rate=rate, window_s=args.window_s),
                "requests": requests,
                "duration_s": args.window_s + args.drain_s,
            }
        )
        repeats = args.repeats + (args.extra_repeats if multiple in extra_at else 0)
        for repeat in range(repeats):
            # a new arrival sequence per repeat, the same one for every policy
            seeded = offered.model_copy(update={"seed": workload.seed + repeat})
            for policy in policies:
                # the same lengths and arrivals, prompts of their own: no run is served from
                # the prefix cache an earlier run (another policy, rate or repeat) filled
                runs += 1
                salted = seeded.model_copy(update={"content_salt": runs})
                idle, settle_s, at_start = await _idle(args.url)
                target = HTTPTarget(
                    args.url,
                    f"app@{policy}",
                    send_slo_class=True,
                    route_policy=policy_header(policy),
                    slo_targets=salted.slo_classes,
                )
                await target.start()
                started_at = time.time()  # wall clock: lines the run up with the servers' logs
                try:
                    result = await run_workload(target, salted, MemoryProbe(), progress=False)
                finally:
                    await target.stop()
                at_end = await _routing_state(args.url)  # what this run leaves the next
                row = record(result, policy, multiple, repeat, args.machine)
                row |= {
                    "started_idle": idle,
                    "settle_s": round(settle_s, 1),
                    "started_at": round(started_at, 3),
                    "pools_at_start": at_start,
                    "pools_at_end": at_end,
                }
                records.append(row)
                if rows_file is not None:
                    with rows_file.open("a") as f:
                        for r in request_rows(result, policy, multiple, repeat):
                            f.write(json.dumps(r) + "\n")
                key = row["by_class"].get(KEY_CLASS, {})
                print(
                    f"{policy:>22} x{multiple:<4} rate={rate:7.2f} rep={repeat} "
                    f"goodput={row['goodput_req_s']:7.2f} refused={row['refused']:4d} "
                    f"{KEY_CLASS} offered={_fmt(key.get('attainment_offered'))} "
                    f"admitted={_fmt(key.get('attainment_admitted'))} pools={row['pools']} "
                    f"settled={settle_s:.0f}s{'' if idle else ' (still busy)'}",
                    flush=True,
                )
                if out_file is not None:  # a cut-off run keeps what it measured
                    out_file.parent.mkdir(parents=True, exist_ok=True)
                    out_file.write_text(json.dumps({"probe": probe, "records": records}, indent=1))
    return probe, records


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """Median (min–max) of the repeats; the value alone for one run."""
    if len(values) == 1:
        return fmt.format(values[0])
    mid, lo, hi = (fmt.format(v) for v in (statistics.median(values), min(values), max(values)))
    return f"{mid} ({lo}–{hi})"


def summarize(records: list[dict[str, Any]]) -> str:
    """Markdown: goodput and attainment per policy and rate (median, min–max over repeats),
    DistServe goodput rates, calibration, and the goals."""
    policies = list(dict.fromkeys(r["policy"] for r in records))
    multiples = sorted({r["multiple"] for r in records})
    cell: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        cell[(r["policy"], r["multiple"])].append(r)
    lines = [
        "| policy | × capacity | rate req/s | runs | goodput req/s | refused | "
        f"{KEY_CLASS} attainment, offered | {KEY_CLASS} attainment, admitted | "
        "TTFT p50 / p99 ms (median of runs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for multiple in multiples:
        for policy in policies:
            rows = cell.get((policy, multiple), [])
            if not rows:
                continue
            key = [r["by_class"].get(KEY_CLASS, {}) for r in rows]
            offered = [
                k["attainment_offered"] for k in key if k.get("attainment_offered") is not None
            ]
            admitted = [
                k["attainment_admitted"] for k in key if k.get("attainment_admitted") is not None
            ]
            lines.append(
                f"| {policy} | {multiple:g} | {rows[0]['rate']:.2f} | {len(rows)} | "
                f"{_spread([r['goodput_req_s'] for r in rows])} | "
                f"{_spread([float(r['refused']) for r in rows], '{:.0f}')} | "
                f"{_spread(offered) if offered else '–'} | "
                f"{_spread(admitted) if admitted else '–'} | "
                f"{_median_ms(rows, 'p50')} / {_median_ms(rows, 'p99')} |"
            )
    lines += [
        "",
        "DistServe goodput rate (highest offered rate at which every run of the policy "
        f"had ≥ {ATTAINMENT_GOAL:.0%} of {KEY_CLASS} requests within SLO):",
        "",
    ]
    for policy in policies:
        ok = [
            m
            for m in multiples
            if cell.get((policy, m))
            and all(
                (r["by_class"].get(KEY_CLASS, {}).get("attainment_offered") or 0) >= ATTAINMENT_GOAL
                for r in cell[(policy, m)]
            )
        ]
        best = max(ok, default=None)
        rate = cell[(policy, best)][0]["rate"] if best is not None else None
        lines.append(
            f"- {policy}: "
            + (f"{rate:.2f} req/s ({best:g}× capacity)" if rate else "none of the rates")
        )
    lines += [
        "",
        "Calibration of the SLO policy (predicted vs client-observed TTFT, per pool and class):",
        "",
    ]
    lines += [
        "| policy | × capacity | repeat | pool | n | median abs error ms | median obs/pred "
        "| p90 obs/pred |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if not is_slo_policy(r["policy"]):
            continue
        # per pool and class where the record has it (records before it: per pool)
        for pool, c in r.get("calibration_by_class", r["calibration"]).items():
            lines.append(
                f"| {r['policy']} | {r['multiple']:g} | {r['repeat']} | {pool} | {c['n']} | "
                f"{c['median_abs_error_ms']:.1f} | {c['median_observed_over_predicted']:.2f} | "
                f"{c['p90_observed_over_predicted']:.2f} |"
            )
    lines += ["", _stage_shares(records), "", _client_lag(records), "", goals(records)]
    return "\n".join(lines) + "\n"


def _stage_shares(records: list[dict[str, Any]]) -> str:
    """Where the SLO policy's first tokens' time went, per rate and pool (first repeat)."""
    rows = [
        {"target": f"{r['policy']} @ {pool}", "rate": f"{r['multiple']:g}×", "ttft_stages": b}
        for r in records
        if is_slo_policy(r["policy"]) and r["repeat"] == 0
        for pool, b in r.get("ttft_stages", {}).items()
    ]
    if not rows:
        return ""
    return (
        "Where the SLO policy's first tokens' time went (mean ms per stage, share of client "
        "TTFT; first repeat):\n\n" + stages.table(rows)
    )


def _client_lag(records: list[dict[str, Any]]) -> str:
    """How late the benchmark client's own event loop ran, worst run per rate: a client
    that waits for a core adds that wait to the TTFT it measures (`outside` above)."""
    worst: dict[float, tuple[float, float]] = {}
    for r in records:
        lag = r.get("client_loop_lag_ms") or {}
        if lag.get("p99") is None or lag.get("max") is None:
            continue
        p99, most = worst.get(r["multiple"], (0.0, 0.0))
        worst[r["multiple"]] = (max(p99, lag["p99"]), max(most, lag["max"]))
    if not worst:
        return ""
    rows = ", ".join(f"{m:g}×: {p99:.0f} / {most:.0f}" for m, (p99, most) in sorted(worst.items()))
    return f"The client's event-loop lag, p99 / max ms (worst run per rate): {rows}."


def _median_ms(rows: list[dict[str, Any]], q: str) -> str:
    values = [v for r in rows if (v := r["ttft_ms"][q]) is not None]
    return f"{statistics.median(values):.0f}" if values else "–"


def goals(records: list[dict[str, Any]]) -> str:
    """The goals, checked against every repeat of each SLO policy that ran (`slo`, or
    `slo:<placement>[:<protect>]` variants side by side), against the baselines: at 2×
    capacity SLO goodput ≥ 90 % of its own peak and ≥ 1.5× round-robin's; at 1× ≥ 1.1× the
    best baseline; admitted interactive attainment ≥ 95 % at every rate."""
    names = [p for p in dict.fromkeys(r["policy"] for r in records) if is_slo_policy(p)]
    baselines = sorted({r["policy"] for r in records} - set(names))
    return "\n\n".join(_goals(records, name, baselines) for name in names)


def _goals(records: list[dict[str, Any]], name: str, baselines: list[str]) -> str:
    def runs(policy: str, multiple: float) -> list[dict[str, Any]]:
        return [r for r in records if r["policy"] == policy and r["multiple"] == multiple]

    def median_goodput(policy: str, multiple: float) -> float | None:
        rows = runs(policy, multiple)
        return statistics.median(r["goodput_req_s"] for r in rows) if rows else None

    slo = [r for r in records if r["policy"] == name]
    multiples = sorted({r["multiple"] for r in slo})
    peak = max(median_goodput(name, m) or 0.0 for m in multiples)
    out = [f"Goals for {name} (each repeat checked against the baselines' median):", ""]
    top = max(multiples)
    at_top = runs(name, top)
    if at_top:
        worst = min(r["goodput_req_s"] for r in at_top)
        out.append(
            f"- at {top:g}× capacity, SLO goodput ≥ 90 % of its peak ({peak:.2f}): "
            f"min over runs {worst:.2f} = {worst / peak:.0%} → "
            f"{'met' if worst >= 0.9 * peak else 'missed'}"
        )
        rr = median_goodput("round-robin", top)
        if rr:
            out.append(
                f"- at {top:g}×, SLO goodput ≥ 1.5× round-robin ({rr:.2f}): min ratio "
                f"{worst / rr:.2f} → {'met' if worst >= 1.5 * rr else 'missed'}"
            )
    if 1.0 in multiples and baselines:
        best = max((median_goodput(b, 1.0) or 0.0) for b in baselines)
        worst = min(r["goodput_req_s"] for r in runs(name, 1.0))
        if best:
            out.append(
                f"- at 1× (the knee), SLO goodput ≥ 1.1× the best baseline ({best:.2f}): min ratio "
                f"{worst / best:.2f} → {'met' if worst >= 1.1 * best else 'missed'}"
            )
    admitted = [
        a
        for r in slo
        if (a := r["by_class"].get(KEY_CLASS, {}).get("attainment_admitted")) is not None
    ]
    if admitted:
        out.append(
            f"- admitted {KEY_CLASS} attainment ≥ 95 % at every rate: min {min(admitted):.3f} → "
            f"{'met' if min(admitted) >= 0.95 else 'missed'}"
        )
    return "\n".join(out)


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(r["policy"] for r in records):
        rates = sorted({r["rate"] for r in records if r["policy"] == policy})
        for ax, value in ((ax1, "goodput"), (ax2, "attainment")):
            mids, lows, highs = [], [], []
            for rate in rates:
                rows = [r for r in records if r["policy"] == policy and r["rate"] == rate]
                if value == "goodput":
                    vals = [r["goodput_req_s"] for r in rows]
                else:
                    vals = [
                        r["by_class"].get(KEY_CLASS, {}).get("attainment_offered") or 0.0
                        for r in rows
                    ]
                mid = statistics.median(vals)
                mids.append(mid)
                lows.append(mid - min(vals))
                highs.append(max(vals) - mid)
            ax.errorbar(rates, mids, yerr=[lows, highs], marker="o", capsize=3, label=policy)
    ax1.set(
        xlabel="offered rate (req/s)", ylabel="goodput (SLO-met req/s of arrivals)", title=title
    )
    ax2.set(xlabel="offered rate (req/s)", ylabel=f"{KEY_CLASS} SLO attainment (offered)")
    ax2.axhline(ATTAINMENT_GOAL, color="grey", ls=":", lw=1)
    save_figure(fig, (ax1, ax2), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.bench.goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--workload", type=Path, help="the workload YAML (all but --trace)")
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        help="run nothing: summarize and plot the records of these JSON files together",
    )
    parser.add_argument("--capacity", type=float, default=None, help="req/s; probed if omitted")
    parser.add_argument("--probe-concurrency", type=int, default=32)
    parser.add_argument("--probe-s", type=float, default=20)
    parser.add_argument("--multiples", default="0.5,1,1.5,2")
    parser.add_argument("--policies", default="slo,round-robin,least-load,single=throughput")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--repeats-at", default="1,2", help="multiples that get extra repeats")
    parser.add_argument("--extra-repeats", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=30, help="arrival window per run")
    parser.add_argument("--drain-s", type=float, default=30, help="bound on the drain after it")
    parser.add_argument(
        "--interactive", default=None, help="TTFT,TPOT ms for the interactive class (overrides)"
    )
    parser.add_argument("--machine", help='the hardware, e.g. "two H200s, 32 cores"')
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="goodput")
    parser.add_argument(
        "--trace",
        type=Path,
        help="run nothing: from a NAME.samples.jsonl, how requests fared by the prefills of "
        "their class within their decode",
    )
    parser.add_argument(
        "--samples", action="store_true", help="also write one row per request: NAME.samples.jsonl"
    )
    args = parser.parse_args(argv)
    if args.trace:
        opener = gzip.open if args.trace.suffix == ".gz" else open
        with opener(args.trace, "rt") as f:
            print(stall_trace([json.loads(line) for line in f]))
        return 0
    if args.workload is None or (args.machine is None and not args.report):
        parser.error("--workload and --machine are required")
    workload = load_workload(args.workload)
    if args.interactive:
        ttft, tpot = (float(v) for v in args.interactive.split(","))
        workload = workload.with_targets(KEY_CLASS, ttft, tpot)
    if args.report:
        reports = [json.loads(path.read_text()) for path in args.report]
        # one file's probe stays with its records; several files' probes differ
        probe: dict[str, Any] | None = reports[0].get("probe") if len(reports) == 1 else None
        records = [r for report in reports for r in report["records"]]
    else:
        probe, records = asyncio.run(sweep(args, workload))
    report = summarize(records)
    print("\n" + report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(
            json.dumps({"probe": probe, "records": records}, indent=1) + "\n"
        )
        (args.out / f"{args.name}.md").write_text(report)
        machine = args.machine or ", ".join(sorted({str(r["machine"]) for r in records}))
        plot(records, args.out / f"{args.name}.png", f"{workload.name} on {machine}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
