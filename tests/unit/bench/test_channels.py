"""The channel bench's reader and producer in one process (its socket transport, the app's
ChannelServer), and its table."""

import asyncio
from typing import Any

from serve_app.bench.channels import Producer, Reader, table


class _Handle:
    """`handle.method.remote(...)` on an object here: a task."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._target, name)

        class _Method:
            @staticmethod
            def remote(*args: Any) -> "asyncio.Task[Any]":
                return asyncio.ensure_future(method(*args))

        return _Method


async def test_a_socket_run_reads_every_chunk_of_every_step() -> None:
    producer = Producer()
    path = await producer.listen()
    run = await Reader().read("socket", _Handle(producer), path, 20, 3, 0.001)
    assert run["chunks"] == 20 * 3
    assert run["messages"] >= 20  # one per step at least (the ends may come in one more)
    assert run["lag_ms"]["p50"] is not None and run["lag_ms"]["p50"] >= 0


def test_the_table_gives_each_transport_s_reader_cpu_over_ray_s_of_its_round() -> None:
    lag = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
    none = {"p50": None, "p90": None, "p99": None}
    common = {"round": 0, "wall_s": 1.0, "chunks": 10}
    rows = [
        common | {"transport": "ray", "messages": 10, "reader_cores": 0.2,
                  "reader_us_per_message": 20000.0, "producer_cores": 0.1, "lag_ms": lag},
        common | {"transport": "socket", "messages": 10, "reader_cores": 0.05,
                  "reader_us_per_message": 5000.0, "producer_cores": 0.05, "lag_ms": lag},
        common | {"transport": "idle", "messages": 0, "reader_cores": 0.01,
                  "reader_us_per_message": None, "producer_cores": 0.0, "lag_ms": none},
    ]  # fmt: skip
    lines = table(rows).splitlines()
    assert lines[2].endswith("| 1.00 |")
    assert lines[3].endswith("| 0.25 |")
    assert lines[4] == "| 0 | idle | 0 | 0.010 |  |  |  |  |"
