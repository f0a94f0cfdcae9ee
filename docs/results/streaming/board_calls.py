"""CPU per call to the pool-state board, per way of calling it (Serve's gRPC transport with
its default serializer or the standard pickler, or Ray's actor calls).

    python docs/results/streaming/board_calls.py OUT --calls 400 --repeats 3

Every ingress and engine replica calls the board four times a second (the ingress's refresh, the
replica's report); on two cores that CPU is taken from the core the engine core shares with the
serving path. Starts Ray on 127.0.0.1 with the app's Serve settings (serve_app.cli.SERVE_ENV),
deploys the board alone, then per repeat and way (in turn) makes --calls sequential calls of
each kind from a caller replica, as the ingress and the pool replicas make them (and, as
"watch", one streaming call of --calls snapshots: what a message on an open call costs), and
counts the CPU seconds of the caller and of the board. Writes OUT/board_calls.json and prints
a line per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from serve_app.cli import SERVE_ENV, SINGLE_NODE_ENV  # noqa: E402

os.environ.update({**SINGLE_NODE_ENV, **SERVE_ENV})
os.environ.pop("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", None)

import psutil  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from serve_app.engine.protocol import EngineStats, ReplicaReport  # noqa: E402
from serve_app.pool_state import IngressPost, PoolStateBoard  # noqa: E402

WAYS = {
    "grpc": {},
    "grpc-pickle": {
        "_by_reference": False,
        "request_serialization": "pickle",
        "response_serialization": "pickle",
    },
    "ray-actor-call": {"_by_reference": True},
}


class WatchedBoard(PoolStateBoard):
    """The board, plus the pools' state as a stream: what one message on an open call costs."""

    async def watch(self, messages: int) -> AsyncIterator[Mapping[str, Any]]:
        for _ in range(messages):
            yield self.snapshot()


@serve.deployment
class Caller:
    def __init__(self, board: Any) -> None:
        self._board = board

    async def run(self, way: str, kind: str, calls: int) -> tuple[float, float]:
        """CPU seconds of this process for `calls` sequential calls, and the wall time."""
        board = self._board.options(**WAYS[way])
        me = psutil.Process()
        recent = tuple(float(t) for t in range(32))  # a replica's recent TTFTs and TPOTs
        start_cpu, start = sum(me.cpu_times()[:2]), time.monotonic()
        for i in range(calls):
            if kind == "watch":  # the whole stream, one message per call counted
                async for _ in board.options(stream=True).watch.remote(calls):
                    pass
                break
            if kind == "report":
                report = ReplicaReport(
                    "p", "r1", EngineStats(1, 2, 0.5), 2048, time.time(), recent, recent
                )
                await board.report.remote(report)
            else:
                await board.exchange.remote(IngressPost("ingress-1", {"p": float(i)}))
        return sum(me.cpu_times()[:2]) - start_cpu, time.monotonic() - start


def _pid(title: str) -> int:
    for p in psutil.process_iter(["cmdline"]):
        if any(title in part for part in p.info["cmdline"] or []):
            return p.pid
    raise LookupError(title)


async def drive(board_proc: psutil.Process, args: argparse.Namespace) -> None:
    """Serve's handles need an event loop in this mode (the app's: throughput-optimized)."""
    caller = serve.get_app_handle("calls")
    for way in WAYS:  # warm-up: every way's connection set up
        await caller.run.remote(way, "exchange", 20)
    runs = []
    for rep in range(args.repeats):
        for kind in ("exchange", "report", "watch"):
            for way in WAYS:
                board_before = sum(board_proc.cpu_times()[:2])
                caller_cpu, wall = await caller.run.remote(way, kind, args.calls)
                board_cpu = sum(board_proc.cpu_times()[:2]) - board_before
                row = {
                    "repeat": rep,
                    "kind": kind,
                    "way": way,
                    "calls": args.calls,
                    "caller_cpu_ms_per_call": caller_cpu / args.calls * 1e3,
                    "board_cpu_ms_per_call": board_cpu / args.calls * 1e3,
                    "wall_ms_per_call": wall / args.calls * 1e3,
                }
                runs.append(row)
                print(
                    f"rep={rep} {kind:>8} {way:>14}: caller {row['caller_cpu_ms_per_call']:.2f}"
                    f" ms CPU/call, board {row['board_cpu_ms_per_call']:.2f}, "
                    f"wall {row['wall_ms_per_call']:.2f} ms/call",
                    flush=True,
                )
                (args.out / "board_calls.json").write_text(json.dumps(runs, indent=1))
    await serve.shutdown_async()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        board = serve.deployment(WatchedBoard).options(name="board").bind(["p"])
        serve.run(Caller.bind(board), name="calls", route_prefix=None)
        board_proc = psutil.Process(_pid("ServeReplica:calls:board"))
        asyncio.run(drive(board_proc, args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
