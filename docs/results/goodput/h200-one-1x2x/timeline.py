"""One goodput run, 3 s of arrivals at a time: outcomes, refusal reasons, and for the admitted
requests the median TTFT, TPOT, prediction and TTFT stages per pool. From the repository root:

    python docs/results/goodput/h200-one-1x2x/timeline.py \
        docs/results/goodput/h200-one-1x2x/h200-one-2x.samples.jsonl.gz slo:best-fit 1
"""

import gzip
import json
import statistics
import sys
from collections import Counter

STAGES = ("dispatch", "engine_in", "queue", "prefill", "return")


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def main(path: str, policy: str, repeat: int, step_s: float = 3.0) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    run = [r for r in rows if r["policy"] == policy and r["repeat"] == repeat]
    print(f"{policy} repeat {repeat}: {len(run)} requests")
    for k in range(int(max(r["arrival_s"] for r in run) // step_s) + 1):
        part = [r for r in run if k * step_s <= r["arrival_s"] < (k + 1) * step_s]
        status = Counter(str(r["status"]) for r in part)
        refused = Counter(r["error"] for r in part if r["status"] in (429, 503))
        met = sum(bool(r["met_slo"]) for r in part)
        print(f"t={k * step_s:4.0f} s n={len(part)} met={met} status={dict(status)}")
        print(f"    refused: {dict(refused.most_common(3))}")
        for pool in ("low-latency", "throughput"):
            ok = [r for r in part if r["status"] == 200 and r["pool"] == pool]
            if not ok:
                continue
            stages = {
                s: median([r["stages"][s] for r in ok if r["stages"] and s in r["stages"]])
                for s in STAGES
            }
            print(
                f"    {pool}: n={len(ok)} "
                f"ttft={median([r['ttft_ms'] for r in ok if r['ttft_ms'] is not None])} "
                f"predicted={median([r['predicted_ttft_ms'] for r in ok if r['predicted_ttft_ms']])} "
                f"tpot={median([r['tpot_ms'] for r in ok if r['tpot_ms'] is not None])} "
                f"stages={stages}"
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
