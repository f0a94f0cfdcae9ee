"""Micro-benchmark: microseconds per routing decision with 2, 8 and 64 pools.

    python -m serve_app.bench.policy [--out docs/results]

Times `routing.policy.decide` alone (pure function, no I/O) and `Router.decide` (views built
from snapshots + local counts, what the ingress calls per request), over a mix of SLOs and loads.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from serve_app.pool_state import PoolSnapshot
from serve_app.routing.config import LatencyPrior, RoutingConfig
from serve_app.routing.policy import RequestFeatures, decide
from serve_app.routing.router import Router
from serve_app.routing.slo import SLO

POOL_COUNTS = (2, 8, 64)
DECISIONS = 20_000
REPEATS = 5


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
            router.decide(f, s, now)
        full.append((time.perf_counter() - started) / DECISIONS * 1e6)
    return {
        "pools": n_pools,
        "policy_us": statistics.median(pure),
        "router_us": statistics.median(full),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="write policy.json/.md here")
    args = parser.parse_args()
    rows = [measure(n) for n in POOL_COUNTS]
    table = ["| pools | policy.decide (µs) | Router.decide (µs) |", "|---|---|---|"]
    table += [f"| {r['pools']} | {r['policy_us']:.1f} | {r['router_us']:.1f} |" for r in rows]
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        }
        (args.out / "policy.json").write_text(json.dumps({"rows": rows, **meta}, indent=2) + "\n")
        (args.out / "policy.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
