"""Per-run figures from the samples: requests held at the ingress (route stage over 20 ms),
refusals to protect running requests, and the ingress stage; with a policy, multiple and
repeat, that run's timeline in 3 s windows (stages' medians of the admitted requests).

    python3 runs.py h200-one-default.samples.jsonl.gz
    python3 runs.py h200-one-default.samples.jsonl.gz slo 1.0 0
"""

import collections
import gzip
import json
import statistics
import sys


def p(values: list[float], q: float) -> float:
    return sorted(values)[int(q * len(values))] if values else float("nan")


rows = [json.loads(line) for line in gzip.open(sys.argv[1], "rt")]
if len(sys.argv) == 2:
    runs = collections.defaultdict(list)
    for r in rows:
        runs[(r["policy"], r["multiple"], r["repeat"])].append(r)
    print("policy multiple repeat | served | held >20 ms | refused protects-running | ingress p50 / p90 ms")
    for key in sorted(runs):
        run = runs[key]
        ok = [r for r in run if r["status"] == 200 and r["stages"]]
        held = sum(1 for r in ok if r["stages"].get("route", 0) > 20)
        protects = sum(1 for r in run if r["error"] and "protects-running" in r["error"])
        ingress = [r["stages"].get("ingress", 0) for r in ok]
        print(*key, "|", len(ok), "|", held, "|", protects, "|",
              f"{statistics.median(ingress):.1f} / {p(ingress, 0.9):.1f}")
else:
    policy, multiple, repeat = sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    run = [r for r in rows if (r["policy"], r["multiple"], r["repeat"]) == (policy, multiple, repeat)]
    windows = collections.defaultdict(list)
    for r in run:
        windows[int(r["arrival_s"] // 3) * 3].append(r)
    stages = ("ingress", "route", "dispatch", "engine_in", "queue", "prefill", "return", "ttft")
    print("arrival s | offered | served | missed | refused |", " | ".join(stages), "(medians, ms)")
    for start in sorted(windows):
        w = windows[start]
        ok = [r for r in w if r["status"] == 200 and r["stages"]]
        missed = sum(1 for r in ok if not r["met_slo"])
        med = [statistics.median(r["stages"].get(s, 0) for r in ok) if ok else float("nan") for s in stages]
        print(start, "|", len(w), "|", len(ok), "|", missed, "|", len(w) - len(ok), "|",
              " | ".join(f"{m:.1f}" for m in med))
