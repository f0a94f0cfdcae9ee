"""Direct dispatch (SERVE_APP_DIRECT_DISPATCH=1): a one-pool app whose ingress writes requests
to the pool replica over a kept Unix socket. Streams come back whole, a client that leaves
aborts its request in the engine, and errors keep their status."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from serve_app.engine.watchdog import wait_ended
from tests.integration.conftest import free_ports, haproxy_ports_env, stream_then_leave
from tests.integration.test_cli import one_pool_config, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def direct_sockets(processes: list[psutil.Process]) -> dict[int, list[str]]:
    """The direct-dispatch sockets each process holds: a listening replica holds its socket's
    path once, and once more per connection it accepted (Linux names no peer of a Unix
    socket, so the ingress's end shows no path)."""
    held: dict[int, list[str]] = {}
    for p in processes:
        with contextlib.suppress(psutil.Error):
            paths = [str(c.laddr) for c in p.net_connections(kind="unix")]
            found = [x for x in paths if "serve-app-direct-" in x]
            if found:
                held[p.pid] = found
    return held


def test_requests_go_over_the_socket_and_behave_as_over_serve(tmp_path: Path) -> None:
    http, dashboard, metrics = free_ports(3)
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(one_pool_config(http)))
    cmd = [
        sys.executable, "-m", "serve_app", "run", str(config_path),
        "--dashboard-port", str(dashboard), "--metrics-port", str(metrics),
    ]  # fmt: skip
    env = {**os.environ, **haproxy_ports_env(), "SERVE_APP_DIRECT_DISPATCH": "1"}
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    seen: list[psutil.Process] = []
    url = f"http://127.0.0.1:{http}"
    try:
        wait_ready(proc, url, tmp_path / "run.log")
        with httpx.Client(base_url=url, timeout=60) as c:
            body = {"prompt": "Tell me about Ray.", "max_tokens": 12, "ignore_eos": True}
            deadline = time.monotonic() + 30  # the first requests go by Serve while it connects
            while time.monotonic() < deadline:
                assert c.post("/v1/completions", json=body).status_code == 200
                replicas = c.get("/pools").json()["low-latency"]["placement"]
                if all(r["direct_dispatch"] for r in replicas):
                    break
                time.sleep(0.5)
            assert replicas and all(r["direct_dispatch"] for r in replicas), replicas
            seen = psutil.Process(proc.pid).children(recursive=True)
            held = direct_sockets(seen)
            # one replica, listening and with the ingress's connection
            assert [len(paths) for paths in held.values()] == [2], held
            # a whole stream, as over Serve: every token, then [DONE]
            with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                assert r.status_code == 200
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) == 12 + 1, events
            assert "dispatch;dur=" in r.headers["server-timing"]
            # the engine's refusal keeps its status and names the parameter
            r = c.post("/v1/completions", json=body | {"max_tokens": 10**6})
            assert r.status_code == 400 and "max_tokens" in r.text, r.text
            # a client that leaves mid-stream aborts its request in the engine
            long = body | {"max_tokens": 1500, "stream": True}
            running, state = stream_then_leave(c, long)
            assert running == 1 and state["running"] == 0 and state["waiting"] == 0, state
            assert c.post("/v1/completions", json=body).status_code == 200  # still serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "run.log").read_text()[-3000:]
        assert not wait_ended(seen, timeout_s=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in seen:  # whatever the test found alive, it started: end it
            with contextlib.suppress(psutil.Error):
                p.kill()
        log.close()
