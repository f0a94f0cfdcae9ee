"""Is vLLM's engine core slowed by what runs beside it? Each server as it runs, with its
engine-core process alone on one physical core (its hardware threads; every other thread of
the host kept off it), and with it at nice 0, alternated in one invocation.

    SERVE_APP_SITE=<offline vLLM + Ray install> python docs/results/streaming/own_core.py OUT \
        --profile h200-stream-frontends4 --concurrency 64 --requests 1100 --repeats 3 \
        --placements as-is,own-core,nice-0

On a GPU host both servers' engine cores run one busy Python thread (about a core each) that
sets the pace of every stream; the app runs ~5 cores of serving processes beside it where
`vllm serve` runs ~1.5, and its engine steps came out slower with the engine core as busy.
Ray starts the app's replicas at nice 15 and the engine core a replica starts inherits it,
where `vllm serve`'s runs at its starter's 0. This starts `vllm serve --api-server-count N` and
the app (the streaming bench's servers) and drives, in turn each repeat, each server in each
placement for that run only: as it runs (as-is), its engine core on a core of its own
(own-core), its engine core's every thread at nice 0 (nice-0). Per run it records the engine
core's CPU, its niceness, its context switches, how often its main thread changed CPU and how
busy that CPU's other hardware threads were (sampled every 50 ms). Prints a line per run and
writes them to OUT/own_core.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from serve_app.app import _served_name  # noqa: E402
from serve_app.bench import servers as bench_servers  # noqa: E402
from serve_app.bench.streaming import (  # noqa: E402
    Client,
    _tree,
    bench_once,
    conc_counts,
    run_seed,
)
from serve_app.bench.vllm_cli import BenchClient  # noqa: E402
from serve_app.engine.builtin_model import resolve_model  # noqa: E402
from serve_app.engine.priority import set_niceness  # noqa: E402


def siblings(cpu: int) -> set[int]:
    """The hardware threads of `cpu`'s physical core."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    out: set[int] = set()
    for part in path.read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def engine_core(server: bench_servers.Server) -> psutil.Process:
    (core,) = [p for p, role in _tree(server.proc.pid) if role == "engine core"]
    return core


def _tids(pid: int) -> list[int]:
    return [int(t.name) for t in Path(f"/proc/{pid}/task").glob("*")]


def _restore(saved: dict[int, Any], put: Callable[[int, Any], None]) -> None:
    """Put each thread's saved setting back (threads that ended meanwhile are skipped)."""
    for tid, before in saved.items():
        try:
            put(tid, before)
        except OSError:
            continue


@contextmanager
def own_core(engine: psutil.Process, own: set[int]) -> Iterator[None]:
    """Every thread of `engine` on `own` and every other thread of the host off it, for the
    block; each thread changed gets its affinity back after."""
    mine = set(_tids(engine.pid))
    saved: dict[int, set[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        for tid in _tids(int(proc.name)) if (proc / "task").exists() else []:
            try:
                before = os.sched_getaffinity(tid)
                after = own if tid in mine else before - own
                if after and after != before:
                    os.sched_setaffinity(tid, after)
                    saved[tid] = before
            except OSError:  # ended meanwhile, or a kernel thread bound to its CPU
                continue
    try:
        yield
    finally:
        _restore(saved, os.sched_setaffinity)


@contextmanager
def niceness(engine: psutil.Process, value: int) -> Iterator[None]:
    """Every thread of `engine` at niceness `value` for the block, then back."""
    saved: dict[int, int] = {}
    for tid in _tids(engine.pid):
        with suppress(OSError):  # the thread ended meanwhile
            saved[tid] = os.getpriority(os.PRIO_PROCESS, tid)
    set_niceness([engine], value)
    try:
        yield
    finally:
        _restore(saved, lambda tid, before: os.setpriority(os.PRIO_PROCESS, tid, before))


def placed(placement: str, engine: psutil.Process, own: set[int]) -> AbstractContextManager[None]:
    if placement == "own-core":
        return own_core(engine, own)
    if placement == "nice-0":
        return niceness(engine, 0)
    return nullcontext()


PLACEMENTS = ("as-is", "own-core", "nice-0")


def _cpu_busy() -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies per CPU so far."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            name, *fields = line.split()
            ticks = [int(f) for f in fields]
            idle = ticks[3] + ticks[4]
            out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


class Sampler(threading.Thread):
    """Every 50 ms: the CPU the engine core's main thread is on, and how busy the other
    hardware threads of that core were over the last interval."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.stop = threading.Event()
        self.cpus: list[int] = []
        self.sibling_busy: list[float] = []

    def run(self) -> None:
        before = _cpu_busy()
        while not self.stop.wait(0.05):
            try:
                cpu = int(Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[36])
            except (OSError, IndexError, ValueError):
                return
            now = _cpu_busy()
            others = siblings(cpu) - {cpu}
            shares = [(now[c][0] - before[c][0]) / max(1, now[c][1] - before[c][1]) for c in others]
            self.cpus.append(cpu)
            if shares:
                self.sibling_busy.append(sum(shares) / len(shares))
            before = now


def measured(engine: psutil.Process, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    sampler = Sampler(engine.pid)
    t0, c0, s0 = time.monotonic(), engine.cpu_times(), engine.num_ctx_switches()
    sampler.start()
    row = run()
    sampler.stop.set()
    sampler.join()
    dt, c1, s1 = time.monotonic() - t0, engine.cpu_times(), engine.num_ctx_switches()
    moves = sum(a != b for a, b in zip(sampler.cpus, sampler.cpus[1:], strict=False))
    busy = sampler.sibling_busy
    row["engine_core"] = {
        "cores": round((c1.user + c1.system - c0.user - c0.system) / dt, 3),
        "voluntary_switches_per_s": round((s1.voluntary - s0.voluntary) / dt, 1),
        "involuntary_switches_per_s": round((s1.involuntary - s0.involuntary) / dt, 1),
        "cpu_changes_per_s": round(moves / dt, 2),
        "cpus_seen": sorted(set(sampler.cpus)),
        "sibling_busy_mean": round(sum(busy) / len(busy), 3) if busy else None,
        "niceness": engine.nice(),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--profile", default="h200-stream-frontends4")
    parser.add_argument("--concurrency", default="64", help="one or more, e.g. 1,4")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--requests", default="1100", help="per run: N, or CONC=N,... per concurrency"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--api-servers", type=int, default=4)
    parser.add_argument("--placements", default="as-is,own-core", help=",".join(PLACEMENTS))
    args = parser.parse_args()
    placements = args.placements.split(",")
    if unknown := set(placements) - set(PLACEMENTS):
        parser.error(f"--placements: unknown {sorted(unknown)}; choose from {PLACEMENTS}")
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    bench_args = argparse.Namespace(
        input_len=165,
        range_ratio=0.8,
        output_len=args.output_len,
        num_prompts=0,
        seed=0,
        run_timeout_s=300,
    )
    own = siblings(max(os.sched_getaffinity(0)))
    rows: list[dict[str, Any]] = []
    ports = tuple(bench_servers.free_ports(4))
    with (
        BenchClient() as bench,
        bench_servers.servers(
            args.profile, ports, out / "logs", {}, {}, [], api_servers=[args.api_servers]
        ) as (targets, profile),
    ):
        client = Client(bench, _served_name(profile.model), resolve_model(profile.model))
        for server in targets:
            bench_once(server, client, bench_args, 4, out, 16)  # warm-up
        variants = [(s, p) for p in placements for s in targets]
        concs = [int(c) for c in args.concurrency.split(",")]
        requests = (  # per concurrency; at least 4 x concurrency either way
            conc_counts(args.requests)
            if "=" in args.requests
            else dict.fromkeys(concs, int(args.requests))
        )
        for conc, rep in itertools.product(concs, range(args.repeats)):
            shift = rep % len(variants)
            for server, placement in variants[shift:] + variants[:shift]:
                engine = engine_core(server)
                name = f"{server.name} {placement}"
                # the same prompts for every server in one placement, none seen before
                seed = run_seed(0, conc, rep * len(placements) + placements.index(placement))
                with placed(placement, engine, own):
                    row = measured(
                        engine,
                        lambda s=server, c=conc, sd=seed: bench_once(
                            s, client, bench_args, c, out, max(requests.get(c, 0), 4 * c), sd
                        ),
                    )
                row = {
                    "target": name,
                    "concurrency": conc,
                    "repeat": rep,
                    "own_core": sorted(own),
                    **row,
                }
                rows.append(row)
                (out / "own_core.json").write_text(json.dumps(rows, indent=1))
                print(
                    f"c={conc} rep={rep} {name:>24}: {row['output_throughput']:,.0f} tok/s, "
                    f"TTFT p50 {row['median_ttft_ms']:.1f} ms, "
                    f"ITL p50 {row['median_itl_ms']:.2f} ms, {row['duration']:.1f} s; "
                    f"engine core {row['engine_core']}",
                    flush=True,
                )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
