"""A vLLM general plugin (entry point `vllm.general_plugins`): vLLM loads it in each of an
engine's processes. It acts only where `SERVE_APP_ENGINE_CORE_SPIN_S` is set, and only in the
engine core, so a `vllm serve` in the same environment is untouched.

vLLM's engine core waits for its workers' output on a shared-memory queue, spinning with
sched_yield for a second after each read (`SpinCondition`, busy_loop_s 1, not configurable)
before it sleeps on the queue's notification socket. Alone on a core that is the fastest wait.
Where it shares a core with the serving path, each yield hands the core to whichever serving
process is runnable, and the step's output waits until that process blocks or its slice ends.
`SERVE_APP_ENGINE_CORE_SPIN_S` sets how long the engine core spins instead; at 0 it sleeps from
the first empty read and is woken by the worker's notification, as a freshly woken task, which
the kernel's scheduler runs ahead of the task it interrupts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Any

logger = logging.getLogger(__name__)

ENGINE_CORE_SPIN_ENV = "SERVE_APP_ENGINE_CORE_SPIN_S"


def engine_core_spin_s() -> float | None:
    """How long the engine core spins for its workers' output; None: vLLM's own (1 s)."""
    raw = os.environ.get(ENGINE_CORE_SPIN_ENV, "")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENGINE_CORE_SPIN_ENV}={raw!r}: expected seconds") from None
    if value < 0:
        raise ValueError(f"{ENGINE_CORE_SPIN_ENV}={value}: expected seconds, 0 or more")
    return value


def register() -> None:
    spin_s = engine_core_spin_s()
    if spin_s is None or not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast

        condition: Any = shm_broadcast.SpinCondition
    except (ImportError, AttributeError):  # a vLLM without it spins its own way
        logger.warning("%s: this vLLM has no SpinCondition; ignored", ENGINE_CORE_SPIN_ENV)
        return
    original = condition.__init__
    if getattr(original, "serve_app_spin_s", None) is not None:  # loaded twice
        return

    def init(self: Any, is_reader: bool, *args: Any, **kwargs: Any) -> None:
        if is_reader:
            kwargs["busy_loop_s"] = spin_s
        original(self, is_reader, *args, **kwargs)

    init.serve_app_spin_s = spin_s  # type: ignore[attr-defined]
    condition.__init__ = init
    logger.info("engine core: spins %.3f s for its workers' output", spin_s)
