"""The scheduling priority of an engine's processes on a host whose cores it shares.

Ray starts its workers, the app's replicas among them, at nice 15 (`RAY_worker_niceness`), and
the engine processes a replica starts inherit it. On a CPU host that puts the engine below
everything else there: Ray's own processes, HAProxy, any client on the same machine; `vllm
serve`'s engine runs at the priority of whoever started it. `SERVE_APP_CPU_ENGINE_NICENESS`
sets the niceness of a CPU engine's processes instead: 0 gives the engine's steps a core before
the serving path's per-token work (on two cores, one engine: 0.91-0.93 of `vllm serve`'s
throughput at concurrency 4 against 0.80-0.86, docs/results/streaming.md); 19 puts it below
the serving path. Unset, the engine keeps the replica's niceness: with two engines on two cores
at 0, a burst of 100 streams starved the replicas (at 15) of the CPU until their reports went
stale and requests were refused as if no replica were up.

Linux keeps a niceness per thread, and a thread starts with its creator's, so every thread the
engine processes have now is set, and the threads they start later follow their main thread.
Lowering a niceness needs CAP_SYS_NICE (or root); without it the processes keep their own.
"""

import logging
import os

import psutil

logger = logging.getLogger(__name__)

CPU_ENGINE_NICENESS_ENV = "SERVE_APP_CPU_ENGINE_NICENESS"


def cpu_engine_niceness() -> int | None:
    """The niceness an engine's processes run at on a CPU host; None: the replica's own."""
    raw = os.environ.get(CPU_ENGINE_NICENESS_ENV, "")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{CPU_ENGINE_NICENESS_ENV}={raw!r}: expected an integer") from None
    if not -20 <= value <= 19:
        raise ValueError(f"{CPU_ENGINE_NICENESS_ENV}={value}: a niceness is between -20 and 19")
    return value


def set_niceness(processes: list[psutil.Process], niceness: int) -> list[int]:
    """Set every thread of `processes` to `niceness`; the ids of those it was not allowed to
    change (processes gone meanwhile are skipped)."""
    refused = []
    for proc in processes:
        try:
            threads = [t.id for t in proc.threads()]
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            refused.append(proc.pid)
            continue
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:
                continue  # the thread ended
            except PermissionError:
                refused.append(tid)
    return refused


def set_engine_niceness(niceness: int) -> None:
    """Set the processes this process started (the engine's) to `niceness`, or say why not."""
    children = psutil.Process().children(recursive=True)
    refused = set_niceness(children, niceness)
    if refused:
        logger.warning(
            "could not set the engine processes' niceness to %d (lowering it needs CAP_SYS_NICE); "
            "they keep %d. Set %s to silence this.",
            niceness, os.getpriority(os.PRIO_PROCESS, 0), CPU_ENGINE_NICENESS_ENV,
        )  # fmt: skip
