"""How late an idle asyncio loop's 10 ms timer fires, over SECONDS: a process that waits for a
core shows it here. The goodput bench's own client-lag probe (serve_app.bench.runner.LoopLag),
alone in a process. Prints one JSON line (ms: p50, p90, p99, max; how many waits were over
100 ms). From the repository root, with the venv of `make run`:

    .venv/bin/python docs/results/goodput/loop_lag_probe.py 45
"""

import asyncio
import contextlib
import json
import sys

from serve_app.bench.runner import LoopLag


async def main(seconds: float) -> None:
    lag = LoopLag()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(lag.sample_forever(), seconds)
    over = sum(ms > 100 for ms in lag.late_ms)
    print(json.dumps({"n": len(lag.late_ms), **lag.summary(), "over100": over}))


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1])))
