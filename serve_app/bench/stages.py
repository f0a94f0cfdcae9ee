"""Where the first token's time went, over a run: the app's per-request Server-Timing stages.

Each sample carries the stages the app reported (serve_app/timing.py); `outside` is what the
client saw beyond them: client TTFT - (proxy + the ingress's TTFT + emit), i.e. the connection,
the response's way back through the HTTP proxy and the client itself. A stage's share is its
mean over the mean client TTFT, so the shares of a run add up to 1.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from serve_app.bench.stats import percentiles
from serve_app.bench.targets import Sample
from serve_app.timing import TTFT, Stage

OUTSIDE = "outside"
ORDER = [s.value for s in Stage] + [OUTSIDE]


def _outside(sample: Sample, stages: dict[str, float]) -> float | None:
    if sample.ttft_ms is None or TTFT not in stages:
        return None
    inside = stages[TTFT] + stages.get(Stage.PROXY, 0.0) + stages.get(Stage.EMIT, 0.0)
    return max(0.0, sample.ttft_ms - inside)


def breakdown(samples: Iterable[Sample]) -> dict[str, Any] | None:
    """Mean, p50, p99 and share of each stage over the timed, served samples; None if none."""
    timed = [s for s in samples if s.ok and s.stages and s.ttft_ms is not None]
    if not timed:
        return None
    values: dict[str, list[float]] = {name: [] for name in ORDER}
    for s in timed:
        assert s.stages is not None
        for name, ms in s.stages.items():
            if name in values:
                values[name].append(ms)
        outside = _outside(s, s.stages)
        if outside is not None:
            values[OUTSIDE].append(outside)
    observed = [s.ttft_ms for s in timed if s.ttft_ms is not None]  # all of them (typed)
    client = statistics.mean(observed)
    predicted = [s.predicted_ttft_ms for s in timed if s.predicted_ttft_ms is not None]
    stages = {}
    for name in ORDER:
        got = values[name]
        if not got:
            continue
        # a stage a request skipped (e.g. no proxy) counts 0 for it in the mean
        mean = sum(got) / len(timed)
        stages[name] = {
            "mean": mean,
            **percentiles(got),
            "share": mean / client if client else 0.0,
        }
    return {
        "n": len(timed),
        "client_ttft_ms_mean": client,
        "predicted_ttft_ms": percentiles(predicted),
        "observed_ttft_ms": percentiles(observed),
        "stages": stages,
    }


def table(rows: list[dict[str, Any]], key: str = "ttft_stages") -> str:
    """Markdown: per row (target and concurrency or rate), each stage's mean ms and share."""
    present = [r for r in rows if r.get(key)]
    if not present:
        return ""
    names = [n for n in ORDER if any(n in r[key]["stages"] for r in present)]
    lines = [
        "| target | conc/rate | repeat | n | client TTFT mean ms | predicted p50 ms | "
        + " | ".join(names)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(names),
    ]
    for r in present:
        b = r[key]
        cells = []
        for name in names:
            st = b["stages"].get(name)
            cells.append("–" if st is None else f"{st['mean']:.1f} ({st['share']:.0%})")
        predicted = b["predicted_ttft_ms"]["p50"]
        lines.append(
            f"| {r['target']} | {r.get('concurrency') or r.get('rate')} | "
            f"{r.get('repeat', '–')} | {b['n']} | "
            f"{b['client_ttft_ms_mean']:.1f} | "
            f"{'–' if predicted is None else f'{predicted:.1f}'} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)
