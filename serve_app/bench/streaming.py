"""The app against `vllm serve`, same engine arguments, same client (`vllm bench serve`).

    python -m serve_app.bench.streaming --profile low-latency --concurrency 1,4,64,256 \\
        --num-prompts 400 --repeats 2 --out docs/results/streaming/cpu

Starts both servers on 127.0.0.1 from one profile resolved for this machine's platform: `vllm serve`
with the profile's engine arguments as flags, and the app (`serve-app run`) with that profile as
its only pool. Then, per concurrency and repeat, runs `vllm bench serve` against each in turn
(alternating which goes first) and prints output tok/s and TTFT/TPOT of both with the ratios.
The app's routing stays on the path (class `batch`: no SLO, so nothing is refused).

--haproxy runs the app behind HAProxy (`serve-app run --haproxy`) and adds Serve's fallback proxy
as a target; --direct-ingress adds the ingress replica's own port; --harness WORKLOAD then drives
the bare engine (in this process), `vllm serve` and the app with serve_app.bench's own client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from serve_app.app import _served_name
from serve_app.bench.servers import Server, servers
from serve_app.profiles import ResolvedProfile

ROOT = Path(__file__).resolve().parents[2]
WARM_UP_PROMPTS = 16  # per target before measuring: compile, fill caches
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")


ROLES = (
    ("ProxyActor", "serve proxy"),
    ("HAProxyManager", "ray control"),
    ("haproxy", "haproxy"),
    ("ServeReplica:llm:Ingress", "ingress"),
    ("ServeReplica:llm:pool-state", "pool-state board"),
    ("ServeReplica:llm:pool-", "pool replica"),
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


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each role of the process tree under root."""
    totals: dict[str, float] = {}
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return totals
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = _role(p, root)
        totals[role] = totals.get(role, 0.0) + t.user + t.system
    return totals


def bench_once(
    server: Server,
    model: str,
    tokenizer: str,
    args: argparse.Namespace,
    conc: int,
    out: Path,
    prompts: int | None = None,
) -> dict[str, Any]:
    """One `vllm bench serve` run: `prompts` requests (default --num-prompts, at least 2 x
    conc) at concurrency conc."""
    name = f"{server.name.replace(' ', '-')}-c{conc}-{int(time.time() * 1e3)}.json"
    cmd = [
        sys.executable, "-m", "serve_app.bench.vllm_cli", "bench", "serve",
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-range-ratio", str(args.range_ratio),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(prompts or max(args.num_prompts, 2 * conc)),
        "--max-concurrency", str(conc),
        "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
        "--save-result", "--result-dir", str(out), "--result-filename", name,
    ]  # fmt: skip
    cpu_before = cpu_seconds(server.proc.pid)
    with (out / "logs" / "vllm-bench.log").open("ab") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=log, timeout=args.run_timeout_s)
    cpu_after = cpu_seconds(server.proc.pid)
    result = json.loads((out / name).read_text())
    (out / name).unlink()  # the summary keeps what matters; raw per-request lists are large
    row = {k: result[k] for k in (*METRICS, "completed", "total_output_tokens", "duration")}
    # Where the CPU went during the run, per role of the server's process tree (CPU s per s).
    row["cpu_cores_by_role"] = {
        role: round((cpu_after[role] - cpu_before.get(role, 0.0)) / result["duration"], 3)
        for role in cpu_after
    }
    return row


# App-side targets: the app at its address (Serve's proxy; HAProxy with --haproxy), Serve's
# fallback proxy behind HAProxy (--haproxy), and the app's ingress replica on its own HTTP port
# (--direct-ingress: Serve's direct ingress, no proxy hop).
APP_TARGETS = (("app", "app"), ("app serve-proxy", "proxy"), ("app direct", "direct"))


def run_harness(
    workload_path: Path,
    concurrency: str,
    profile: ResolvedProfile,
    servers: list[Server],
    out: Path,
    gpu_memory_utilization: float | None,
) -> None:
    """The bench's own client (serve_app.bench) against the bare engine, in this process, and
    every server: the same workload, the same request timing, at each concurrency in turn."""
    from serve_app.bench import stages
    from serve_app.bench.report import markdown_table, ratio_table, write_outputs
    from serve_app.bench.runner import run_targets, workloads_for
    from serve_app.bench.targets import EngineTarget, HTTPTarget, Target
    from serve_app.bench.workload import Arrival, load_workload

    if gpu_memory_utilization is not None:  # it shares a GPU with one of the servers
        engine = profile.engine.model_copy(
            update={"gpu_memory_utilization": gpu_memory_utilization}
        )
        profile = profile.model_copy(update={"engine": engine})
    targets: list[Target] = [EngineTarget(profile, name="bare engine")]
    # No SLO class header: the app takes its default class (batch here, as for `vllm bench
    # serve`), so nothing is refused and every target serves the same requests.
    targets += [HTTPTarget(s.url, s.name, send_slo_class=False) for s in servers]
    base = load_workload(workload_path)
    # warm-up (dropped): the engine's first requests compile and fill caches, as the servers'
    # did in their warm-up runs
    warm = base.model_copy(update={"requests": 8}).with_arrival(
        Arrival(kind="closed", concurrency=4)
    )
    rows = asyncio.run(run_targets(targets, [warm, *workloads_for(base, concurrency, None)], 1))
    rows = rows[len(targets) :]
    ratios = ratio_table(rows, "bare engine")
    where = "Where the app's first tokens' time went (mean ms, share of client TTFT):\n\n"
    where += stages.table(rows)
    write_outputs(rows, out, "harness", "\n" + ratios + "\n\n" + where + "\n")
    print(markdown_table(rows) + "\n\n" + ratios + "\n\n" + where, flush=True)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: means of every target and the paired ratios to `vllm serve`."""
    out = []
    for conc in sorted({r["concurrency"] for r in rows}):
        pairs = [r for r in rows if r["concurrency"] == conc]
        ref = [r for r in pairs if r["target"] == "vllm serve"]
        s: dict[str, Any] = {
            "concurrency": conc,
            "vllm_tok_s": statistics.mean(r["output_throughput"] for r in ref),
            "vllm_ttft_p50_ms": statistics.mean(r["median_ttft_ms"] for r in ref),
            "vllm_tpot_p50_ms": statistics.mean(r["median_tpot_ms"] for r in ref),
        }
        for target, key in APP_TARGETS:
            app = [r for r in pairs if r["target"] == target]
            if not app:
                continue
            ratios = [
                a["output_throughput"] / v["output_throughput"]
                for a, v in zip(app, ref, strict=True)
                if v["output_throughput"]
            ]
            prefix = "" if key == "app" else f"{key}_"
            s |= {
                f"{key}_tok_s": statistics.mean(r["output_throughput"] for r in app),
                f"{prefix}tok_s_ratio": statistics.mean(ratios),
                f"{prefix}tok_s_ratio_min": min(ratios),
                f"{key}_ttft_p50_ms": statistics.mean(r["median_ttft_ms"] for r in app),
                f"{prefix}ttft_p50_delta_ms": statistics.mean(
                    a["median_ttft_ms"] - v["median_ttft_ms"] for a, v in zip(app, ref, strict=True)
                ),
                f"{key}_tpot_p50_ms": statistics.mean(r["median_tpot_ms"] for r in app),
            }
        out.append(s)
    return out


def table(summary: list[dict[str, Any]]) -> str:
    sections = []
    for target, key in APP_TARGETS:
        if not summary or f"{key}_tok_s" not in summary[0]:
            continue
        prefix = "" if key == "app" else f"{key}_"
        lines = [
            f"| conc | vllm serve tok/s | {target} tok/s | ratio (min) "
            f"| TTFT p50 vllm / {target} ms | Δ ms | TPOT p50 vllm / {target} ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in summary:
            lines.append(
                f"| {s['concurrency']} | {s['vllm_tok_s']:,.0f} | {s[f'{key}_tok_s']:,.0f} "
                f"| {s[f'{prefix}tok_s_ratio']:.3f} ({s[f'{prefix}tok_s_ratio_min']:.3f}) "
                f"| {s['vllm_ttft_p50_ms']:.1f} / {s[f'{key}_ttft_p50_ms']:.1f} "
                f"| {s[f'{prefix}ttft_p50_delta_ms']:+.1f} "
                f"| {s['vllm_tpot_p50_ms']:.2f} / {s[f'{key}_tpot_p50_ms']:.2f} |"
            )
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    """Output tok/s of both servers and TTFT p50 per concurrency, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = [str(s["concurrency"]) for s in summary]
    x = range(len(concs))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    series = [("vllm", "vllm serve")] + [
        (key, target) for target, key in APP_TARGETS if f"{key}_tok_s" in summary[0]
    ]
    width = 0.8 / len(series)
    for n, (key, label) in enumerate(series):
        offset = (n - (len(series) - 1) / 2) * width
        left.bar([i + offset for i in x], [s[f"{key}_tok_s"] for s in summary], width, label=label)
        right.bar(
            [i + offset for i in x], [s[f"{key}_ttft_p50_ms"] for s in summary], width, label=label
        )
    for ax, ylabel in ((left, "output tok/s"), (right, "TTFT p50 (ms, log)")):
        ax.set_xticks(list(x), concs)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.legend()
    right.set_yscale("log")
    for i, s in enumerate(summary):
        left.annotate(f"{s['tok_s_ratio']:.2f}x", (i, max(s[f"{k}_tok_s"] for k, _ in series)))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _env_pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.bench.streaming", description=__doc__
    )
    parser.add_argument("--profile", default="low-latency")
    parser.add_argument("--concurrency", default="1,4,64,256")
    parser.add_argument("--num-prompts", type=int, default=200, help="at least 2x concurrency")
    parser.add_argument("--input-len", type=int, default=165)
    parser.add_argument("--range-ratio", type=float, default=0.8, help="165±80%%: 33-297 tokens")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-timeout-s", type=float, default=600)
    parser.add_argument("--app-env", action="append", default=[], help="KEY=VALUE for the app")
    parser.add_argument("--vllm-env", action="append", default=[], help="KEY=VALUE for vllm serve")
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra `vllm serve` flag (not an engine argument): --vllm-arg=--api-server-count=4",
    )
    parser.add_argument(
        "--app-pythonpath", help="run the app from another checkout (e.g. a git worktree)"
    )
    parser.add_argument(
        "--haproxy",
        action="store_true",
        help="run the app behind HAProxy (serve-app run --haproxy); Serve's fallback proxy "
        "becomes a target too",
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
        "--harness-gpu-memory-utilization",
        type=float,
        help="for the bare engine, when it shares a GPU with a server",
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
    with servers(
        args.profile,
        ports,
        logs,
        app_env,
        vllm_env,
        args.vllm_arg,
        args.haproxy,
        args.direct_ingress,
        not args.no_server_timing,
    ) as (targets, profile):
        from serve_app.engine.builtin_model import resolve_model

        model, tokenizer = _served_name(profile.model), resolve_model(profile.model)
        for server in targets if concurrencies else []:  # warm-up: compile, fill caches
            bench_once(server, model, tokenizer, args, 4, args.out, WARM_UP_PROMPTS)
        for conc in concurrencies:
            for rep in range(args.repeats):
                for server in targets if rep % 2 == 0 else targets[::-1]:
                    row = bench_once(server, model, tokenizer, args, conc, args.out)
                    rows.append({"target": server.name, "concurrency": conc, "repeat": rep, **row})
                    cpu = ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_cores_by_role"].items())
                    print(
                        f"c={conc} rep={rep} {server.name:>11}: "
                        f"{row['output_throughput']:,.0f} tok/s, "
                        f"TTFT p50 {row['median_ttft_ms']:.1f} ms; CPU cores: {cpu}",
                        flush=True,
                    )
        if rows:  # written before the servers stop: a run cut short at shutdown keeps them
            write_report(args, profile, app_env, started, rows)
        if args.harness:
            run_harness(
                args.harness,
                args.harness_concurrency,
                profile,
                targets,
                args.out,
                args.harness_gpu_memory_utilization,
            )
    return 0


def write_report(
    args: argparse.Namespace,
    profile: ResolvedProfile,
    app_env: dict[str, str],
    started: float,
    rows: list[dict[str, Any]],
) -> None:
    summary = summarize(rows)
    report = {
        "profile": profile.model_dump(mode="json"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "app_env": app_env,
        "started": started,
        "rows": rows,
        "summary": summary,
    }
    (args.out / "streaming.json").write_text(json.dumps(report, indent=2))
    (args.out / "streaming.md").write_text(table(summary) + "\n")
    plot(summary, args.out / "streaming.png", f"app vs vllm serve, profile {args.profile}")
    print(table(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
