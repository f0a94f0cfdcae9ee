"""How late an idle asyncio loop's 10 ms timer fires, over SECONDS: a process that waits for a
core shows it here. Prints one JSON line (ms: p50, p99, max; how many waits were over 100 ms).

    python docs/results/goodput/loop_lag_probe.py 45
"""

import asyncio
import json
import sys
import time


async def main(seconds: float) -> None:
    late, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        asked = time.perf_counter()
        await asyncio.sleep(0.01)
        late.append((time.perf_counter() - asked - 0.01) * 1e3)
    late.sort()
    n = len(late)
    summary = {"n": n, "p50": late[n // 2], "p99": late[int(n * 0.99)], "max": late[-1]}
    print(json.dumps({**summary, "over100": sum(x > 100 for x in late)}))


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1])))
