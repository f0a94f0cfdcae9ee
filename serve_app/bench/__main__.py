"""`python -m serve_app.bench` (or `serve-app-bench`): run, compare.

    run      --workload W --target T [--concurrency 1,16] [--requests 16=480] [--out DIR]
    compare  --workload W --target BASE --target OTHER ... [--concurrency 1,16] [--repeats 2]

Targets: engine:<profile> | app:<url> | url:<url>. Every run is bounded by the workload's
request count and duration_s. `compare` alternates the targets at each concurrency (repeats
times) so slow drift of a noisy machine hits all of them alike, then prints ratios to the first.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from serve_app.bench import stages
from serve_app.bench.report import markdown_table, ratio_table, write_outputs
from serve_app.bench.runner import conc_counts, run_targets, workloads_for
from serve_app.bench.targets import make_target
from serve_app.bench.workload import load_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve-app-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--workload", type=Path, required=True)
        p.add_argument("--target", action="append", required=True)
        p.add_argument("--concurrency", help="comma-separated closed-loop concurrencies")
        p.add_argument("--rate", help="comma-separated Poisson rates (req/s), instead")
        p.add_argument(
            "--requests",
            type=conc_counts,
            default={},
            help="CONC=N,...: requests per run at these concurrencies (the workload's elsewhere)",
        )
        p.add_argument("--repeats", type=int, default=1)
        p.add_argument("--out", type=Path)
        p.add_argument("--name", default=None, help="output file stem")
    args = parser.parse_args(argv)
    workload = load_workload(args.workload)
    targets = [make_target(t) for t in args.target]
    rows = asyncio.run(
        run_targets(
            targets,
            workloads_for(workload, args.concurrency, args.rate, args.requests),
            args.repeats,
        )
    )
    table = markdown_table(rows)
    ratios = ratio_table(rows, targets[0].name) if args.command == "compare" else ""
    where = stages.table(rows)
    extra = "".join(f"\n{part}\n" for part in (ratios, where) if part)
    print("\n" + table + "\n" + extra)
    if args.out:
        stem = args.name or f"{args.command}-{workload.name}"
        write_outputs(rows, args.out, stem, extra)
        print(f"\nwrote {args.out / stem}.json/.md/.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
