import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from serve_app.engine import cpu_layout
from serve_app.engine.cpu_layout import Layout, bind_engine, claim, plan

HOLD = "import sys; from pathlib import Path; from serve_app.engine.cpu_layout import claim\n"


def test_the_engines_take_the_last_cores_and_the_app_the_rest() -> None:
    assert plan([3, 0, 2, 1], 1) == Layout(serving=[0, 1, 2], engines=[3])
    assert plan([0, 1, 2, 3], 2) == Layout(serving=[0, 1], engines=[2, 3])


@pytest.mark.parametrize("engine_cpus", [0, 2, 3])
def test_nothing_is_reserved_where_the_app_would_get_no_core(engine_cpus: int) -> None:
    assert plan([0, 1], engine_cpus) is None


def test_a_core_is_claimed_by_one_process_at_a_time(tmp_path: Path) -> None:
    first = claim(1, [6, 7], tmp_path)
    second = claim(1, [6, 7], tmp_path)
    assert first is not None and second is not None
    assert (first.cpus, second.cpus) == ([6], [7])
    assert claim(1, [6, 7], tmp_path) is None  # all held
    first.release()
    third = claim(1, [6, 7], tmp_path)
    assert third is not None and third.cpus == [6]


def test_a_claim_too_big_for_what_is_free_holds_nothing(tmp_path: Path) -> None:
    held = claim(1, [6, 7], tmp_path)
    assert claim(2, [6, 7], tmp_path) is None
    assert held is not None
    held.release()
    both = claim(2, [6, 7], tmp_path)
    assert both is not None and both.cpus == [6, 7]


def test_a_claim_ends_with_its_process(tmp_path: Path) -> None:
    """A replica that dies releases its cores without running any code."""
    code = HOLD + f"h = claim(1, [5], Path({str(tmp_path)!r})); print(h.cpus, flush=True); "
    code += "sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "[5]\n"
    assert claim(1, [5], tmp_path) is None
    proc.kill()
    proc.wait()
    assert claim(1, [5], tmp_path) is not None


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, "untouched")
    yield monkeypatch


def test_an_engine_binds_to_the_cores_it_claims(clean_env: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:  # fmt: skip
    clean_env.setenv(cpu_layout.ENGINE_CPUS_ENV, "2,3")
    clean_env.setenv(cpu_layout.ENGINE_CPU_LOCKS_ENV, str(tmp_path))
    held = bind_engine(2)
    assert held is not None and held.cpus == [2, 3]
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert os.environ["OMP_NUM_THREADS"] == "2"
    held.release()


@pytest.mark.parametrize("reserved", ["", cpu_layout.OFF])
def test_without_a_reservation_the_engine_is_left_as_it_was(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, reserved: str
) -> None:
    clean_env.setenv(cpu_layout.ENGINE_CPUS_ENV, reserved)
    clean_env.setenv(cpu_layout.ENGINE_CPU_LOCKS_ENV, str(tmp_path))
    assert bind_engine(1) is None
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "untouched"


def test_an_engine_that_finds_its_cores_taken_runs_unbound(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv(cpu_layout.ENGINE_CPUS_ENV, "3")
    clean_env.setenv(cpu_layout.ENGINE_CPU_LOCKS_ENV, str(tmp_path))
    first = bind_engine(1)
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "untouched")
    assert first is not None
    assert bind_engine(1) is None  # a second replica of the pool, beyond the reservation
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "untouched"
    first.release()


def test_the_worker_on_the_claimed_cores_runs_at_rays_priority(tmp_path: Path) -> None:
    """The child on the claimed cores alone gets the parent's niceness; a child elsewhere keeps
    the replicas' 15."""
    cores = sorted(os.sched_getaffinity(0))
    own = cores[-1:]

    def child(affinity: list[int]) -> subprocess.Popen[bytes]:
        def setup() -> None:
            os.nice(15)
            os.sched_setaffinity(0, affinity)

        return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE, preexec_fn=setup)  # fmt: skip

    worker, other = child(own), child(cores)
    try:
        held = claim(1, own, tmp_path)
        assert held is not None
        cpu_layout.favour_engine(held)
        ray_niceness = psutil.Process().parent().nice()  # type: ignore[union-attr]
        expected = ray_niceness if os.geteuid() == 0 or ray_niceness >= 15 else 15
        assert psutil.Process(worker.pid).nice() == expected
        assert psutil.Process(other.pid).nice() == (15 if len(cores) > 1 else expected)
    finally:
        for proc in (worker, other):
            proc.kill()
            proc.wait()


def test_pinning_moves_every_thread_and_the_threads_started_later(tmp_path: Path) -> None:
    """As the engine core is pinned once it is up: its threads, running and yet to start, on
    the claimed core alone."""
    script = (
        "import sys, threading\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "sys.stdin.readline()\n"  # pinned now
        "t = threading.Thread(target=threading.Event().wait, daemon=True); t.start()\n"
        "print(t.native_id, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    own = sorted(os.sched_getaffinity(0))[-1:]
    try:
        proc = psutil.Process(child.pid)
        deadline = time.monotonic() + 10
        while proc.num_threads() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        cpu_layout.pin([proc], own)
        child.stdin.write("\n")
        child.stdin.flush()
        later = int(child.stdout.readline())
        threads = [t.id for t in proc.threads()]
        assert later in threads and len(threads) >= 3
        assert {tid: os.sched_getaffinity(tid) for tid in threads} == {t: set(own) for t in threads}
    finally:
        child.kill()
        child.wait()
