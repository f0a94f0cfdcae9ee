"""Cores of their own for the engines: on CPU their model threads, on a GPU their engine cores.

On a CPU host an engine's model runs on OpenMP threads in its worker process, and everything
else wakes up many times per engine step: vLLM's engine core (the scheduler), the replicas, Ray,
HAProxy. Where they share the worker's cores, each wake-up delays a step, and a step is on every
stream's path. `serve-app run` therefore gives the engines cores of their own when the host has
more cores than they need: the last cores go to the engines (each pool's min replicas × its
`num_cpus`), and Ray, hence every process of the app, starts on the others. A pool replica claims
cores from that reservation when it starts its engine and has vLLM bind the engine's OpenMP
threads to them (VLLM_CPU_OMP_THREADS_BIND); the engine core and the worker's other threads stay
with the app. A claim is a lock on a file per core, held for the replica's life and released by
the kernel whenever the replica ends, so a replica that replaces another gets its cores. Once
the engine is up, its processes on those cores alone (the worker) run at Ray's own priority
rather than the replicas' nice 15 (engine/priority.py): on cores of their own they cannot starve
the app, and they no longer yield them to whatever else runs on the host, as `vllm serve`'s
worker does not.

On a GPU host the step's pace is set by vLLM's engine core instead: one Python thread that
schedules, launches the kernels and sends the outputs, busy all the time under load. Beside the
app's serving processes (4-6 cores at high concurrency) it was moved between cores 12-14 times
a second against `vllm serve`'s 2-3, and the app delivered 0.73-0.95 of `vllm serve`'s
throughput at 64 streams; pinned, 0.96-1.04 (one H100, docs/results/streaming.md). There each
pool's min replicas get one core each; the replica claims one and moves its engine core's
process, every thread, onto it (pin), at Ray's priority.

Nothing is reserved where the engines would leave the app no core (two pools on two cores), or
on a GPU host fewer than 4 per engine, nor with SERVE_APP_ENGINE_CPUS=off; a replica that finds
no free reserved core (autoscaling beyond min replicas) runs its engine unbound, as without a
reservation.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from serve_app.engine.priority import set_niceness

logger = logging.getLogger(__name__)

ENGINE_CPUS_ENV = "SERVE_APP_ENGINE_CPUS"  # the reserved cores, e.g. "6,7"; "off": none
ENGINE_CPU_LOCKS_ENV = "SERVE_APP_ENGINE_CPU_LOCKS"  # the directory of the claims' lock files
OFF = "off"


@dataclass(frozen=True)
class Layout:
    serving: list[int]  # cores of the app's processes
    engines: list[int]  # cores reserved for the engines' model threads


def plan(cpus: list[int], engine_cpus: int) -> Layout | None:
    """The engines take the last `engine_cpus` of `cpus`; None if that leaves the app none."""
    cpus = sorted(cpus)
    if engine_cpus < 1 or engine_cpus >= len(cpus):
        return None
    return Layout(serving=cpus[:-engine_cpus], engines=cpus[-engine_cpus:])


def plan_here(engine_cpus: int) -> Layout | None:
    """plan() over the cores this process may run on."""
    return plan(list(os.sched_getaffinity(0)), engine_cpus)


def cpu_list(cpus: list[int]) -> str:
    """Cores as vLLM's VLLM_CPU_OMP_THREADS_BIND and ENGINE_CPUS_ENV write them: "2,3"."""
    return ",".join(map(str, cpus))


def reserved() -> list[int]:
    """The cores `serve-app run` reserved for engines (none when off or not set)."""
    raw = os.environ.get(ENGINE_CPUS_ENV, "")
    if not raw or raw == OFF:
        return []
    return [int(c) for c in raw.split(",")]


def reservation_off() -> bool:
    return os.environ.get(ENGINE_CPUS_ENV) == OFF


class Claim:
    """Cores of the reservation held by this process (released when it ends or on release())."""

    def __init__(self, cpus: list[int], locks: list[IO[bytes]]) -> None:
        self.cpus = cpus
        self._locks = locks

    def release(self) -> None:
        for lock in self._locks:
            lock.close()
        self._locks = []


def claim(count: int, cpus: list[int], lock_dir: Path) -> Claim | None:
    """`count` of `cpus` that no other process holds, now held by this one; None if fewer are
    free (nothing is held then)."""
    held: list[IO[bytes]] = []
    got: list[int] = []
    for cpu in cpus:
        if len(got) == count:
            break
        lock = (lock_dir / f"cpu-{cpu}.lock").open("ab")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        held.append(lock)
        got.append(cpu)
    if len(got) < count:
        Claim(got, held).release()
        return None
    return Claim(got, held)


def claim_reserved(count: int) -> Claim | None:
    """`count` cores of `serve-app run`'s reservation for the engine this process is about to
    start; None where there is no reservation or no free core in it."""
    cpus = reserved()
    lock_dir = os.environ.get(ENGINE_CPU_LOCKS_ENV)
    if not cpus or not lock_dir:
        return None
    held = claim(count, cpus, Path(lock_dir))
    if held is None:
        logger.info("no free core among the engines' %s: this engine runs unbound", cpus)
    return held


def bind_engine(count: int) -> Claim | None:
    """Claim `count` reserved cores for the CPU engine this process is about to start and bind
    its OpenMP threads to them (through the environment the engine's processes inherit); None,
    and the environment untouched, where there is no reservation or no free core in it."""
    held = claim_reserved(count)
    if held is None:
        return None
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(held.cpus)
    os.environ["OMP_NUM_THREADS"] = str(count)
    logger.info("engine's model threads bound to cores %s", held.cpus)
    return held


def pin(processes: list[psutil.Process], cpus: list[int]) -> None:
    """Every thread of `processes` on `cpus`; the threads they start later follow (a thread
    starts with its creator's affinity). Processes and threads gone meanwhile are skipped."""
    for proc in processes:
        try:
            threads = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)


def favour_engine(held: Claim) -> None:
    """Run this process's children that are on the claimed cores alone at its parent's (Ray's)
    niceness; they keep their own where raising a priority is not allowed."""
    me = psutil.Process()
    parent = me.parent()
    if parent is None:
        return
    own = set(held.cpus)
    on_own = []
    for child in me.children(recursive=True):
        try:
            if set(child.cpu_affinity() or []) <= own:
                on_own.append(child)
        except psutil.Error:
            continue
    niceness = parent.nice()
    if on_own and set_niceness(on_own, niceness):
        logger.info("the engine's worker keeps its niceness (raising it to %d is not allowed)",
                    niceness)  # fmt: skip
