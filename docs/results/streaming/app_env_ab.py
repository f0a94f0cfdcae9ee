"""The app in several environments against one `vllm serve`, alternated in one invocation.

    python docs/results/streaming/app_env_ab.py OUT --profile low-latency --concurrency 1,4 \
        --requests 1=44,4=137 --output-len 64 --repeats 3 \
        --variant default= --variant nice-0=SERVE_APP_CPU_ENGINE_NICENESS=0

What an environment variable read at engine start changes cannot be switched between runs of
one app, and two invocations of the streaming bench differ by more than most changes (the
machine's speed drifts). This keeps `vllm serve` up (the profile's engine arguments, in the
app's CPU layout) and, per repeat, starts the app once per variant (in turn, the order rotating
per repeat), and at each concurrency drives `vllm serve` and then the app, as the streaming
bench drives them (`vllm bench serve`; every pair of runs its own prompts). Prints a line per
run and the ratios; writes every run to OUT/app_env_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from serve_app.app import _served_name  # noqa: E402
from serve_app.bench import servers as bench_servers  # noqa: E402
from serve_app.bench.streaming import (  # noqa: E402
    Client,
    add_variant_argument,
    bench_once,
    conc_counts,
    run_seed,
)
from serve_app.bench.vllm_cli import BenchClient  # noqa: E402
from serve_app.cli import wait_ok  # noqa: E402
from serve_app.engine.builtin_model import resolve_model  # noqa: E402
from serve_app.profiles import detect_platform, find_profile, load_profile, profiles_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--profile", default="low-latency")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--requests", type=conc_counts, default={1: 44, 4: 137})
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_variant_argument(parser)
    args = parser.parse_args()
    variants: dict[str, dict[str, str]] = dict(args.variant)
    concs = [int(c) for c in args.concurrency.split(",")]
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    bench_args = argparse.Namespace(
        input_len=165,
        range_ratio=0.8,
        output_len=args.output_len,
        num_prompts=0,
        seed=0,
        run_timeout_s=600,
    )
    source = find_profile(args.profile, profiles_dir())
    profile_path = bench_servers._bench_profile(source, out / "logs")
    profile = load_profile(profile_path).resolve(detect_platform())
    port = bench_servers.free_port()
    rows: list[dict[str, Any]] = []
    names = list(variants)
    with BenchClient() as bench:
        client = Client(bench, _served_name(profile.model), resolve_model(profile.model))
        vllm_proc = bench_servers.vllm_serve(profile, port, out / "logs" / "vllm-serve.log")
        vllm = bench_servers.Server("vllm serve", f"http://127.0.0.1:{port}", vllm_proc)
        try:
            wait_ok(f"{vllm.url}/health", 900, proc=vllm_proc)
            bench_once(vllm, client, bench_args, 4, out, 16)  # warm-up
            for rep in range(args.repeats):
                shift = rep % len(names)
                for index, name in enumerate(names[shift:] + names[:shift]):
                    a, b, c, d = bench_servers.free_ports(4)
                    with bench_servers.servers(
                        args.profile, (a, b, c, d), out / "logs", variants[name], {}, [],
                        with_vllm=False,
                    ) as (targets, _):  # fmt: skip
                        (app,) = targets
                        bench_once(app, client, bench_args, 4, out, 16)  # warm-up
                        for conc in concs:
                            seed = run_seed(0, conc, rep * len(names) + index)
                            n = max(args.requests.get(conc, 0), 4 * conc)
                            for server in (vllm, app):
                                row = bench_once(server, client, bench_args, conc, out, n, seed)
                                row = {
                                    "variant": name,
                                    "target": server.name,
                                    "concurrency": conc,
                                    "repeat": rep,
                                    **row,
                                }
                                rows.append(row)
                                (out / "app_env_ab.json").write_text(json.dumps(rows, indent=1))
                                print(
                                    f"c={conc} rep={rep} {name:>10} {server.name:>10}: "
                                    f"{row['output_throughput']:,.0f} tok/s, "
                                    f"TTFT p50 {row['median_ttft_ms']:.1f} ms, "
                                    f"ITL p50 {row['median_itl_ms']:.2f} ms; CPU "
                                    f"{row['cpu_cores_by_role']}",
                                    flush=True,
                                )
        finally:
            bench_servers.stop_process(vllm_proc)
    print("app / vllm serve, per repeat (the vllm serve run just before):")
    for name in names:
        for conc in concs:
            ratios = []
            for rep in range(args.repeats):
                pair = {
                    r["target"]: r["output_throughput"]
                    for r in rows
                    if (r["variant"], r["concurrency"], r["repeat"]) == (name, conc, rep)
                }
                vllm = pair.get("vllm serve", 0.0)
                ratios.append(f"{pair.get('app', 0.0) / vllm:.3f}" if vllm else "n/a")
            print(f"  {name:>10} c={conc}: {', '.join(ratios)}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
