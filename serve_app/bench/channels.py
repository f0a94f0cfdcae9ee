"""What an engine frontend's stream channel costs the process that reads it, by transport.

An ingress reads a channel from each engine frontend of the pools' replicas (engine/channel.py,
engine/frontend.py): one message per engine step, with the chunks that step made for that
ingress's streams. Two transports carry it:

- `ray`     a Ray actor streaming call (every ingress before 172975b; still one on another node,
            or with direct dispatch off)
- `socket`  length-prefixed frames on the frontend's Unix socket (engine/direct.ChannelServer),
            for an ingress on the frontend's node
- `idle`    no channel: the reader waits as long as a run lasts (its process's floor)

In a Ray cluster of its own, a producer actor stands in for a frontend (the app's `Channels`
and `ChannelServer`) and a reader actor for an ingress: per run the producer puts `--streams`
chunks (each with an SSE event's worth of bytes) every `--step-ms` for `--steps` steps, and the
reader reads them. Per run: each process's CPU over the run (every thread: Ray's own
included), as cores and per message, and each chunk's lag from its put to its read (wall clocks
of one host). Each round runs every transport in turn, rotated.

    python -m serve_app.bench.channels --rounds 3 --out docs/results/channels/<machine>
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from serve_app.bench.report import write_rounds
from serve_app.bench.runner import rotated
from serve_app.bench.stats import percentiles
from serve_app.engine.channel import Channel, Channels
from serve_app.engine.direct import ChannelServer, channel_messages
from serve_app.engine.protocol import StreamChunk

TRANSPORTS = ["ray", "socket", "idle"]
# one SSE event of a streamed completion, as vLLM's OpenAI layer writes it (about this size)
EVENT = (
    'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
    '"created":1765000000,"model":"ERNIE-4.5-0.3B-PT","choices":[{"index":0,"text":" word",'
    '"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n\n'
)


def _cpu_s() -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return float(t.user + t.system)


class Producer:
    """A frontend's end: the app's channels, over a Ray call or its socket."""

    def __init__(self) -> None:
        self._channels = Channels("frontend/1")
        self._server = ChannelServer(self._channels.serve)

    async def listen(self) -> str:
        await self._server.start()
        return self._server.path

    async def channel(self, ingress_id: str) -> AsyncIterator[Any]:
        async for message in self._channels.serve(ingress_id):
            yield message

    async def produce(self, ingress_id: str, steps: int, streams: int, step_s: float) -> float:
        """Put the run's chunks on the channel to `ingress_id`; the CPU seconds it took."""
        channel: Channel | None = None
        for _ in range(1000):  # the reader opened it before asking for this run
            channel = self._channels.acquire(ingress_id)
            if channel is not None:
                break
            await asyncio.sleep(0.01)
        if channel is None:
            raise RuntimeError(f"no channel to {ingress_id}")
        started = _cpu_s()
        try:
            for step in range(steps):
                now = time.time()
                for s in range(streams):
                    chunk = StreamChunk("", 1, step + 1, 100, sent_at=now, data=EVENT)
                    channel.put(f"r{s}", chunk)
                await asyncio.sleep(step_s)
            for s in range(streams):
                channel.put(f"r{s}", None)
        finally:
            channel.streams -= 1
        return _cpu_s() - started


class Reader:
    """An ingress's end: opens the channel by one transport and reads a run from it."""

    async def read(
        self, transport: str, producer: Any, path: str, steps: int, streams: int, step_s: float
    ) -> dict[str, Any]:
        import ray

        started, cpu = time.perf_counter(), _cpu_s()
        if transport == "idle":
            await asyncio.sleep(steps * step_s)
            return _run(transport, time.perf_counter() - started, _cpu_s() - cpu, 0, [], 0.0)
        ingress_id = f"reader-{transport}-{time.time_ns()}"  # a channel of its own per run
        messages: AsyncIterator[Any]
        if transport == "socket":
            messages, close = await channel_messages(path, ingress_id)
        else:
            call = producer.channel.options(num_returns="streaming").remote(ingress_id)
            messages, close = _values(call), lambda: ray.cancel(call)
        await anext(messages)  # the hello
        started, cpu = time.perf_counter(), _cpu_s()
        producing = producer.produce.remote(ingress_id, steps, streams, step_s)
        lags: list[float] = []
        count, ends = 0, 0
        async for batch in messages:
            got = time.time()
            count += 1
            for _, chunk in batch:
                if chunk is None:
                    ends += 1
                else:
                    lags.append((got - chunk.sent_at) * 1e3)
            if ends == streams:
                break
        wall, used = time.perf_counter() - started, _cpu_s() - cpu
        close()
        return _run(transport, wall, used, count, lags, await producing)


def _run(
    transport: str, wall: float, cpu: float, messages: int, lags: list[float], producer: float
) -> dict[str, Any]:
    return {
        "transport": transport,
        "wall_s": wall,
        "messages": messages,
        "chunks": len(lags),
        "reader_cores": cpu / wall,
        "reader_us_per_message": cpu / messages * 1e6 if messages else None,
        "producer_cores": producer / wall,
        "lag_ms": percentiles(lags),
    }


async def _values(call: Any) -> AsyncIterator[Any]:
    async for ref in call:
        yield await ref


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: every run, and the reader's CPU over `ray`'s of the same round."""
    base = {r["round"]: r["reader_cores"] for r in rows if r["transport"] == "ray"}
    lines = [
        "| round | transport | messages | reader cores | reader µs/message | producer cores "
        "| lag ms p50 / p99 | reader cores ÷ ray |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = r["reader_us_per_message"]
        lag = r["lag_ms"]
        lags = "" if lag["p50"] is None else f"{lag['p50']:.2f} / {lag['p99']:.2f}"
        idle = r["transport"] == "idle"
        ratio = None if idle or not base.get(r["round"]) else r["reader_cores"] / base[r["round"]]
        producer = "" if idle else f"{r['producer_cores']:.3f}"
        lines.append(
            f"| {r['round']} | {r['transport']} | {r['messages']} | {r['reader_cores']:.3f} | "
            f"{'' if per is None else f'{per:.0f}'} | {producer} | {lags} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} |"
        )
    return "\n".join(lines)


def measure(rounds: int, steps: int, streams: int, step_s: float) -> list[dict[str, Any]]:
    import ray

    producer: Any = ray.remote(num_cpus=0)(Producer).remote()
    reader: Any = ray.remote(num_cpus=0)(Reader).remote()
    path = ray.get(producer.listen.remote())
    rows: list[dict[str, Any]] = []
    for n in range(rounds):
        for transport in rotated(TRANSPORTS, n):
            run = ray.get(reader.read.remote(transport, producer, path, steps, streams, step_s))
            rows.append({"round": n, **run})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    return sorted(rows, key=lambda r: (r["round"], TRANSPORTS.index(r["transport"])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.bench.channels", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="engine steps per run")
    parser.add_argument("--streams", type=int, default=16, help="chunks per step")
    parser.add_argument("--step-ms", type=float, default=5.0, help="one engine step")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from serve_app.cli import start_local_ray

    start_local_ray(haproxy=False, log_to_driver=False)
    import ray

    try:
        rows = measure(args.rounds, args.steps, args.streams, args.step_ms / 1e3)
    finally:
        ray.shutdown()
    report = table(rows)
    print(report)
    if args.out is not None:
        write_rounds(args.out, "channels", args, rows, report)
    return 0


if __name__ == "__main__":
    # Ray pickles the actors' classes by reference to an importable module, not __main__
    from serve_app.bench import channels

    sys.exit(channels.main())
