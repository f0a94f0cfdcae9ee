"""The watchdog ends a process's descendants when that process ends, however it ends."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from serve_app.engine.watchdog import running, stop, wait_ended

# A stand-in for a replica: starts the watchdog (given a directory to remove, when asked), then a
# child (the "engine core") that ignores SIGTERM when asked, prints the pids and waits to be killed;
# asked to release, it does so once the test has a handle on both pids (a line on its stdin).
# $DOG_PERIOD_S sets the watchdog's period; $SPAWN_AFTER_S, a wait before the child starts.
REPLICA = """
import os, subprocess, sys, time
from serve_app.engine.watchdog import Watchdog
period_s = float(os.environ.get("DOG_PERIOD_S", "0.1"))
dog = Watchdog(period_s=period_s, grace_s=1.0, remove=(sys.argv[3:] or [None])[0])
time.sleep(float(os.environ.get("SPAWN_AFTER_S", "0")))
trap = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
child = subprocess.Popen([sys.executable, "-c", trap if sys.argv[1] == "stubborn" else
                          "import time; time.sleep(300)"])
time.sleep(0.5)  # one poll of the watchdog's sees the child
print(dog.pid, child.pid, flush=True)
if sys.argv[2] == "release":
    sys.stdin.readline()
    dog.release()
    print("released", flush=True)
time.sleep(300)
"""


def slow_start_env(tmp_path: Path) -> dict[str, str]:
    """Every Python started with this environment (the watchdog too) takes 1 s more to start,
    as on a loaded machine: a replica then ends, or loses its raylet, before its watchdog runs."""
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(1.0)\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def start_replica(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], psutil.Process, psutil.Process]:
    """The replica, leading a process group of its own as Ray's workers do."""
    proc = subprocess.Popen(
        [sys.executable, "-c", REPLICA, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        process_group=0,
    )
    assert proc.stdin is not None and proc.stdout is not None
    dog_pid, child_pid = map(int, proc.stdout.readline().split())
    dog, child = psutil.Process(dog_pid), psutil.Process(child_pid)
    proc.stdin.write("go\n")  # a releasing replica releases only now: both handles exist
    proc.stdin.flush()
    return proc, dog, child


def kill_and_expect_nothing_left(child: str, env: dict[str, str] | None) -> None:
    """SIGKILL a replica (no cleanup code runs in it): its engine and watchdog end."""
    proc, dog, engine = start_replica(child, "keep", env=env)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        alive = wait_ended([engine, dog], timeout_s=10)
        assert not alive, alive
    finally:
        for p in (engine, dog):
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.parametrize("slow_start", [False, True])
@pytest.mark.parametrize("child", ["polite", "stubborn"])
def test_a_killed_process_takes_its_descendants_with_it(
    child: str, slow_start: bool, tmp_path: Path
) -> None:
    kill_and_expect_nothing_left(child, slow_start_env(tmp_path) if slow_start else None)


def test_a_child_the_watchdog_had_not_seen_yet_ends_too() -> None:
    """The watchdog lists the replica's descendants once a period: a child started since (here:
    after the first, with a period of 60 s) is found in the replica's process group."""
    kill_and_expect_nothing_left(
        "polite", {**os.environ, "DOG_PERIOD_S": "60", "SPAWN_AFTER_S": "0.5"}
    )


# A stand-in for a raylet: the replica's parent, relaying the replica's line.
RAYLET = f"""
import subprocess, sys, time
replica = subprocess.Popen([sys.executable, "-c", {REPLICA!r}, "polite", "keep"],
                           stdout=subprocess.PIPE, text=True)
print(replica.pid, replica.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("slow_start", [False, True])
def test_a_replica_whose_raylet_dies_ends_with_its_engine(slow_start: bool, tmp_path: Path) -> None:
    """Ray does not stop a replica whose raylet died; the watchdog ends it and its engine."""
    env = slow_start_env(tmp_path) if slow_start else None
    raylet = subprocess.Popen(
        [sys.executable, "-c", RAYLET], stdout=subprocess.PIPE, text=True, env=env
    )
    assert raylet.stdout is not None
    replica_pid, dog_pid, child_pid = map(int, raylet.stdout.readline().split())
    procs = [psutil.Process(pid) for pid in (replica_pid, dog_pid, child_pid)]
    try:
        raylet.kill()
        raylet.wait(5)
        alive = wait_ended(procs, timeout_s=10)
        assert not alive, alive
    finally:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_release_ends_what_shutdown_left_and_the_watchdog() -> None:
    proc, dog, engine = start_replica("polite", "release")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "released"
        assert not running(engine) and not running(dog)
        assert proc.poll() is None  # the replica itself lives on
    finally:
        proc.kill()
        proc.wait(5)


def engine_dir(tmp_path: Path) -> Path:
    """A directory as an engine leaves it: a socket and a subdirectory."""
    ipc = tmp_path / "ipc"
    (ipc / "sub").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(ipc / "engine.sock"))
    return ipc


@pytest.mark.parametrize("how", ["killed", "released"])
def test_the_watchdog_removes_the_engines_directory(how: str, tmp_path: Path) -> None:
    ipc = engine_dir(tmp_path)
    proc, dog, engine = start_replica(
        "polite", "release" if how == "released" else "keep", str(ipc)
    )
    try:
        assert ipc.is_dir()  # while the engine runs
        if how == "killed":
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
        else:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "released"
        assert not wait_ended([engine, dog], timeout_s=10)
        assert not ipc.exists()
    finally:
        proc.kill()
        proc.wait(5)


def test_stop_kills_what_ignores_sigterm_and_skips_reused_pids() -> None:
    trap = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", trap])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(0.5)  # the trap is set
    ghost = psutil.Process(gone.pid)
    gone.wait(5)
    try:
        killed = stop([psutil.Process(stubborn.pid), ghost], grace_s=0.5)
        assert killed == [stubborn.pid]
        # SIGKILLed: gone within seconds even on a loaded machine (TimeoutExpired if not)
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(stubborn.pid).wait(10)
    finally:
        stubborn.kill()


def test_a_watchdog_outlives_its_object_only_while_the_pipe_is_open() -> None:
    # In a child process: a watchdog of this one would end its descendants on release, and
    # under `make test` those include the Ray cluster of the shared integration app.
    script = (
        "import psutil\n"
        "from serve_app.engine.watchdog import Watchdog\n"
        "dog = Watchdog(period_s=0.1, grace_s=0.5)\n"
        "watcher = psutil.Process(dog.pid)\n"
        "assert watcher.is_running()\n"
        "dog.release()\n"
        "assert not watcher.is_running()\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
