"""The hop bench's socket transport, summary and table (no Ray)."""

import asyncio
import time
from pathlib import Path

import pytest

from serve_app.bench.hop import connect, listen, summarize, table
from serve_app.engine.direct import receive, send
from serve_app.engine.protocol import GenerationRequest


@pytest.mark.parametrize("transport", ["socket", "tcp"])
async def test_a_kept_connection_answers_each_request_with_its_arrival_then_the_end(
    transport: str, tmp_path: Path
) -> None:
    server, address = await listen(transport, str(tmp_path / "hop.sock"))
    reader, writer = await connect(transport, address)
    try:
        for _ in range(3):  # one kept connection, calls one after another
            sent = time.time()
            send(writer, GenerationRequest("r", list(range(165)), 16))
            got = await asyncio.wait_for(receive(reader), 5)
            assert sent <= got <= time.time()
            assert await asyncio.wait_for(receive(reader), 5) is None
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


def test_summary_drops_the_first_tenth_as_warm_up() -> None:
    timings = [(100.0, 100.0, 100.0)] * 2 + [(1.0, 2.0, 3.0)] * 9 + [(3.0, 4.0, 5.0)] * 9
    s = summarize(timings)
    assert s["there"]["mean"] == 2.0 and s["first"]["mean"] == 3.0 and s["whole"]["mean"] == 4.0
    assert s["first"]["p50"] in (2.0, 4.0) and s["whole"]["p99"] == 5.0


def test_table_gives_each_transport_s_first_over_the_ingress_call_s_of_its_round() -> None:
    def row(n: int, transport: str, first: float) -> dict[str, object]:
        m = {"mean": first, "p50": first}
        return {"round": n, "transport": transport, "there": m, "first": m, "whole": m}

    text = table([row(0, "serve-grpc", 2.0), row(0, "socket", 0.5), row(1, "serve-grpc", 4.0),
                  row(1, "socket", 0.5)])  # fmt: skip
    lines = text.splitlines()
    assert lines[2].endswith("| 1.00 |") and lines[3].endswith("| 0.25 |")
    assert lines[5].endswith("| 0.12 |")  # its own round's serve-grpc, not the first round's
