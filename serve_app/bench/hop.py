"""What one hop between two serving processes costs, by transport.

A request's `dispatch` stage (serve_app/timing.py) is one Serve streaming call from the ingress
to a pool replica, with the ingress's handle options (gRPC transport, pickled); `return` is the
first chunk's way back. This bench times that call alone, in a Ray cluster of its own on
loopback with the app's Serve settings, beside the transports a faster dispatch could use
instead, from one Serve replica (the caller, as the ingress) to another process:

- `serve-grpc`  the ingress's call: a Serve handle, stream, gRPC, pickle
- `serve-ref`   the same call over Serve's by-reference transport (a Ray actor call)
- `ray-actor`   a plain Ray actor streaming call (what Serve's router and replica add on top)
- `socket`      a length-prefixed pickle over one kept Unix socket to the callee replica (a
                floor for any Python transport between two processes)
- `tcp`         the same over one kept TCP connection on loopback (what reaches another node)

Every call carries the same request (a GenerationRequest of `--prompt-tokens` token ids) and
gets two items back (the first, then the end), as a dispatched request does. Per call: `there`
(sent → the callee's handler started: wall clocks of one host), `first` (sent → first item back)
and `whole` (the whole call). Calls run one after another; each round runs every transport in
turn (rotated), and its first tenth of calls are dropped as warm-up.

    python -m serve_app.bench.hop --calls 300 --rounds 3 --out docs/results/hop/<machine>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from serve_app.bench.report import write_rounds
from serve_app.bench.runner import rotated
from serve_app.bench.stats import percentiles
from serve_app.engine.direct import receive, send
from serve_app.engine.protocol import GenerationRequest

TRANSPORTS = ["serve-grpc", "serve-ref", "ray-actor", "socket", "tcp"]
CONNECTIONS = ("socket", "tcp")
MEASURES = ["there", "first", "whole"]
Timing = tuple[float, float, float]  # there, first, whole (ms)


async def reply(request: GenerationRequest) -> AsyncIterator[float | None]:
    """The callee's answer: when it got the request (its first item), then the end."""
    got = time.time()
    yield got
    await asyncio.sleep(0)
    yield None


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The callee's end of one kept connection: each request's items, as they come."""
    try:
        while True:
            request = await receive(reader)
            async for item in reply(request):
                send(writer, item)
            await writer.drain()
    except asyncio.IncompleteReadError:  # the caller closed its end
        writer.close()


async def listen(transport: str, path: str) -> tuple[asyncio.AbstractServer, str | int]:
    """A server for `socket` (on the Unix socket `path`) or `tcp` (on a free loopback port),
    and where to connect to it."""
    if transport == "socket":
        return await asyncio.start_unix_server(answer, path), path
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def connect(transport: str, address: str | int) -> tuple[Any, Any]:
    if transport == "socket":
        return await asyncio.open_unix_connection(str(address))
    return await asyncio.open_connection("127.0.0.1", int(address))


def summarize(timings: list[Timing]) -> dict[str, dict[str, float | None]]:
    """Mean and percentiles of each measure, after the first tenth (warm-up)."""
    kept = timings[len(timings) // 10 :]
    out: dict[str, dict[str, float | None]] = {}
    for i, name in enumerate(MEASURES):
        values = [t[i] for t in kept]
        out[name] = {"mean": statistics.mean(values) if values else None, **percentiles(values)}
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each transport's mean (p50) per measure in each round, and its mean `first`
    over serve-grpc's of the same round."""
    base = {r["round"]: r["first"]["mean"] for r in rows if r["transport"] == "serve-grpc"}
    lines = [
        "| round | transport | there ms mean (p50) | first ms mean (p50) | whole ms mean (p50) "
        "| first ÷ serve-grpc |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{r[m]['mean']:.3f} ({r[m]['p50']:.3f})" for m in MEASURES]
        ratio = r["first"]["mean"] / base[r["round"]] if base.get(r["round"]) else None
        lines.append(
            f"| {r['round']} | {r['transport']} | "
            + " | ".join(cells)
            + f" | {'' if ratio is None else f'{ratio:.2f}'} |"
        )
    return "\n".join(lines)


def _deployments(socket_path: str) -> tuple[Any, Any]:
    """The callee and caller deployments (built after Ray is imported with the app's settings)."""
    import ray
    from ray import serve

    @serve.deployment(max_ongoing_requests=256)
    class HopCallee:
        def __init__(self) -> None:
            self._listening: dict[str, tuple[asyncio.AbstractServer, str | int]] = {}

        async def call(self, request: GenerationRequest) -> AsyncIterator[float | None]:
            async for item in reply(request):
                yield item

        async def listen(self, transport: str) -> str | int:
            if transport not in self._listening:
                self._listening[transport] = await listen(transport, socket_path)
            return self._listening[transport][1]

    @ray.remote(num_cpus=0)
    class HopActor:
        async def call(self, request: GenerationRequest) -> AsyncIterator[float | None]:
            async for item in reply(request):
                yield item

    @serve.deployment
    class HopCaller:
        def __init__(self, callee: Any) -> None:
            self._callee = callee
            self._actor = HopActor.remote()  # type: ignore[attr-defined]
            self._connections: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

        async def run(self, transport: str, calls: int, prompt_tokens: int) -> list[Timing]:
            request = GenerationRequest("hop", list(range(prompt_tokens)), 16)
            if transport in CONNECTIONS and transport not in self._connections:
                address = await self._callee.listen.remote(transport)
                self._connections[transport] = await connect(transport, address)
            timings = []
            for _ in range(calls):
                timings.append(await self._one(transport, request))
            return timings

        async def _one(self, transport: str, request: GenerationRequest) -> Timing:
            sent = time.time()
            if transport in CONNECTIONS:
                reader, writer = self._connections[transport]
                send(writer, request)
                got = await receive(reader)
                first = time.time()
                while await receive(reader) is not None:
                    pass
            else:
                items = self._stream(transport, request)
                got = await anext(items)
                first = time.time()
                async for _ in items:
                    pass
            done = time.time()
            return ((got - sent) * 1e3, (first - sent) * 1e3, (done - sent) * 1e3)

        def _stream(self, transport: str, request: GenerationRequest) -> AsyncIterator[Any]:
            if transport == "ray-actor":
                refs = self._actor.call.options(num_returns="streaming").remote(request)
                return _resolved(refs)
            by_reference = transport == "serve-ref"
            options: dict[str, Any] = {"stream": True, "_by_reference": by_reference}
            if not by_reference:  # as the ingress calls its pools (ingress/api.py)
                options |= {"request_serialization": "pickle", "response_serialization": "pickle"}
            return aiter(self._callee.options(**options).call.remote(request))

    return HopCallee, HopCaller


async def _resolved(refs: Any) -> AsyncIterator[Any]:
    async for ref in refs:
        yield await ref


async def measure(calls: int, rounds: int, prompt_tokens: int) -> list[dict[str, Any]]:
    from ray import serve

    serve.start(proxy_location="Disabled")
    workdir = tempfile.mkdtemp(prefix="serve-app-hop-")
    callee, caller = _deployments(os.path.join(workdir, "hop.sock"))
    handle = serve.run(caller.bind(callee.bind()), name="hop", route_prefix=None)
    rows = []
    try:
        for n in range(rounds):
            for transport in rotated(TRANSPORTS, n):
                timings = await handle.run.remote(transport, calls, prompt_tokens)
                rows.append({"round": n, "transport": transport, **summarize(timings)})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        await serve.shutdown_async()  # on this loop: the handle's router runs on it
    return sorted(rows, key=lambda r: (r["round"], TRANSPORTS.index(r["transport"])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.bench.hop", description=__doc__)
    parser.add_argument("--calls", type=int, default=300, help="calls per transport per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=165)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from serve_app.cli import start_local_ray

    start_local_ray(haproxy=False, log_to_driver=False)
    import ray

    try:
        rows = asyncio.run(measure(args.calls, args.rounds, args.prompt_tokens))
    finally:
        ray.shutdown()
    report = table(rows)
    print(report)
    if args.out is not None:
        write_rounds(args.out, "hop", args, rows, report)
    return 0


if __name__ == "__main__":
    # Ray pickles the deployments' functions by reference to an importable module, not __main__
    from serve_app.bench import hop

    sys.exit(hop.main())
