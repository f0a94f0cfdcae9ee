"""HAProxy as Serve runs it through the launcher: its stats and Prometheus frontends moved to
loopback in the config Serve writes, and its end with the process that started it."""

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

from serve_app import haproxy_loopback
from serve_app.bench.servers import free_port

# the lines Ray 2.60's template writes (ray/serve/_private/haproxy_templates.py)
CONFIG = """\
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 0.0.0.0:8000
frontend grpc_frontend
    bind 0.0.0.0:9000 proto h2
listen stats
  bind *:8404
  stats enable
"""


def test_address_less_binds_go_to_loopback_and_the_api_bind_stays() -> None:
    out = haproxy_loopback.loopback_binds(CONFIG)
    assert "    bind 127.0.0.1:9101\n" in out and "  bind 127.0.0.1:8404\n" in out
    assert "bind 0.0.0.0:8000\n" in out and "bind 0.0.0.0:9000 proto h2\n" in out
    assert haproxy_loopback.loopback_binds(out) == out


def test_ray_s_template_still_has_the_binds_this_rewrites() -> None:
    """If Ray changes its template, this fails before a port silently opens."""
    assert "bind :{{ config.metrics_port }}" in HAPROXY_CONFIG_TEMPLATE
    assert "bind *:{{ config.stats_port }}" in HAPROXY_CONFIG_TEMPLATE


VALID = """\
defaults
    mode http
    timeout client 1s
    timeout connect 1s
    timeout server 1s
    option abortonclose
frontend prometheus
    bind :19101
    http-request use-service prometheus-exporter if { path /metrics }
listen stats
  bind *:18404
  stats enable
"""


def test_the_launcher_rewrites_in_place_then_runs_haproxy(tmp_path: Path) -> None:
    config = tmp_path / "haproxy.cfg"
    config.write_text(VALID)
    launcher = haproxy_loopback.write_launcher(tmp_path)
    assert os.access(launcher, os.X_OK)
    env = {**os.environ, haproxy_loopback.BINARY_ENV: str(launcher)}
    # -c: HAProxy checks the config and exits; the launcher must reach the real binary
    done = subprocess.run([str(launcher), "-c", "-f", str(config)], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "bind 127.0.0.1:18404" in config.read_text()
    assert "bind 127.0.0.1:19101" in config.read_text()
    assert "no option abortonclose" in config.read_text()
    output = done.stdout + done.stderr
    assert "Configuration file is valid" in output, output[-500:]


def test_abort_on_close_is_turned_off_and_the_rest_kept() -> None:
    config = "defaults\n    mode http\n    option abortonclose\n    option splice-request\n"
    out = haproxy_loopback.without_abort_on_close(config)
    assert out == "defaults\n    mode http\n    no option abortonclose\n    option splice-request\n"
    assert haproxy_loopback.without_abort_on_close(out) == out


def test_ray_s_template_still_sets_abort_on_close() -> None:
    """If Ray drops the option from its template, this fails and the rewrite can go."""
    assert "    option abortonclose\n" in HAPROXY_CONFIG_TEMPLATE


# Starts the launcher as Serve's HAProxy manager would, says HAProxy's pid, then waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.argv[1], "-db", "-f", sys.argv[2]])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_haproxy_ends_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    """Ray kills Serve's HAProxy manager outright when it stops: the HAProxy it started must
    not live on under init, holding its ports."""
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "defaults\n    mode http\n    timeout client 1s\n    timeout connect 1s\n"
        f"    timeout server 1s\nfrontend http_frontend\n    bind 127.0.0.1:{port}\n"
    )
    launcher = haproxy_loopback.write_launcher(tmp_path)
    env = {**os.environ, haproxy_loopback.BINARY_ENV: str(launcher)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(launcher), str(config)],
                              env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    haproxy = None
    try:
        assert parent.stdout is not None
        haproxy = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _listening(port):
            time.sleep(0.1)
        assert _listening(port), "HAProxy did not start"
        assert haproxy.is_running() and haproxy.ppid() == parent.pid
        parent.kill()
        parent.wait()
        _, alive = psutil.wait_procs([haproxy], timeout=10)
        assert not alive, "HAProxy outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if haproxy is not None:
            with contextlib.suppress(psutil.Error):
                haproxy.kill()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
