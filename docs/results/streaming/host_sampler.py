"""Every process's CPU on this host, and the GPUs' state, sampled while a benchmark runs.

    python docs/results/streaming/host_sampler.py OUT.jsonl --every-s 5 --for-s 600

Each line: the time, the busiest processes over the last interval (CPU cores, nice, command
line) and, where `nvidia-smi` exists, each GPU's utilization, SM clock, power and memory used,
and which processes hold a context on it.
It shows what the server that is not being driven does meanwhile, which the benchmark's own
per-target CPU figures (the driven server's process tree only) do not.
"""

import argparse
import json
import os
import shutil
import subprocess
import time

import psutil

GPU_QUERY = "index,utilization.gpu,clocks.sm,power.draw,memory.used"


def cpu_seconds() -> dict[int, tuple[float, int, str]]:
    seen = {}
    for proc in psutil.process_iter(["cpu_times", "nice", "cmdline", "name"]):
        info = proc.info
        if info["cpu_times"] is None:
            continue
        cmd = " ".join(info["cmdline"] or []).strip() or info["name"] or ""
        seen[proc.pid] = (info["cpu_times"].user + info["cpu_times"].system, info["nice"], cmd)
    return seen


def nvidia_smi(query: str, fields: str) -> list[dict[str, str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=10, check=False,
    ).stdout  # fmt: skip
    keys = fields.split(",")
    return [
        dict(zip(keys, (v.strip() for v in line.split(",")), strict=False))
        for line in out.splitlines()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--every-s", type=float, default=5.0)
    parser.add_argument("--for-s", type=float, default=600.0)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    end = time.monotonic() + args.for_s
    before, then = cpu_seconds(), time.monotonic()
    with open(args.out, "a") as out:
        while time.monotonic() < end:
            time.sleep(args.every_s)
            now_seen, now = cpu_seconds(), time.monotonic()
            rows = [
                (round((t - before[pid][0]) / (now - then), 3), pid, nice, cmd[:160])
                for pid, (t, nice, cmd) in now_seen.items()
                if pid in before and pid != os.getpid()
            ]
            rows.sort(reverse=True)
            line = {
                "t": round(time.time(), 1),
                "cores_total": round(sum(r[0] for r in rows), 2),
                "top": [
                    {"cores": c, "pid": p, "nice": n, "cmd": cmd}
                    for c, p, n, cmd in rows[: args.top]
                ],
                "gpus": nvidia_smi("gpu", GPU_QUERY),
                "gpu_processes": nvidia_smi("compute-apps", "pid,used_memory"),
            }
            out.write(json.dumps(line) + "\n")
            out.flush()
            before, then = now_seen, now


if __name__ == "__main__":
    main()
