"""`tune`: sweep engine arguments on the bare engine, keep the Pareto front, write profiles.

    python -m serve_app.bench.tune --profile low-latency --workload workloads/seed-table.yaml \
        --block-size 16,32,64 --max-model-len 2048,4096 --max-num-seqs 64,256 \
        --kv-cache-dtype auto,fp8 --chunked-prefill on,off --out docs/results/tune

Each combination is first checked like a deploy would (platform block sizes, CPU KV rules);
refused ones are recorded with the reason and never started. Accepted ones run the workload on a
fresh engine. The Pareto front is taken over (output tokens/s ↑, TTFT p99 ↓, peak memory ↓), and
the best-throughput and best-TTFT points of the front are written as profiles with their
measurements in comments.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import yaml

from serve_app.bench.memory import MemoryProbe
from serve_app.bench.runner import run_workload, summarize
from serve_app.bench.targets import EngineTarget
from serve_app.bench.workload import load_workload
from serve_app.profiles import (
    EngineProfile,
    ProfileError,
    check_platform,
    detect_platform,
    find_profile,
    load_profile,
    profiles_dir,
)

AXES = ("block_size", "max_model_len", "max_num_seqs", "kv_cache_dtype", "enable_chunked_prefill")


def _ints(text: str | None) -> list[int | None]:
    return [int(x) for x in text.split(",")] if text else [None]


def _flags(text: str | None) -> list[bool | None]:
    return [x.strip() == "on" for x in text.split(",")] if text else [None]


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    axes = [
        _ints(args.block_size),
        _ints(args.max_model_len),
        _ints(args.max_num_seqs),
        args.kv_cache_dtype.split(",") if args.kv_cache_dtype else [None],
        _flags(args.chunked_prefill),
    ]
    out = []
    for values in itertools.product(*axes):
        out.append({k: v for k, v in zip(AXES, values, strict=True) if v is not None})
    return out


MEMORY_RESOLUTION_GIB = 0.05  # resident-memory samples differ by a few MB run to run


def pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows no other row beats on all of throughput (higher), TTFT p99 and memory (lower).

    Memory is compared at MEMORY_RESOLUTION_GIB: smaller differences are sampling noise, and
    would otherwise keep every point on the front.
    """

    def key(r: dict[str, Any]) -> tuple[float, float, float]:
        mem = round((r["peak_mem_gib"] or 0.0) / MEMORY_RESOLUTION_GIB)
        return (-r["output_tok_s"], r["ttft_ms"]["p99"] or float("inf"), mem)

    front = []
    for r in rows:
        kr = key(r)
        dominated = any(
            all(a <= b for a, b in zip(key(o), kr, strict=True)) and key(o) != kr for o in rows
        )
        if not dominated:
            front.append(r)
    return front


def write_profile(
    base: EngineProfile, row: dict[str, Any], path: Path, platform: str, workload: str
) -> None:
    """The base profile with the measured engine arguments as this platform's overrides."""
    data = base.model_dump(mode="json", exclude_none=True, exclude_defaults=False)
    data["name"] = path.stem
    data["description"] = f"{path.stem}: '{base.name}' tuned by `tune` on {platform} ({workload})."
    data.setdefault("platforms", {}).setdefault(platform, {})
    data["platforms"][platform]["engine"] = {
        **data["platforms"][platform].get("engine", {}),
        **row["args"],
    }
    header = (
        f"# Written by `python -m serve_app.bench.tune` from profile '{base.name}' on {platform},\n"
        f"# workload '{workload}': {row['output_tok_s']:,.0f} output tok/s, "
        f"TTFT p50 {row['ttft_ms']['p50']:.1f} ms / p99 {row['ttft_ms']['p99']:.1f} ms, "
        f"peak memory {row['peak_mem_gib'] or 0:.2f} GiB, errors {row['errors']}.\n"
        f"# Swept arguments: {json.dumps(row['args'])}\n"
    )
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))


async def _measure(base: EngineProfile, args: argparse.Namespace) -> dict[str, Any]:
    platform = detect_platform()
    workload = load_workload(args.workload)
    rows: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for combo in grid(args):
        try:
            trial = base.resolve(platform)
            trial = trial.model_copy(update={"engine": trial.engine.model_copy(update=combo)})
            check_platform(trial)
        except ProfileError as e:
            refused.append({"args": combo, "reason": str(e)})
            print(f"refused {combo}: {e}", flush=True)
            continue
        target = EngineTarget(trial, name=json.dumps(combo))
        try:
            await target.start()
        except Exception as e:  # vLLM itself refused the combination at start
            refused.append({"args": combo, "reason": f"engine failed to start: {e}"[:300]})
            continue
        try:
            row = summarize(await run_workload(target, workload, MemoryProbe()))
        finally:
            await target.stop()
        row["args"] = combo
        rows.append(row)
        print(
            f"{combo}: {row['output_tok_s']:,.0f} tok/s, TTFT p99 {row['ttft_ms']['p99']}",
            flush=True,
        )
    return {"platform": platform.value, "rows": rows, "refused": refused}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.bench.tune", description=__doc__)
    parser.add_argument("--profile", required=True, help="base profile name")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--block-size")
    parser.add_argument("--max-model-len")
    parser.add_argument("--max-num-seqs")
    parser.add_argument("--kv-cache-dtype")
    parser.add_argument("--chunked-prefill", help="on,off")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--write-profiles", type=Path, help="directory for tuned-*.yaml (e.g. profiles)"
    )
    args = parser.parse_args(argv)
    base = load_profile(find_profile(args.profile, profiles_dir()))
    result = asyncio.run(_measure(base, args))
    front = pareto(result["rows"])
    result["pareto"] = [r["args"] for r in front]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "| args | out tok/s | TTFT p50 | TTFT p99 | peak GiB | Pareto |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        star = "✔" if r in front else ""
        lines.append(
            f"| `{json.dumps(r['args'])}` | {r['output_tok_s']:,.0f} | {r['ttft_ms']['p50']:.1f} "
            f"| {r['ttft_ms']['p99']:.1f} | {r['peak_mem_gib'] or 0:.2f} | {star} |"
        )
    lines += ["", "Refused before start:", ""]
    lines += [f"- `{json.dumps(r['args'])}`: {r['reason']}" for r in result["refused"]]
    (args.out / "tune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.write_profiles and front:
        best_tput = max(front, key=lambda r: r["output_tok_s"])
        best_ttft = min(front, key=lambda r: r["ttft_ms"]["p99"] or float("inf"))
        for name, row in (("tuned-throughput", best_tput), ("tuned-low-latency", best_ttft)):
            path = args.write_profiles / f"{name}.yaml"
            write_profile(base, row, path, result["platform"], args.workload.stem)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
