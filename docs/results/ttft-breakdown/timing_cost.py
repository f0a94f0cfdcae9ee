"""CPU cost per request of the TTFT breakdown, part by part, against the serving path's CPU
per request measured by the streaming comparison (cpu-overhead-on/streaming.json).

    .venv/bin/python docs/results/ttft-breakdown/timing_cost.py

Prints a table and writes docs/results/ttft-breakdown/timing-cost.json.
"""

from __future__ import annotations

import json
import os
import pickle
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only
from pathlib import Path
from types import SimpleNamespace

from serve_app.cli import start_local_ray
from serve_app.engine.protocol import StreamChunk
from serve_app.engine.vllm_engine import engine_stages
from serve_app.ingress import openai_format as fmt
from serve_app.ingress.metrics import IngressMetrics
from serve_app.ingress.routed import Routed
from serve_app.routing.estimator import Load
from serve_app.routing.slo import SLO
from serve_app.timing import Stage

HERE = Path(__file__).resolve().parent
N = 20_000


def per_call_us(fn: object, n: int = N) -> float:
    assert callable(fn)
    fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def proxy_costs(messages: int = 66) -> dict[str, float]:
    """The proxy hook: per request, and its send wrapper over a 64-token stream's messages."""
    import asyncio

    from serve_app.proxy_hooks import ProxyStamp

    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"x")]}
    body = {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True}

    async def app(scope: object, receive: object, send: object) -> None:
        assert callable(send)
        await send(start)
        for _ in range(messages):
            await send(body)

    async def sink(message: object) -> None:
        return None

    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")] * 4
    hooked, bare = ProxyStamp(app), app
    loop = asyncio.new_event_loop()

    def run(target: object) -> None:
        assert callable(target)
        loop.run_until_complete(target({"type": "http", "headers": list(headers)}, None, sink))

    with_hook = per_call_us(lambda: run(hooked), 5_000)
    without = per_call_us(lambda: run(bare), 5_000)
    loop.close()
    return {
        f"proxy hook: stamp, header filter, send wrapper over {messages} messages": with_hook
        - without
    }


def main() -> None:
    start_local_ray(dashboard_port=18765, metrics_port=18766, num_cpus=1, log_to_driver=False)
    out = SimpleNamespace(
        metrics=SimpleNamespace(queued_ts=1.0, scheduled_ts=1.01, first_token_ts=1.02)
    )
    remote = engine_stages(out, 0.99, 1.03) or {}
    remote[Stage.DISPATCH] = 0.5

    def ingress_side() -> None:
        r = Routed(
            "cmpl-x",
            "low-latency",
            "slo-fit",
            SLO("interactive"),
            Load(),
            10,
            100.0,
            20.0,
            100.003,
            100.0035,
            1.0,
            {},
        )
        r.first_chunk(StreamChunk("a", 1, 1, 10, sent_at=time.time(), stages=remote), 100.02)
        assert r.headers
        r.learned_ttft()

    metrics = IngressMetrics(frozenset({"interactive"}), "interactive")
    stages = {
        **remote,
        Stage.PROXY: 1.0,
        Stage.INGRESS: 2.0,
        Stage.ROUTE: 0.2,
        Stage.RETURN: 0.4,
        "ttft": 20.0,
    }
    chunk = StreamChunk("a", 1, 1, 10, sent_at=time.time())
    timed = StreamChunk("a", 1, 1, 10, sent_at=time.time(), stages=remote)
    costs = {
        "replica: engine_stages + dispatch (first chunk)": per_call_us(
            lambda: engine_stages(out, 0.99, 1.03)
        ),
        "ingress: stages, header, learning split": per_call_us(ingress_side),
        "ingress: 10 stage histogram observations": per_call_us(
            lambda: metrics.stages("low-latency", "interactive", stages), 5_000
        ),
        "ingress: usage event with server_timing, minus without": per_call_us(
            lambda: fmt.usage_event(fmt.Kind.COMPLETION, "x", 0, "m", 10, 64, stages)
        )
        - per_call_us(lambda: fmt.usage_event(fmt.Kind.COMPLETION, "x", 0, "m", 10, 64)),
        "first chunk pickled with stages, minus without": per_call_us(
            lambda: pickle.loads(pickle.dumps(timed))
        )
        - per_call_us(lambda: pickle.loads(pickle.dumps(chunk))),
    }
    costs |= proxy_costs()
    total = sum(costs.values())
    report = json.loads((HERE / "cpu-overhead-on" / "streaming.json").read_text())
    path_cpu = []
    for row in report["rows"]:
        if row["target"] != "app":
            continue
        cores = row["cpu_cores_by_role"]
        serving = sum(cores.get(k, 0.0) for k in ("serve proxy", "ingress", "pool replica"))
        requests_per_s = row["completed"] / row["duration"]
        path_cpu.append((row["concurrency"], serving / requests_per_s * 1e6))
    lines = ["| part | µs per request |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in costs.items()]
    lines.append(f"| **total** | **{total:.1f}** |")
    lines += [
        "",
        "| concurrency | serving path CPU µs per request (proxy, ingress, pool replica) | share |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {us:,.0f} | {total / us:.2%} |" for c, us in path_cpu]
    print("\n".join(lines))
    (HERE / "timing-cost.json").write_text(
        json.dumps(
            {"costs_us": costs, "total_us": total, "serving_path_us_per_request": path_cpu},
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
