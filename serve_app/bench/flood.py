"""Overload benchmark: a burst far above capacity; how fast are refusals, how are the admitted?

    python -m serve_app.bench.flood --url http://127.0.0.1:8000 --requests 160 [--out DIR]

Sends `--requests` concurrent completions of one SLO class at once (bounded in count and time)
and reports: how many were admitted / refused, the refusals' latency (p50/p99/max), and the
admitted requests' TTFT (streamed, measured at the client) against their TTFT target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from serve_app.bench.stats import percentiles

TIMEOUT_S = 300


@dataclass
class Result:
    status: int
    latency_ms: float  # refusals: until the response; admitted: until the last byte
    ttft_ms: float | None
    retry_after: str | None


async def _one(
    session: aiohttp.ClientSession, body: dict[str, object], headers: dict[str, str]
) -> Result:
    started = time.perf_counter()
    ttft = None
    async with session.post("/v1/completions", json=body, headers=headers) as r:
        async for line in r.content:
            if ttft is None and r.status == 200 and line.startswith(b"data: "):
                ttft = (time.perf_counter() - started) * 1e3
        latency_ms = (time.perf_counter() - started) * 1e3
        return Result(r.status, latency_ms, ttft, r.headers.get("retry-after"))


async def flood(url: str, n: int, slo_class: str, max_tokens: int) -> dict[str, object]:
    body = {"prompt": "Write a story about a robot.", "max_tokens": max_tokens}
    body |= {"ignore_eos": True, "stream": True}
    headers = {"x-slo-class": slo_class}
    # aiohttp, as the harness: the client shares the cores with the server, keep it cheap
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        async with session.get("/pools") as warm:  # open one connection before the burst
            await warm.read()
        started = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(_one(session, body, headers) for _ in range(n))), TIMEOUT_S
        )
        wall_s = time.perf_counter() - started
    refused = [r.latency_ms for r in results if r.status in (429, 503)]
    served = [r for r in results if r.status == 200]
    ttfts = [r.ttft_ms for r in served if r.ttft_ms is not None]
    return {
        "requests": n,
        "slo_class": slo_class,
        "served": len(served),
        "refused": len(refused),
        "other": n - len(served) - len(refused),
        "refused_with_retry_after": sum(
            1 for r in results if r.status in (429, 503) and r.retry_after
        ),
        "refusal_ms": {**percentiles(refused), "max": max(refused, default=None)},
        "admitted_ttft_ms": {**percentiles(ttfts), "max": max(ttfts, default=None)},
        "wall_s": wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--slo-class", default="interactive")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = asyncio.run(flood(args.url, args.requests, args.slo_class, args.max_tokens))
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flood.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
