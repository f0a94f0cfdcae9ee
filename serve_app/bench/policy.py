"""Micro-benchmark: microseconds per routing decision with 2, 8 and 64 pools, and the cost of
one poll of the requests an ingress holds.

    python -m serve_app.bench.policy [--out docs/results]

Times `routing.policy.decide` alone (pure function, no I/O) and `Router.decide` (views built
from snapshots + local counts, what the ingress calls per request), over a mix of SLOs and loads.

The poll: two pools sharing one device, `DECODING` requests streaming with a TPOT target (each a
chunk further on since the last poll) and `QUEUED` waiting for their first token, and `HELD`
requests decided again: each at its own moment (views built for every decision), or together
at one moment (the ingress's poll: one view serves them all).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from serve_app.pool_state import PoolSnapshot
from serve_app.routing.config import LatencyPrior, RoutingConfig
from serve_app.routing.estimator import Decoding, Queued
from serve_app.routing.policy import RequestFeatures, decide
from serve_app.routing.router import VIEWS_REUSE_S, Router
from serve_app.routing.slo import SLO

POOL_COUNTS = (2, 8, 64)
DECISIONS = 20_000
REPEATS = 5
DECODING, QUEUED, HELD = 230, 40, 64  # one ingress's state in an overloaded run on one H200
POLLS = 200
POLL_MS = RoutingConfig().hold_poll_ms


def _router(n_pools: int, rng: random.Random, now: float) -> Router:
    names = [f"pool-{i}" for i in range(n_pools)]
    lengths = {name: rng.choice([2048, 4096, 8192]) for name in names}
    priors = {
        name: LatencyPrior(
            ttft_base_ms=rng.uniform(10, 200), ttft_ms_per_waiting_request=rng.uniform(5, 50)
        )
        for name in names
    }
    router = Router(lengths, RoutingConfig(priors=priors))
    router.update(
        {
            name: PoolSnapshot(
                name,
                replicas=rng.randint(1, 4),
                waiting=rng.randint(0, 40),
                running=rng.randint(0, 64),
                updated_at=now,
            )
            for name in names
        }
    )
    return router


def _requests(rng: random.Random) -> list[tuple[RequestFeatures, SLO]]:
    slos = [
        SLO("interactive", 300, 50),
        SLO("standard", 2000, 100),
        SLO("batch"),
        SLO("x", 50, 10, best_effort=True),
    ]
    return [
        (RequestFeatures(rng.randint(10, 6000), rng.randint(1, 1024)), rng.choice(slos))
        for _ in range(1000)
    ]


def measure(n_pools: int) -> dict[str, float]:
    rng = random.Random(n_pools)
    now = time.time()
    router = _router(n_pools, rng, now)
    requests = _requests(rng)
    config = RoutingConfig()
    views = router.views()
    pure, full = [], []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for i in range(DECISIONS):
            f, s = requests[i % len(requests)]
            decide(f, s, views, config, now)
        pure.append((time.perf_counter() - started) / DECISIONS * 1e6)
        started = time.perf_counter()
        for i in range(DECISIONS):
            f, s = requests[i % len(requests)]
            # each at a moment of its own: views built for every decision
            router.decide(f, s, now + i % 2 * 2 * VIEWS_REUSE_S)
        full.append((time.perf_counter() - started) / DECISIONS * 1e6)
    return {
        "pools": n_pools,
        "policy_us": statistics.median(pure),
        "router_us": statistics.median(full),
    }


def _loaded_router(now: float) -> tuple[Router, list[Decoding]]:
    """Two pools on one device, DECODING requests streaming (32 chunks each) and QUEUED waiting."""
    pools = {"low-latency": 2048, "throughput": 8192}
    router = Router(pools, RoutingConfig(colocated=[list(pools)]))
    snap = {n: PoolSnapshot(n, replicas=1, running=DECODING // 2, updated_at=now) for n in pools}
    router.update(snap, now)
    decoding = []
    for i in range(DECODING):
        pool = list(pools)[i % 2]
        d = Decoding(50, 512, 20, first_at=now - 1)
        for t in range(2, 34):
            d.advance(t, now - 1 + 0.02 * t)
        router.dispatched(pool, 200)
        router.first_token(pool, 200, d)
        decoding.append(d)
    for i in range(QUEUED):
        q = Queued(50, 256, 20, 3000, now - 0.1 + i * 1e-3, ttft_deadline=now + 60)
        router.dispatched("throughput", 3000, q)
    return router, decoding


def measure_poll(together: bool) -> dict[str, float | int | bool]:
    """Seconds of an ingress's event loop one poll of HELD requests takes (median of POLLS)."""
    now = time.time()
    router, decoding = _loaded_router(now)
    doc, slo = RequestFeatures(3000, 256), SLO("standard", 30_000, 100)
    polls = []
    for poll in range(POLLS):
        at = now + poll * POLL_MS / 1e3
        for d in decoding:  # a chunk each since the last poll
            d.advance(d.tokens + 1, at)
        started = time.perf_counter()
        for i in range(HELD):
            router.decide(doc, slo, at if together else at + i * 2 * VIEWS_REUSE_S)
        polls.append(time.perf_counter() - started)
    poll_ms = statistics.median(polls) * 1e3
    return {
        "together": together,
        "decoding": DECODING,
        "queued": QUEUED,
        "held": HELD,
        "poll_ms": poll_ms,
        "decision_us": poll_ms / HELD * 1e3,
        "share_of_poll_interval": poll_ms / POLL_MS,
    }


def _machine() -> str:
    """The hardware this ran on: its CPU's model and cores."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return f"{model or platform.machine()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="write policy.json/.md here")
    args = parser.parse_args()
    rows = [measure(n) for n in POOL_COUNTS]
    table = ["| pools | policy.decide (µs) | Router.decide (µs) |", "|---|---|---|"]
    table += [f"| {r['pools']} | {r['policy_us']:.1f} | {r['router_us']:.1f} |" for r in rows]
    polls = [measure_poll(together) for together in (False, True)]
    table += [
        "",
        f"One poll of {HELD} held requests, {DECODING} decoding and {QUEUED} queued on two "
        f"pools sharing a device (poll every {POLL_MS:g} ms):",
        "",
        "| held requests decided | µs per decision | ms per poll | share of the poll interval |",
        "|---|---|---|---|",
    ]
    table += [
        f"| {'together (one view)' if p['together'] else 'each at its own moment'} "
        f"| {p['decision_us']:.1f} | {p['poll_ms']:.2f} | {p['share_of_poll_interval']:.1%} |"
        for p in polls
    ]
    ratio = polls[0]["poll_ms"] / polls[1]["poll_ms"]
    table += ["", f"Together: {ratio:.1f}x less of the event loop per poll."]
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "machine": _machine(),
            "python": platform.python_version(),
        }
        (args.out / "policy.json").write_text(
            json.dumps({"rows": rows, "polls": polls, **meta}, indent=2) + "\n"
        )
        (args.out / "policy.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
