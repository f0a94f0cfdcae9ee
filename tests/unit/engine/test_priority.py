import os
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from serve_app.engine.priority import CPU_ENGINE_NICENESS_ENV, cpu_engine_niceness, set_niceness

# a process whose second thread starts after it is up, as an engine's I/O threads do
TWO_THREADS = (
    "import sys, threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "print('up', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def niced_child() -> Iterator[psutil.Process]:
    """A child process of two threads at nice 15, as Ray starts its workers."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TWO_THREADS],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=lambda: os.nice(15),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def thread_niceness(proc: psutil.Process) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, t.id) for t in proc.threads()]


def test_every_thread_of_the_processes_gets_the_niceness(niced_child: psutil.Process) -> None:
    assert thread_niceness(niced_child) == [15, 15]
    assert set_niceness([niced_child], 19) == []  # anyone may lower a priority
    assert thread_niceness(niced_child) == [19, 19]


def test_raising_a_priority_needs_the_privilege(niced_child: psutil.Process) -> None:
    refused = set_niceness([niced_child], 0)
    if os.geteuid() == 0:
        assert refused == []
        assert thread_niceness(niced_child) == [0, 0]
    else:  # refused, thread by thread, and left as they were
        assert len(refused) == 2
        assert thread_niceness(niced_child) == [15, 15]


def test_a_process_gone_meanwhile_is_skipped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = psutil.Process(proc.pid)
    proc.wait()
    assert set_niceness([gone], 19) == []


def test_the_engines_niceness_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_ENGINE_NICENESS_ENV, raising=False)
    assert cpu_engine_niceness() is None  # the replica's own
    monkeypatch.setenv(CPU_ENGINE_NICENESS_ENV, "0")
    assert cpu_engine_niceness() == 0
    monkeypatch.setenv(CPU_ENGINE_NICENESS_ENV, "19")
    assert cpu_engine_niceness() == 19
    for bad, says in (("high", "expected an integer"), ("20", "between -20 and 19")):
        monkeypatch.setenv(CPU_ENGINE_NICENESS_ENV, bad)
        with pytest.raises(ValueError, match=says):
            cpu_engine_niceness()
