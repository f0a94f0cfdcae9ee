"""Ends a replica's engine processes when the replica's process ends, however it ends.

vLLM runs its engine core (and, on GPUs, its workers) as child processes of the process that
created the engine. They stop when the engine is shut down, but a replica that Serve kills
(unhealthy, timed-out graceful stop), that `ray stop` or the OOM killer ends, or that crashes
never shuts its engine down: the engine core is reparented to init and keeps the GPU's memory,
so the replacement replica fails to start. Nothing in Linux ties a child's life to its parent's
unless the child asks (PR_SET_PDEATHSIG), and vLLM's engine core does not.

So the replica starts this watchdog first, as its own process in its own session, holding the
read end of a pipe whose write end only the replica has. While the pipe is open the watchdog
keeps a list of the replica's descendants; when it reads end-of-file (the kernel closes the write
end as the replica exits, even on SIGKILL) it stops every process on the list: SIGTERM, then
SIGKILL after a grace period. It then exits itself. The replica goes on only once the watchdog
holds it (says so on its stdout), so a replica killed while the watchdog starts is still seen.
A child started since the list's last poll is missed by the list once the replica is gone (it is
reparented); a replica that leads its own process group, as Ray's workers do, has its children
in that group, where the watchdog looks as well.
A replica whose own parent (Ray's raylet) dies is cut off from Ray, which will neither use it
nor stop it, while its worker can linger for minutes: the watchdog then ends it as well, engine
first. It removes the directory it was given (`remove`: the engine's IPC sockets, which vLLM's
processes leave behind in /tmp whenever they end without cleaning up), before and after.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import time
from typing import IO

import psutil

POLL_S = 0.5
GRACE_S = 5.0


class Watchdog:
    """The replica's side: a running watchdog and the pipe's write end."""

    def __init__(
        self, period_s: float = POLL_S, grace_s: float = GRACE_S, remove: str | None = None
    ) -> None:
        pids = [str(os.getpid()), str(os.getppid())]  # this replica and its raylet
        command = [sys.executable, "-m", __name__, *pids, str(period_s), str(grace_s)]
        command += [remove] if remove else []
        # Its own session: a signal to the replica's process group does not end the watchdog
        # before it has done its work. The pipe is not inheritable, so no later child of the
        # replica keeps it open.
        self._proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
        self._pipe: IO[bytes] | None = self._proc.stdin
        assert self._proc.stdout is not None
        with self._proc.stdout as ready:  # until the watchdog holds this process (or failed)
            ready.readline()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def release(self, timeout_s: float = GRACE_S + 5) -> None:
        """Close the pipe (as the replica's exit would) and wait for the watchdog to finish."""
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _descendants(parent: psutil.Process, me: int) -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in parent.children(recursive=True) if p.pid != me}
    except psutil.Error:
        return {}


def _group(leader: int, me: int) -> dict[int, psutil.Process]:
    """The processes of the group `leader` leads (the replica's), but for the leader and this
    one."""
    found = {}
    for pid in psutil.pids():
        if pid in (me, leader):
            continue
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(pid) == leader:
                found[pid] = psutil.Process(pid)
    return found


def stop(processes: list[psutil.Process], grace_s: float) -> list[int]:
    """SIGTERM, then SIGKILL what outlives the grace period; the pids that needed SIGKILL."""
    alive = [p for p in processes if running(p)]  # psutil checks the pid was not reused
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    stubborn = wait_ended(alive, grace_s)
    for p in stubborn:
        with contextlib.suppress(psutil.Error):
            p.kill()
    wait_ended(stubborn, grace_s)
    return [p.pid for p in stubborn]


def wait_ended(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until each process is gone or a zombie (ended, but its parent has not collected
    it: an orphan's new parent may never do so in a container, and waiting for its pid to go
    would wait out the timeout); those still running. This process's own children are
    collected."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in processes if running(p)]
    while alive:
        for p in alive:
            with contextlib.suppress(psutil.Error, psutil.TimeoutExpired):
                p.wait(0)  # collects a child of this process that has ended
        alive = [p for p in alive if running(p)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return alive


def _orphaned(parent: psutil.Process, first_ppid: int) -> bool:
    """The replica's own parent (Ray's raylet, which started the worker) is gone."""
    try:
        return bool(parent.ppid() != first_ppid)
    except psutil.Error:
        return False  # the replica itself is gone: the pipe says so


def watch(
    parent_pid: int, first_ppid: int, period_s: float, grace_s: float, remove: str | None = None
) -> None:
    """Watch `parent_pid` (whose own parent was `first_ppid`) until its pipe closes; then end
    what it left running and remove the directory `remove`."""
    me = os.getpid()
    parent = psutil.Process(parent_pid)
    # a group of its own: its children are in it, even those the list has not seen yet (a group's
    # id is not reused while any process is in it)
    leads = os.getpgid(parent_pid) == parent_pid
    print("watching", flush=True)  # the replica waits for this line
    seen: dict[int, psutil.Process] = {}
    cut_off = False
    while True:
        seen |= _descendants(parent, me)  # a process that already ended is skipped at stop()
        readable, _, _ = select.select([sys.stdin.buffer], [], [], period_s)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break  # end of file: the replica closed the pipe or is gone
        if _orphaned(parent, first_ppid):
            # Ray's raylet died (node lost, `ray stop --force`): the replica is cut off from Ray
            # and will not be asked to shut down; its worker can linger for minutes holding the
            # engine. It ends too, after its engine.
            cut_off = True
            break
    if remove:  # first, in case this process is ended before the others are
        shutil.rmtree(remove, ignore_errors=True)
    if leads:
        seen |= _group(parent_pid, me)
    left = [p for p in seen.values() if running(p)]
    if left or cut_off:  # to the replica's log: what its engine's shutdown or death left running
        why = "cut off from Ray (its raylet is gone)" if cut_off else "gone"
        names = ", ".join(_describe(p) for p in [*left, *([parent] if cut_off else [])])
        print(f"serve-app watchdog: replica {parent_pid} {why}; ending {names}", file=sys.stderr)
    stop(left, grace_s)
    if cut_off:
        stop([parent], grace_s)
    if remove:  # and what they wrote there as they ended
        shutil.rmtree(remove, ignore_errors=True)


def running(p: psutil.Process) -> bool:
    """Still running: not gone, not a zombie (pid reuse is caught by psutil)."""
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()}"
    except psutil.Error:
        return str(p.pid)


if __name__ == "__main__":
    pid, ppid, period, grace, *remove = sys.argv[1:]
    watch(int(pid), int(ppid), float(period), float(grace), *remove)
