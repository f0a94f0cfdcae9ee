"""Benchmark outputs: JSON, a markdown table, ratio tables and PNG plots."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

COLUMNS = [
    ("target", "target", "{}"),
    ("conc/rate", None, "{}"),
    ("req", "requests", "{}"),
    ("err", "errors", "{}"),
    ("out tok/s", "output_tok_s", "{:,.0f}"),
    ("req/s", "req_s", "{:.2f}"),
    ("TTFT p50", ("ttft_ms", "p50"), "{:.1f}"),
    ("TTFT p99", ("ttft_ms", "p99"), "{:.1f}"),
    ("TPOT p50", ("tpot_ms", "p50"), "{:.2f}"),
    ("ITL p99", ("itl_ms", "p99"), "{:.2f}"),
    ("E2E p50", ("e2e_ms", "p50"), "{:.0f}"),
    ("goodput req/s", "goodput_req_s", "{:.2f}"),
    ("peak mem GiB", "peak_mem_gib", "{:.2f}"),
]


def _get(row: dict[str, Any], key: str | tuple[str, str] | None) -> Any:
    if key is None:
        return row.get("concurrency") or row.get("rate")
    if isinstance(key, tuple):
        return (row.get(key[0]) or {}).get(key[1])
    return row.get(key)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            value = _get(row, key)
            cells.append("–" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(rows: list[dict[str, Any]], baseline: str) -> str:
    """Each target against the baseline run next to it (same concurrency/rate and repeat):
    output tokens/s ratio and TTFT differences."""
    lines = [
        "| target | conc/rate | repeat | out tok/s ratio | TTFT p50 diff ms | TTFT p99 diff ms |",
        "|---|---|---|---|---|---|",
    ]
    base = {(_get(r, None), r.get("repeat")): r for r in rows if r["target"] == baseline}
    for row in rows:
        b = base.get((_get(row, None), row.get("repeat")))
        if row["target"] == baseline or b is None:
            continue
        ratio = row["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else float("nan")
        d50 = _diff(row, b, "p50")
        d99 = _diff(row, b, "p99")
        where = f"{row['target']} | {_get(row, None)} | {row.get('repeat')}"
        lines.append(f"| {where} | {ratio:.3f} | {d50} | {d99} |")
    return "\n".join(lines)


def _diff(row: dict[str, Any], base: dict[str, Any], q: str) -> str:
    a, b = row["ttft_ms"][q], base["ttft_ms"][q]
    return "–" if a is None or b is None else f"{a - b:+.1f}"


def write_outputs(rows: list[dict[str, Any]], out: Path, name: str, extra_md: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown_table(rows) + "\n" + extra_md)
    plot(rows, out / f"{name}.png")


def write_rounds(
    out: Path, name: str, args: argparse.Namespace, rows: list[dict[str, Any]], report: str
) -> None:
    """A transport bench's rounds: OUT/NAME.json (its arguments, this host, every row) and
    OUT/NAME.md (its table)."""
    out.mkdir(parents=True, exist_ok=True)
    host = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    result = {"args": vars(args) | {"out": str(out)}, "host": host, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(report + "\n")
    print(f"wrote {out}/{name}.json, {name}.md")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    targets = sorted({r["target"] for r in rows})
    for target in targets:
        mine = [r for r in rows if r["target"] == target]
        xs = [_get(r, None) for r in mine]
        ax1.plot(xs, [r["output_tok_s"] for r in mine], marker="o", label=target)
        ax2.plot(xs, [r["ttft_ms"]["p50"] or 0 for r in mine], marker="o", label=f"{target} p50")
        ax2.plot(
            xs, [r["ttft_ms"]["p99"] or 0 for r in mine], marker="x", ls="--", label=f"{target} p99"
        )
    ax1.set(xlabel="concurrency / rate", ylabel="output tokens/s", title="Throughput")
    ax2.set(xlabel="concurrency / rate", ylabel="ms", title="Time to first token")
    save_figure(fig, (ax1, ax2), path)


def save_figure(fig: Any, axes: tuple[Any, ...], path: Path) -> None:
    """Grid and legend on each axis, then write the PNG and free the figure."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
