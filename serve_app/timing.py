"""Where a request's first token spent its time, stage by stage (W3C `Server-Timing`).

Each stage is measured where it happens, by the process that sees both of its ends:

- `proxy`     Serve's HTTP proxy (with direct ingress, the replica's own HTTP server) received
              the request -> the ingress saw it (stamped by serve_app.proxy_hooks; absent where
              the hook is not installed)
- `ingress`   the ingress saw the request -> its prompt is tokens (body read, parse, tokenize)
- `route`     the routing decision
- `dispatch`  the ingress handed the request to a pool replica -> the replica got it (Ray hop)
- `engine_in` the replica -> vLLM's scheduler queue (input processing, IPC to the engine core)
- `queue`     waiting in vLLM's scheduler queue (vLLM's queued -> scheduled timestamps)
- `prefill`   scheduled -> first token (vLLM's timestamps)
- `engine_out` vLLM's first token -> the replica (output processing, detokenizing, IPC)
- `return`    the replica sent the first chunk -> the ingress got it (Ray hop)
- `emit`      the ingress got the first chunk -> handed its first bytes to the HTTP server
              (streams only; known after the headers left, so reported in the final event)

`ttft` is the whole, as the ingress measures it (its arrival -> first chunk back), and what the
router learns from; the stages between `ingress` and `return` add up to it. Hops between
processes (`proxy`, `dispatch`, `return`) are differences of wall clocks, exact on one node and
within the clocks' offset across nodes; the engine's stages come from vLLM's own monotonic
timestamps. All values are milliseconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from enum import StrEnum

SERVER_TIMING_HEADER = "server-timing"
# Set by the proxy hook: the proxy's wall clock when it received the request, in seconds.
PROXY_START_HEADER = "x-serve-app-proxy-start"
# A proxy stamp older than this (or from the future) is not believed: a skewed clock or a client
# that sent the header itself.
MAX_PROXY_MS = 60_000.0


class Stage(StrEnum):
    PROXY = "proxy"
    INGRESS = "ingress"
    ROUTE = "route"
    DISPATCH = "dispatch"
    ENGINE_IN = "engine_in"
    QUEUE = "queue"
    PREFILL = "prefill"
    ENGINE_OUT = "engine_out"
    RETURN = "return"
    EMIT = "emit"


TTFT = "ttft"
# Measured by the replica and its engine, carried to the ingress on the first chunk.
ENGINE_STAGES = (Stage.ENGINE_IN, Stage.QUEUE, Stage.PREFILL, Stage.ENGINE_OUT)


def format_server_timing(stages: Mapping[str, float]) -> str:
    """`name;dur=ms, ...` in the order given."""
    return ", ".join(f"{name};dur={ms:.2f}" for name, ms in stages.items())


def parse_server_timing(value: str) -> dict[str, float]:
    """A Server-Timing header's `dur` per metric name; metrics without a `dur` are skipped."""
    out: dict[str, float] = {}
    for metric in value.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params:
            key, _, raw = param.partition("=")
            if name and key.strip().lower() == "dur":
                with contextlib.suppress(ValueError):
                    out[name] = float(raw.strip().strip('"'))
    return out


# A stream carries the whole breakdown, `emit` included, as an SSE comment before its end
# (`: server-timing <header value>`): clients skip comments, so the events stay vLLM's own.
STREAM_TIMING_PREFIX = f": {SERVER_TIMING_HEADER} ".encode()


def stream_timing(stages: Mapping[str, float]) -> bytes:
    return STREAM_TIMING_PREFIX + format_server_timing(stages).encode() + b"\n\n"


def parse_stream_timing(line: bytes) -> dict[str, float] | None:
    """The breakdown from a stream's timing comment line; None for any other line."""
    if not line.startswith(STREAM_TIMING_PREFIX):
        return None
    return parse_server_timing(line[len(STREAM_TIMING_PREFIX) :].decode())


def proxy_ms(stamp: str | None, now_wall_s: float) -> float | None:
    """The proxy stage from the proxy's stamp, or None when absent or not believable."""
    if not stamp:
        return None
    try:
        ms = (now_wall_s - float(stamp)) * 1e3
    except ValueError:
        return None
    return ms if 0.0 <= ms <= MAX_PROXY_MS else None


def elapsed_ms(start: float, end: float) -> float:
    """end - start in ms, never negative (clocks of two processes may disagree slightly)."""
    return max(0.0, (end - start) * 1e3)
