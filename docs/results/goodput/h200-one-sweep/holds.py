"""Streams held back after their first token, per goodput run: from a samples file, for each run
the admitted interactive requests' TPOT misses, the streams whose longest gap between chunks
passed 1 s, and that gap's median. With a policy and repeat (and multiple), the run second by
second: per pool, the streams decoding and how many of them were held past 1 s. From the
repository root:

    python docs/results/goodput/h200-one-sweep/holds.py \
        docs/results/goodput/h200-one-sweep/h200-one-sweep.samples.jsonl.gz
    python docs/results/goodput/h200-one-sweep/holds.py \
        docs/results/goodput/h200-one-sweep/h200-one-sweep.samples.jsonl.gz slo:best-fit 2 1.5
"""

import gzip
import json
import statistics
import sys
from collections import defaultdict

HELD_MS = 1000.0
INTERACTIVE_TPOT_MS = 25.0  # workloads/slo-mix-gpu.yaml
POOLS = ("low-latency", "throughput")


def decoding_at(r: dict, t: float) -> bool:
    return r["arrival_s"] + r["ttft_ms"] / 1e3 <= t < r["arrival_s"] + r["e2e_ms"] / 1e3


def summary(runs: dict[tuple, list[dict]]) -> None:
    print(
        "| policy | x | repeat | interactive admitted | TPOT misses | held > 1 s "
        "| their gap p50 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for (policy, multiple, repeat), run in sorted(runs.items()):
        ok = [r for r in run if r["status"] == 200 and r["ttft_ms"] and r["e2e_ms"]]
        inter = [r for r in ok if r["slo_class"] == "interactive"]
        tpot_misses = sum(1 for r in inter if (r["tpot_ms"] or 0) > INTERACTIVE_TPOT_MS)
        held = [r["max_gap_ms"] for r in ok if (r["max_gap_ms"] or 0) > HELD_MS]
        p50 = f"{statistics.median(held):.0f}" if held else "-"
        print(
            f"| {policy} | {multiple} | {repeat} | {len(inter)} | {tpot_misses} | {len(held)} | "
            f"{p50} |"
        )


def timeline(run: list[dict]) -> None:
    ok = [r for r in run if r["status"] == 200 and r["ttft_ms"] and r["e2e_ms"]]
    for second in range(int(max(r["arrival_s"] for r in run)) + 1):
        t = second + 0.5
        parts = []
        for pool in POOLS:
            dec = [r for r in ok if r["pool"] == pool and decoding_at(r, t)]
            held = sum(1 for r in dec if (r["max_gap_ms"] or 0) > HELD_MS)
            parts.append(f"{pool}: {len(dec):3d} decoding, {held:3d} held")
        print(f"t={second:3d} s  " + " | ".join(parts))


def main(path: str, *run_key: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        runs[(r["policy"], r["multiple"], r["repeat"])].append(r)
    if not run_key:
        summary(runs)
        return
    policy, repeat = run_key[0], int(run_key[1])
    multiple = float(run_key[2]) if len(run_key) > 2 else None
    run = [
        r
        for (p, m, rep), rs in runs.items()
        if p == policy and rep == repeat and (multiple is None or m == multiple)
        for r in rs
    ]
    timeline(run)


if __name__ == "__main__":
    main(*sys.argv[1:])
