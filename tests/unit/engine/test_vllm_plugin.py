"""The vLLM plugin changes how long the engine core spins, only where asked and only there."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast

from serve_app.engine import vllm_plugin


@pytest.fixture
def condition(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SpinCondition as vLLM has it, restored after the test."""
    monkeypatch.setattr(
        shm_broadcast.SpinCondition, "__init__", shm_broadcast.SpinCondition.__init__
    )
    return shm_broadcast.SpinCondition


def spins(condition: Any, is_reader: bool) -> float:
    ctx = zmq.Context()
    try:
        return float(condition(is_reader, ctx, f"inproc://spin-{is_reader}").busy_loop_s)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    ("env", "process", "reader_spins"),
    [
        ("0", "EngineCore", 0.0),
        ("0.002", "EngineCore", 0.002),
        ("0", "VllmWorker-0", 1.0),  # only the engine core
        ("", "EngineCore", 1.0),  # unset: vLLM's own
    ],
)
def test_the_engine_core_spins_as_long_as_asked(
    condition: Any, monkeypatch: pytest.MonkeyPatch, env: str, process: str, reader_spins: float
) -> None:
    monkeypatch.setenv(vllm_plugin.ENGINE_CORE_SPIN_ENV, env)
    monkeypatch.setattr(multiprocessing.current_process(), "name", process)
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load it twice in one process
    assert spins(condition, is_reader=True) == reader_spins
    assert spins(condition, is_reader=False) == 0  # a writer never waits


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_a_bad_spin_time_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(vllm_plugin.ENGINE_CORE_SPIN_ENV, raw)
    with pytest.raises(ValueError, match=vllm_plugin.ENGINE_CORE_SPIN_ENV):
        vllm_plugin.engine_core_spin_s()
