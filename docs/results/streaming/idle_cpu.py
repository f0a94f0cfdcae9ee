"""What the app's processes take of the CPU while it serves nothing, per process, per variant.

    python docs/results/streaming/idle_cpu.py OUT --profile low-latency --settle-s 30 \
        --sample-s 30 --repeats 3 --variant default= \
        --variant metrics-1s=RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000

On two cores every process but the engine's model thread shares one core with the engine core,
so what Ray, Serve and the app do in the background is taken from the engine core at every
concurrency. Per repeat and variant (in turn), this starts the app (`serve-app run`, the
profile as its only pool, as the streaming bench starts it) with the variant's environment,
waits --settle-s after it is ready, then counts each process's CPU seconds (user + system) over
--sample-s. Prints a table per run and writes every run to OUT/idle_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from serve_app.bench import servers as bench_servers  # noqa: E402
from serve_app.bench.streaming import _tree, add_variant_argument  # noqa: E402


def _name(proc: psutil.Process, role: str) -> str:
    try:
        cmd = proc.cmdline()
        title = " ".join(cmd) or proc.name()
    except psutil.Error:
        return role
    if role == "other" or role == "ray control":  # which of Ray's processes
        for key in ("dashboard/agent.py", "runtime_env/agent", "log_monitor", "monitor.py",
                    "ServeController", "dashboard.py", "gcs_server", "raylet", "HAProxyManager",
                    "ray::IDLE", "ray_client_server"):  # fmt: skip
            if key in title:
                return f"{role}: {key}"
        return f"{role}: {Path(cmd[0]).name if cmd else proc.name()}"
    return role


def sample(root: int, seconds: float) -> dict[str, float]:
    """CPU cores (CPU seconds per second) each named process of the tree used over `seconds`."""

    def times() -> dict[tuple[int, str], float]:
        out = {}
        for p, role in _tree(root):
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            out[(p.pid, _name(p, role))] = t.user + t.system
        return out

    before = times()
    start = time.monotonic()
    time.sleep(seconds)
    after = times()
    took = time.monotonic() - start
    cores: dict[str, float] = {}
    for (pid, name), t in after.items():
        cores[name] = cores.get(name, 0.0) + (t - before.get((pid, name), t)) / took
    return dict(sorted(cores.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--profile", default="low-latency")
    parser.add_argument("--settle-s", type=float, default=30)
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    add_variant_argument(parser)
    args = parser.parse_args()
    variants: dict[str, dict[str, str]] = dict(args.variant)
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runs = []
    for rep in range(args.repeats):
        for name, env in variants.items():
            a, b, c, d = bench_servers.free_ports(4)
            with bench_servers.servers(
                args.profile, (a, b, c, d), out / "logs", env, {}, [], with_vllm=False
            ) as (targets, _):
                (app,) = targets
                time.sleep(args.settle_s)
                cores = sample(app.proc.pid, args.sample_s)
            total = sum(cores.values())
            runs.append(
                {"variant": name, "env": env, "repeat": rep, "total": total, "cores": cores}
            )
            (out / "idle_cpu.json").write_text(json.dumps(runs, indent=1))
            print(f"rep={rep} {name}: {total:.3f} cores in all", flush=True)
            for proc_name, c in cores.items():
                if c >= 0.002:
                    print(f"    {c:.3f}  {proc_name}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
