"""Does the idle app slow `vllm serve` beside it? `vllm serve` alone, beside the app, alone again.

    SERVE_APP_SITE=<offline vLLM + Ray install> python docs/results/streaming/idle_neighbour.py \
        OUT --profile h200-stream-frontends4 --concurrency 64 --requests 1100 --repeats 2

The streaming bench keeps every server up while it drives one; on one GPU `vllm serve` then
measured 50 % faster beside the app with one engine process than beside the app with four.
This starts `vllm serve` (--api-server-count 4, the profile's engine arguments), drives it
`--repeats` times alone, starts the app (`serve-app run` with the profile), drives `vllm serve`
again beside it and the app once, stops the app and drives `vllm serve` alone once more; each
run as the streaming bench runs it (`vllm bench serve`, kept up between runs). Prints a line per
run and writes them to OUT/neighbour.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from serve_app.app import _served_name  # noqa: E402
from serve_app.bench import servers as bench_servers  # noqa: E402
from serve_app.bench.streaming import Client, bench_once  # noqa: E402
from serve_app.bench.vllm_cli import BenchClient  # noqa: E402
from serve_app.cli import wait_ok  # noqa: E402
from serve_app.engine.builtin_model import resolve_model  # noqa: E402
from serve_app.profiles import detect_platform, find_profile, load_profile, profiles_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--profile", default="h200-stream-frontends4")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--api-servers", type=int, default=4)
    args = parser.parse_args()
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    bench_args = argparse.Namespace(
        input_len=165, range_ratio=0.8, output_len=256, num_prompts=0, seed=0, run_timeout_s=300
    )
    source = find_profile(args.profile, profiles_dir())
    profile_path = bench_servers._bench_profile(source, Path(tempfile.mkdtemp()))
    profile = load_profile(profile_path).resolve(detect_platform())
    port = bench_servers.free_port()
    rows = []
    with BenchClient() as bench:
        client = Client(bench, _served_name(profile.model), resolve_model(profile.model))
        flags = [f"--api-server-count={args.api_servers}"]
        vllm_proc = bench_servers.vllm_serve(profile, port, out / "logs" / "vllm-serve.log", flags)
        vllm = bench_servers.Server(
            f"vllm serve x{args.api_servers}", f"http://127.0.0.1:{port}", vllm_proc
        )
        try:
            wait_ok(f"{vllm.url}/health", 900, proc=vllm_proc)
            bench_once(vllm, client, bench_args, 4, out, 16)  # warm-up

            def drive(server: bench_servers.Server, phase: str, times: int) -> None:
                for _ in range(times):
                    row = bench_once(
                        server, client, bench_args, args.concurrency, out, args.requests
                    )
                    row = {"target": server.name, "phase": phase, "t": time.time(), **row}
                    rows.append(row)
                    (out / "neighbour.json").write_text(json.dumps(rows, indent=1))
                    print(
                        f"{phase:>12} {server.name:>14}: {row['output_throughput']:,.0f} tok/s, "
                        f"TTFT p50 {row['median_ttft_ms']:.1f} ms, "
                        f"ITL p50 {row['median_itl_ms']:.1f} ms, {row['duration']:.1f} s",
                        flush=True,
                    )

            drive(vllm, "alone", args.repeats)
            a, b, c, d = bench_servers.free_ports(4)
            with bench_servers.servers(
                args.profile, (a, b, c, d), out / "logs", {}, {}, [], with_vllm=False
            ) as (targets, _):
                (app,) = targets
                bench_once(app, client, bench_args, 4, out, 16)  # warm-up
                drive(vllm, "beside app", args.repeats)
                drive(app, "app", 1)
            drive(vllm, "alone again", args.repeats)
        finally:
            bench_servers.stop_process(vllm_proc)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
