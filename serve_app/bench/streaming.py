"""The app against `vllm serve`, same engine arguments, same client (`vllm bench serve`).

    python -m serve_app.bench.streaming --profile low-latency --concurrency 1,4,64 \\
        --repeats 3 --min-cell-s 20 --out docs/results/streaming/cpu

Starts the servers on 127.0.0.1 from one profile resolved for this machine's platform: `vllm serve`
with the profile's engine arguments as flags (one per count in --vllm-api-servers, e.g. 1,2,4,8,
to find vLLM's best configuration), and the app (`serve-app run`, its default HTTP path) with
that profile as its only pool. Per concurrency, a pilot run against each server sizes
the cells: each run has at least 4 x concurrency requests and lasts at least --min-cell-s against
the fastest server (longer against the others); a run that still comes out shorter (the server
ran faster than in its pilot) is made again with as many more requests as it needs, and the
later runs take as many. Then,
per repeat, `vllm bench serve` runs against each server in turn (the order rotating per repeat;
every server gets the same prompts but for a run made again, and no run repeats another's, so
none is a prefix-cache hit),
and the report gives per concurrency every target's output tok/s, TTFT p50 and median
inter-token latency (min-max over repeats) and the app's ratios to the best `vllm serve` of the
same repeat. The app's routing stays on the path (class `batch`: no SLO, so nothing is refused).

--serve-proxy-target adds Serve's proxy (HAProxy's fallback) as a target, --direct-ingress the
ingress replica's own port, --app-arg passes `serve-app run` flags (--app-arg=--serve-proxy: the
app through Serve's proxy); --harness WORKLOAD then drives the bare engine (in this process),
`vllm serve` and the app with serve_app.bench's own client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from serve_app.app import _served_name
from serve_app.bench.runner import conc_counts, rotated
from serve_app.bench.servers import Server, servers
from serve_app.bench.vllm_cli import BenchClient
from serve_app.profiles import ResolvedProfile

ROOT = Path(__file__).resolve().parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's CPU time unit
WARM_UP_PROMPTS = 16  # per target before measuring: compile, fill caches
PILOT_PROMPTS = 16  # per target and concurrency at least, to size the runs
METRICS = (
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "mean_itl_ms",
    "mean_e2el_ms",
)


ROLES = (
    ("ProxyActor", "serve proxy"),
    ("HAProxyManager", "ray control"),
    ("haproxy", "haproxy"),
    ("ServeReplica:llm:Ingress", "ingress"),
    ("ServeReplica:llm:pool-state", "pool-state board"),
    ("ServeReplica:llm:pool-", "pool replica"),
    ("EngineFrontend", "engine frontends"),
    ("EngineCore", "engine core"),
    ("VLLM::Worker", "engine worker"),
    ("gcs_server", "ray control"),
    ("raylet", "ray control"),
    ("dashboard", "ray control"),
)


def _role(proc: psutil.Process, root: int) -> str:
    if proc.pid == root:
        return "driver / api server"
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "other"
    return next((role for key, role in ROLES if key in title), "other")


def _tree(root: int) -> list[tuple[psutil.Process, str]]:
    """The process tree under root (root included), each with its role; empty once root is
    gone."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return []
    return [(p, _role(p, root)) for p in procs]


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each role of the process tree under root."""
    totals: dict[str, float] = {}
    for p, role in _tree(root):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        totals[role] = totals.get(role, 0.0) + t.user + t.system
    return totals


PROFILED_ROLES = ("pool replica", "engine frontends", "ingress")


def thread_cpu_seconds(root: int) -> dict[str, dict[str, float]]:
    """CPU seconds used so far by the threads of the pool and ingress replicas under root, per
    role and thread name (Ray names its C++ threads; Python's threads, the replica's event loop
    among them, carry the process's title)."""
    totals: dict[str, dict[str, float]] = {}
    for proc, role in _tree(root):
        if role not in PROFILED_ROLES:
            continue
        by_name = totals.setdefault(role, {})
        for task in Path(f"/proc/{proc.pid}/task").glob("*"):
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread or process ended meanwhile
                continue
            ticks = int(fields[11]) + int(fields[12])  # utime + stime
            by_name[name] = by_name.get(name, 0.0) + ticks / CLOCK_TICKS
    return totals


def start_py_spy(
    root: int, seconds: float, out: Path, tag: str, native: bool = False
) -> list[subprocess.Popen[bytes]]:
    """py-spy sampling the app's pool replicas and ingress replicas for `seconds` (collapsed
    stacks, one file per process: `py-spy-<role>-<pid>-<tag>.txt`, its log beside it), with
    C/C++ frames when `native`; needs `py-spy` on PATH or $PY_SPY."""
    exe = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--py-spy needs py-spy (on PATH, or $PY_SPY naming it)")
    started = []
    for proc, role in _tree(root):
        if role not in PROFILED_ROLES:
            continue
        path = out / f"py-spy-{role.replace(' ', '-')}-{proc.pid}-{tag}.txt"
        # Each sample pauses the process (--nonblocking reads of a busy replica mostly fail);
        # at 100 per second that costs the run a few percent.
        cmd = [exe, "record", "--format", "raw", "--rate", "100", "--duration", str(int(seconds))]
        cmd += ["--pid", str(proc.pid), "--output", str(path), *(["--native"] if native else [])]
        with path.with_suffix(".log").open("wb") as log:
            started.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    return started


@dataclass(frozen=True)
class Client:
    """`vllm bench serve` (kept up between runs) and what it asks for."""

    bench: BenchClient
    model: str  # the name the servers serve it under
    tokenizer: str


def bench_once(
    server: Server,
    client: Client,
    args: argparse.Namespace,
    conc: int,
    out: Path,
    prompts: int | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """One `vllm bench serve` run: `prompts` requests (default --num-prompts, at least 2 x
    conc) at concurrency conc, their prompts drawn with `seed` (default --seed)."""
    name = f"{server.name.replace(' ', '-')}-c{conc}-{int(time.time() * 1e3)}.json"
    argv = [
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", client.model, "--tokenizer", client.tokenizer, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-range-ratio", str(args.range_ratio),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(prompts or max(args.num_prompts, 2 * conc)),
        "--max-concurrency", str(conc),
        "--ignore-eos", "--temperature", "0", "--seed", str(args.seed if seed is None else seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--save-result", "--result-dir", str(out), "--result-filename", name,
    ]  # fmt: skip
    cpu_before = cpu_seconds(server.proc.pid)
    threads_before = thread_cpu_seconds(server.proc.pid)
    client.bench.run(argv, out / "logs" / "vllm-bench.log", args.run_timeout_s)
    cpu_after = cpu_seconds(server.proc.pid)
    threads_after = thread_cpu_seconds(server.proc.pid)
    result = json.loads((out / name).read_text())
    (out / name).unlink()  # the summary keeps what matters; raw per-request lists are large
    row = {k: result[k] for k in (*METRICS, "completed", "total_output_tokens", "duration")}
    row["outside_ms"] = outside_latency_ms(row, conc)
    # Where the CPU went during the run, per role of the server's process tree (CPU s per s).
    row["cpu_cores_by_role"] = {
        role: round((cpu_after[role] - cpu_before.get(role, 0.0)) / result["duration"], 3)
        for role in cpu_after
    }
    # ... and per thread of the pool and ingress replicas: the event loop or Ray's threads
    row["cpu_cores_by_thread"] = {
        role: {
            name: round((t - threads_before.get(role, {}).get(name, 0.0)) / result["duration"], 3)
            for name, t in sorted(threads.items(), key=lambda kv: -kv[1])
        }
        for role, threads in threads_after.items()
    }
    return row


def run_seed(base: int, conc: int, repeat: int | None, again: bool = False) -> int:
    """The prompts' seed of one run: its own per concurrency and repeat (a pilot's, repeat None,
    its own too), the same for every server; a run made `again` (the first came out short) its
    own too. A prompt a server has seen before would be a prefix-cache hit, its prefill skipped:
    no run repeats an earlier run's prompts, the warm-up's (`base`) included."""
    return base + 1000 * conc + (0 if repeat is None else 1 + repeat) + (500 if again else 0)


def long_enough_run(
    server: Server,
    client: Client,
    args: argparse.Namespace,
    conc: int,
    prompts: int,
    repeat: int,
) -> tuple[dict[str, Any], int, dict[str, Any] | None]:
    """One run of `prompts` requests that lasts --min-cell-s: one that came out shorter (the
    server ran faster than the pilots said) is made again, once, with prompts of its own and as
    many requests as its rate needs for --min-cell-s x 1.1. The run, the requests it took and
    the short run (None if there was none)."""
    row = bench_once(
        server, client, args, conc, args.out, prompts, run_seed(args.seed, conc, repeat)
    )
    if args.min_cell_s <= 0 or float(row["duration"]) >= args.min_cell_s:
        return row, prompts, None
    rate = float(row["completed"]) / float(row["duration"])
    more = max(prompts + 1, math.ceil(round(rate * float(args.min_cell_s) * 1.1, 6)))
    seed = run_seed(args.seed, conc, repeat, again=True)
    return bench_once(server, client, args, conc, args.out, more, seed), more, row


def outside_latency_ms(row: dict[str, Any], conc: int) -> float:
    """Mean time a request holds one of the run's `conc` slots outside its latency (request
    sent to last token): the response's end after its last token (usage, [DONE], the close)
    and the client's turn to the next request. What a server spends there is lost throughput
    that TTFT and ITL do not show."""
    slot_ms = float(row["duration"]) * conc / int(row["completed"]) * 1e3
    return slot_ms - float(row["mean_e2el_ms"])


def cell_prompts(targets: list[Server], client: Client, args: argparse.Namespace, conc: int) -> int:
    """Requests per run at this concurrency: at least --num-prompts and 4 x conc, and enough that
    a run against the fastest target lasts --min-cell-s (from a short pilot run against each,
    dropped; the pilots also warm every server at this concurrency)."""
    floor: int = max(args.num_prompts, 4 * conc)
    if conc in args.requests_per_run:  # sized from an earlier run: no pilots
        return max(floor, int(args.requests_per_run[conc]))
    if args.min_cell_s <= 0:
        return floor
    pilot_prompts = max(4 * conc, PILOT_PROMPTS)
    rates = []
    for server in targets:
        seed = run_seed(args.seed, conc, None)
        pilot = bench_once(server, client, args, conc, args.out, pilot_prompts, seed)
        rates.append(float(pilot["completed"]) / float(pilot["duration"]))
    return max(floor, math.ceil(round(max(rates) * float(args.min_cell_s) * 1.1, 6)))


def run_harness(
    workload_path: Path,
    concurrency: str,
    profile: ResolvedProfile,
    servers: list[Server],
    out: Path,
    gpu_memory_utilization: float | None,
    engine: bool = True,
    repeats: int = 1,
) -> None:
    """The bench's own client (serve_app.bench) against the bare engine, in this process (unless
    `engine` is off), and every server: the same workload, the same request timing, at each
    concurrency in turn, `repeats` times. Ratios are to the bare engine, or without it to the
    first server."""
    from serve_app.bench import stages
    from serve_app.bench.report import markdown_table, ratio_table, write_outputs
    from serve_app.bench.runner import run_targets, workloads_for
    from serve_app.bench.targets import EngineTarget, HTTPTarget, Target
    from serve_app.bench.workload import Arrival, load_workload

    if gpu_memory_utilization is not None:  # it shares a GPU with one of the servers
        engine_args = profile.engine.model_copy(
            update={"gpu_memory_utilization": gpu_memory_utilization}
        )
        profile = profile.model_copy(update={"engine": engine_args})
    targets: list[Target] = [EngineTarget(profile, name="bare engine")] if engine else []
    # No SLO class header: the app takes its default class (batch here, as for `vllm bench
    # serve`), so nothing is refused and every target serves the same requests.
    targets += [HTTPTarget(s.url, s.name, send_slo_class=False) for s in servers]
    base = load_workload(workload_path)
    # warm-up (dropped): the engine's first requests compile and fill caches, as the servers'
    # did in their warm-up runs
    warm = base.model_copy(update={"requests": 8}).with_arrival(
        Arrival(kind="closed", concurrency=4)
    )
    # one call, so the targets (the bare engine too) start once: the warm-up runs first, once per
    # repeat, and its rows are dropped
    runs = [warm, *workloads_for(base, concurrency, None)]
    rows = asyncio.run(run_targets(targets, runs, repeats))[len(targets) * repeats :]
    ratios = ratio_table(rows, targets[0].name)
    where = "Where the app's first tokens' time went (mean ms, share of client TTFT):\n\n"
    where += stages.table(rows)
    write_outputs(rows, out, "harness", "\n" + ratios + "\n\n" + where + "\n")
    print(markdown_table(rows) + "\n\n" + ratios + "\n\n" + where, flush=True)


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: every target's figures over its repeats, the best `vllm serve` (highest
    mean tok/s) and each other target's ratios to it, paired by repeat (a repeat still under
    way, or cut short, pairs only what both ran)."""
    out = []
    for conc in sorted({r["concurrency"] for r in rows}):
        cell = [r for r in rows if r["concurrency"] == conc]
        names = list(dict.fromkeys(r["target"] for r in cell))
        targets: dict[str, dict[str, Any]] = {}
        for name in names:
            runs = [r for r in cell if r["target"] == name]
            targets[name] = {
                "runs": len(runs),
                "requests": min(r["completed"] for r in runs),
                "duration_s": _spread([r["duration"] for r in runs]),
                "tok_s": _spread([r["output_throughput"] for r in runs]),
                "ttft_p50_ms": _spread([r["median_ttft_ms"] for r in runs]),
                "itl_p50_ms": _spread([r["median_itl_ms"] for r in runs]),
                "tpot_p50_ms": _spread([r["median_tpot_ms"] for r in runs]),
            }
            if all("outside_ms" in r for r in runs):  # (not in rows recorded before them)
                targets[name]["itl_mean_ms"] = _spread([r["mean_itl_ms"] for r in runs])
                targets[name]["outside_ms"] = _spread([r["outside_ms"] for r in runs])
        vllm = [n for n in names if n.startswith("vllm serve")]
        best = max(vllm, key=lambda n: targets[n]["tok_s"]["mean"]) if vllm else None
        ref = {r["repeat"]: r for r in cell if r["target"] == best}
        for name in names:
            if name in vllm:
                continue
            mine = [r for r in cell if r["target"] == name and r["repeat"] in ref]
            pairs = [(r, ref[r["repeat"]]) for r in mine]
            if not pairs:
                continue
            targets[name]["vs_best_vllm"] = {
                "tok_s_ratio": _spread(
                    [a["output_throughput"] / v["output_throughput"] for a, v in pairs]
                ),
                "ttft_p50_delta_ms": _spread(
                    [a["median_ttft_ms"] - v["median_ttft_ms"] for a, v in pairs]
                ),
                "ttft_p50_ratio": _spread(
                    [a["median_ttft_ms"] / v["median_ttft_ms"] for a, v in pairs]
                ),
                "itl_p50_ratio": _spread(
                    [a["median_itl_ms"] / v["median_itl_ms"] for a, v in pairs]
                ),
            }
        out.append({"concurrency": conc, "best_vllm": best, "targets": targets})
    return out


def _fmt(s: dict[str, float], spec: str) -> str:
    """mean (min-max); one value when there was one run."""
    if s["min"] == s["max"]:
        return format(s["mean"], spec)
    return f"{s['mean']:{spec}} ({s['min']:{spec}}–{s['max']:{spec}})"


def _maybe(target: dict[str, Any], key: str, spec: str) -> str:
    return _fmt(target[key], spec) if key in target else ""


def table(summary: list[dict[str, Any]]) -> str:
    """One row per concurrency and target: mean (min–max) over repeats; the app's ratios are
    to the best `vllm serve` of the same repeat."""
    lines = [
        "| conc | target | runs × requests | tok/s | TTFT p50 ms | ITL p50 ms | ITL mean ms "
        "| ms/request outside latency | tok/s ÷ best vllm | TTFT p50 Δ ms | ITL p50 ÷ best vllm |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        for name, t in s["targets"].items():
            label = f"{name} (best)" if name == s["best_vllm"] and len(s["targets"]) > 2 else name
            vs = t.get("vs_best_vllm")
            ratios = (
                f"{_fmt(vs['tok_s_ratio'], '.3f')} | {_fmt(vs['ttft_p50_delta_ms'], '+.1f')} "
                f"| {_fmt(vs['itl_p50_ratio'], '.2f')}"
                if vs
                else "| |"
            )
            lines.append(
                f"| {s['concurrency']} | {label} | {t['runs']} × {t['requests']} "
                f"| {_fmt(t['tok_s'], ',.0f')} | {_fmt(t['ttft_p50_ms'], '.1f')} "
                f"| {_fmt(t['itl_p50_ms'], '.1f')} | {_maybe(t, 'itl_mean_ms', '.1f')} "
                f"| {_maybe(t, 'outside_ms', '.1f')} | {ratios} |"
            )
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    """Output tok/s and TTFT p50 of every target per concurrency, side by side (bars: means,
    whiskers: min-max over repeats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = [str(s["concurrency"]) for s in summary]
    names = list(dict.fromkeys(n for s in summary for n in s["targets"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for n, name in enumerate(names):
        xs = [i + (n - (len(names) - 1) / 2) * width for i in range(len(concs))]
        for ax, key in ((left, "tok_s"), (right, "ttft_p50_ms")):
            stats = [s["targets"].get(name, {}).get(key) for s in summary]
            mean = [st["mean"] if st else 0.0 for st in stats]
            err = [
                [st["mean"] - st["min"] if st else 0.0 for st in stats],
                [st["max"] - st["mean"] if st else 0.0 for st in stats],
            ]
            ax.bar(xs, mean, width, yerr=err, capsize=2, label=name)
    for ax, ylabel in ((left, "output tok/s"), (right, "TTFT p50 (ms, log)")):
        ax.set_xticks(list(range(len(concs))), concs)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    right.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _env_pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def env_variant(spec: str) -> tuple[str, dict[str, str]]:
    """`NAME=KEY=VALUE,KEY=VALUE` (`NAME=` for none): a named environment to run the app in
    (argparse type of the result scripts' --variant)."""
    name, _, pairs = spec.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=KEY=VALUE,... or NAME=")
    return name, _env_pairs([p for p in pairs.split(",") if p])


def add_variant_argument(parser: argparse.ArgumentParser) -> None:
    """The result scripts' repeatable --variant (env_variant), one or more required."""
    parser.add_argument(
        "--variant",
        type=env_variant,
        action="append",
        required=True,
        help="NAME=KEY=VALUE,KEY=VALUE (NAME= for none): the app's environment in this variant",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.bench.streaming", description=__doc__
    )
    parser.add_argument("--profile", default="low-latency")
    parser.add_argument("--concurrency", default="1,4,64,256")
    parser.add_argument(
        "--num-prompts", type=int, default=0, help="requests per run, at least (see --min-cell-s)"
    )
    parser.add_argument(
        "--min-cell-s",
        type=float,
        default=20,
        help="size each run to last at least this long (from a pilot run per concurrency), "
        "and to have at least 4 x concurrency requests",
    )
    parser.add_argument(
        "--requests-per-run",
        type=conc_counts,
        default={},
        help="CONC=N,...: requests per run at these concurrencies (at least 4 x CONC), instead "
        "of sizing them by pilot runs",
    )
    parser.add_argument("--input-len", type=int, default=165)
    parser.add_argument("--range-ratio", type=float, default=0.8, help="165±80%%: 33-297 tokens")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the warm-up's prompts; each later run draws its own from it (see run_seed)",
    )
    parser.add_argument("--run-timeout-s", type=float, default=600)
    parser.add_argument("--app-env", action="append", default=[], help="KEY=VALUE for the app")
    parser.add_argument("--vllm-env", action="append", default=[], help="KEY=VALUE for vllm serve")
    parser.add_argument(
        "--vllm-cpu-layout",
        choices=["app", "unbound"],
        default="app",
        help="on CPU: `vllm serve` with its engine's model threads on cores of their own and "
        "its other processes on the rest, as `serve-app run` lays out a one-pool app (app), or "
        "unbound (SERVE_APP_ENGINE_CPUS=off in --app-env does the same for the app)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra `vllm serve` flag (not an engine argument): --vllm-arg=--api-server-count=4",
    )
    parser.add_argument(
        "--vllm-api-servers",
        default="",
        help="one `vllm serve` per count, e.g. 1,2,4,8 (--api-server-count); the app's ratios "
        "are to the best",
    )
    parser.add_argument(
        "--app-arg",
        action="append",
        default=[],
        help="extra `serve-app run` flag, e.g. --app-arg=--serve-proxy",
    )
    parser.add_argument(
        "--app-pythonpath", help="run the app from another checkout (e.g. a git worktree)"
    )
    parser.add_argument(
        "--serve-proxy-target",
        action="store_true",
        help="also bench Serve's proxy, HAProxy's fallback (port 8500)",
    )
    parser.add_argument(
        "--direct-ingress",
        action="store_true",
        help="also bench the app's ingress replica on its own port (Serve's direct ingress): "
        "the same app without the proxy hop",
    )
    parser.add_argument(
        "--no-server-timing",
        action="store_true",
        help="the app without its TTFT breakdown (to measure what the breakdown costs)",
    )
    parser.add_argument(
        "--harness",
        type=Path,
        help="then also run this workload with serve_app.bench's own client against the bare "
        "engine (in this process), vllm serve and the app",
    )
    parser.add_argument("--harness-concurrency", default="1,64,256")
    parser.add_argument(
        "--harness-engine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the harness drives the bare engine too (--no-harness-engine: the servers alone; "
        "ratios then to the first server)",
    )
    parser.add_argument("--harness-repeats", type=int, default=1)
    parser.add_argument(
        "--harness-gpu-memory-utilization",
        type=float,
        help="for the bare engine, when it shares a GPU with a server",
    )
    parser.add_argument(
        "--py-spy",
        type=float,
        default=0,
        metavar="SECONDS",
        help="sample the app's pool and ingress replicas with py-spy for this long at the start "
        "of its first run at each concurrency (collapsed stacks beside the results)",
    )
    parser.add_argument(
        "--py-spy-native",
        action="store_true",
        help="with --py-spy: C/C++ frames too (Ray's core worker and gRPC threads)",
    )
    parser.add_argument("--ports", default="18001,18002,18265,18080")
    parser.add_argument("--out", type=Path, default=Path("docs/results/streaming/latest"))
    parser.add_argument("--replot", type=Path, help="only redraw DIR/streaming.png from its JSON")
    args = parser.parse_args(argv)
    if args.replot:
        report = json.loads((args.replot / "streaming.json").read_text())
        plot(report["summary"], args.replot / "streaming.png", f"app vs vllm serve: {args.replot}")
        return 0
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    vllm_port, app_port, dashboard_port, metrics_port = (int(p) for p in args.ports.split(","))
    ports = (vllm_port, app_port, dashboard_port, metrics_port)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    started = time.time()
    app_env = _env_pairs(args.app_env)
    if args.app_pythonpath:
        app_env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(args.app_pythonpath).resolve()), os.environ.get("PYTHONPATH", "")]
        )
    logs = args.out / "logs"
    vllm_env = _env_pairs(args.vllm_env)
    api_servers = [int(n) for n in args.vllm_api_servers.split(",") if n]
    # a SIGTERM unwinds like Ctrl-C, so the servers below are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with (
        BenchClient() as bench,
        servers(
            args.profile,
            ports,
            logs,
            app_env,
            vllm_env,
            args.vllm_arg,
            app_args=args.app_arg,
            fallback_proxy=args.serve_proxy_target,
            direct_ingress=args.direct_ingress,
            server_timing=not args.no_server_timing,
            api_servers=api_servers,
            vllm_cpu_layout=args.vllm_cpu_layout == "app",
        ) as (targets, profile),
    ):
        from serve_app.engine.builtin_model import resolve_model

        client = Client(bench, _served_name(profile.model), resolve_model(profile.model))
        for server in targets if concurrencies else []:  # warm-up: compile, fill caches
            bench_once(server, client, args, 4, args.out, WARM_UP_PROMPTS)
        cells: dict[int, int] = {}  # requests per run (a run made again raises it)
        short_runs: list[dict[str, Any]] = []
        for conc in concurrencies:
            cells[conc] = cell_prompts(targets, client, args, conc)
            for rep in range(args.repeats):
                for server in rotated(targets, rep):
                    spies = []
                    if args.py_spy and server.name == "app" and rep == 0:
                        tag = f"c{conc}"
                        spies = start_py_spy(
                            server.proc.pid, args.py_spy, args.out, tag, args.py_spy_native
                        )
                    row, cells[conc], short = long_enough_run(
                        server, client, args, conc, cells[conc], rep
                    )
                    if short is not None:  # the later runs take as many requests
                        print(
                            f"c={conc} rep={rep} {server.name:>14}: {short['duration']:.1f} s "
                            f"with {short['completed']} requests, under {args.min_cell_s:g} s: "
                            f"made again with {cells[conc]}",
                            flush=True,
                        )
                        short_runs.append(
                            {"target": server.name, "concurrency": conc, "repeat": rep, **short}
                        )
                    for spy in spies:
                        spy.wait(timeout=args.py_spy + 60)
                    rows.append({"target": server.name, "concurrency": conc, "repeat": rep, **row})
                    cpu = ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_cores_by_role"].items())
                    print(
                        f"c={conc} rep={rep} {server.name:>14}: "
                        f"{row['output_throughput']:,.0f} tok/s, "
                        f"TTFT p50 {row['median_ttft_ms']:.1f} ms, "
                        f"ITL p50 {row['median_itl_ms']:.1f} ms, {row['duration']:.1f} s; "
                        f"CPU cores: {cpu}",
                        flush=True,
                    )
                    for role, threads in row["cpu_cores_by_thread"].items():
                        top = ", ".join(f"{k} {v:.2f}" for k, v in list(threads.items())[:4])
                        print(f"    {role} threads: {top}", flush=True)
                    # written after every run: a run cut short keeps what it measured
                    write_report(args, profile, app_env, started, rows, cells, short_runs)
            print(table(summarize(rows)), flush=True)
        if args.harness:
            run_harness(
                args.harness,
                args.harness_concurrency,
                profile,
                targets,
                args.out,
                args.harness_gpu_memory_utilization,
                engine=args.harness_engine,
                repeats=args.harness_repeats,
            )
    return 0


def write_report(
    args: argparse.Namespace,
    profile: ResolvedProfile,
    app_env: dict[str, str],
    started: float,
    rows: list[dict[str, Any]],
    cells: dict[int, int],
    short_runs: list[dict[str, Any]],
) -> None:
    summary = summarize(rows)
    report = {
        "profile": profile.model_dump(mode="json"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "app_env": app_env,
        "started": started,
        "requests_per_run": cells,
        "rows": rows,
        "short_runs": short_runs,  # made again with more requests; not in the rows
        "summary": summary,
    }
    (args.out / "streaming.json").write_text(json.dumps(report, indent=2))
    (args.out / "streaming.md").write_text(table(summary) + "\n")
    plot(summary, args.out / "streaming.png", f"app vs vllm serve, profile {args.profile}")


if __name__ == "__main__":
    sys.exit(main())
