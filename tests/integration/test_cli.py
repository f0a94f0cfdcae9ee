"""The command lines users run: `serve-app run` stopped the way service managers stop it leaves
no process behind; the README's existing-cluster block works as written."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from serve_app.engine.watchdog import stop, wait_ended
from tests.integration.conftest import free_ports, haproxy_ports_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Wait up to 300 s for `serve-app run` (`proc`) to answer /ready at `url`; fail with its
    log's tail if it exited."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                break
        time.sleep(1)
    assert proc.poll() is None, log.read_text()[-2000:]


def one_pool_config(port: int) -> dict[str, object]:
    config = copy.deepcopy(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["profiles"] = ["low-latency"]
    args["routing"]["priors"] = {"low-latency": args["routing"]["priors"]["low-latency"]}
    return config


@pytest.mark.parametrize("how", ["SIGTERM", "serve shutdown"])
def test_stopping_leaves_no_engine_behind(tmp_path: Path, how: str) -> None:
    """kill, systemd, docker stop and Kubernetes send SIGTERM to the main process only: the
    engine core processes, which a terminal's Ctrl-C reaches through the process group, must
    end too. `serve shutdown` removes the app and leaves Ray running: its engines must end then,
    before Ray does; a shell's `kill -INT` (SIGINT, the handler SIGTERM has: tests/unit/
    test_cli.py) then stops the rest."""
    http, dashboard, metrics = free_ports(3)
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(one_pool_config(http)))
    cmd = [
        sys.executable, "-m", "serve_app", "run", str(config_path),
        "--dashboard-port", str(dashboard), "--metrics-port", str(metrics),
    ]  # fmt: skip
    log = (tmp_path / "run.log").open("w")
    # vLLM's IPC sockets: under a directory of the test's (short: a socket's path is limited)
    ipc = Path(tempfile.mkdtemp(prefix="ipc-"))
    env = {**os.environ, **haproxy_ports_env(), "VLLM_RPC_BASE_PATH": str(ipc)}
    if how == "serve shutdown":  # and requests by Serve's calls, direct dispatch off
        env["SERVE_APP_DIRECT_DISPATCH"] = "0"
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    seen: list[psutil.Process] = []
    try:
        wait_ready(proc, f"http://127.0.0.1:{http}", tmp_path / "run.log")
        seen = psutil.Process(proc.pid).children(recursive=True)
        engines = [p for p in seen if "EngineCore" in " ".join(p.cmdline()) + p.name()]
        assert engines, [p.name() for p in seen]
        [engine_dir] = ipc.iterdir()  # the pool's one engine, its sockets in a directory of its own
        assert any(f.is_socket() for f in engine_dir.iterdir()), list(engine_dir.iterdir())
        if how == "SIGTERM":
            assert_the_engine_has_a_core_of_its_own(seen)
        if how == "serve shutdown":
            assert_served_by_serve_calls(f"http://127.0.0.1:{http}")
            serve = str(Path(sys.executable).with_name("serve"))
            env = {**os.environ, "RAY_AUTH_MODE": "token"}
            address = f"http://127.0.0.1:{dashboard}"
            subprocess.run([serve, "shutdown", "-y", "--address", address], env=env,
                           check=True, timeout=120, capture_output=True)  # fmt: skip
            alive = wait_ended(engines, timeout_s=60)
            assert not alive and proc.poll() is None, alive  # engines gone, Ray still up
            seen = [p for p in seen if p.is_running()]
        proc.send_signal(signal.SIGINT if how == "serve shutdown" else signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "run.log").read_text()[-3000:]
        alive = wait_ended(seen, timeout_s=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
        assert not list(ipc.iterdir())  # no socket left behind
    finally:
        shutil.rmtree(ipc, ignore_errors=True)
        if proc.poll() is None:
            proc.kill()
        for p in seen:  # whatever the test found alive, it started: end it
            with contextlib.suppress(psutil.Error):
                p.kill()
        log.close()


def assert_served_by_serve_calls(url: str) -> None:
    """With SERVE_APP_DIRECT_DISPATCH=0 requests go by Serve's calls, and a stream comes whole."""
    body = {"prompt": "Tell me about Ray.", "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 8 + 1, events
        replicas = c.get("/pools").json()["low-latency"]["placement"]
    assert replicas and not any(r["direct_dispatch"] for r in replicas), replicas


def assert_the_engine_has_a_core_of_its_own(app: list[psutil.Process]) -> None:
    """One pool on a host of several cores (engine/cpu_layout.py): the engine's worker runs on
    the last core at Ray's priority; every other process of the app, on the others."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to reserve")
    workers = [p for p in app if p.name() == "VLLM::Worker"]
    assert len(workers) == 1, [p.name() for p in app]
    worker = workers[0]
    raylet = next(p for p in app if p.name() == "raylet")
    for tid in (t.id for t in worker.threads()):
        assert os.sched_getaffinity(tid) == {cores[-1]}
    # raising a priority is refused without CAP_SYS_NICE: the worker keeps the replicas' 15
    assert worker.nice() == (raylet.nice() if os.geteuid() == 0 else 15)
    for proc in app:
        if proc.pid == worker.pid:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            assert cores[-1] not in proc.cpu_affinity(), (proc.name(), proc.cpu_affinity())


def readme_block(heading: str) -> str:
    """The first bash block under a README heading, as a reader would paste it."""
    section = (ROOT / "README.md").read_text().split(f"\n## {heading}\n", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


@pytest.mark.timeout(900)
def test_readme_existing_cluster_block_runs_as_written(tmp_path: Path) -> None:
    """After `make run` has run once, Ray has a token file and turns token auth on, and a plain
    `serve deploy` failed with an authentication error: the README's block, pasted as is, must
    deploy and serve."""
    for port in (6379, 8265, 8000):  # the block uses Ray's and the config's default ports
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is taken"
    venv_bin = str(Path(sys.executable).parent)
    marker = f"readme-block-{time.time_ns()}"  # every process the block starts inherits it
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "SERVE_APP_TEST": marker}
    env.pop("RAY_AUTH_MODE", None)
    # as after `make run`: Ray's token file exists
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True, timeout=60,
                   capture_output=True)  # fmt: skip
    script = "set -euo pipefail\n" + readme_block("On an existing Ray cluster")
    try:
        done = subprocess.run(
            ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
        deadline = time.monotonic() + 400
        ready = False
        while time.monotonic() < deadline and not ready:
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get("http://127.0.0.1:8000/ready", timeout=5).status_code == 200
            time.sleep(2)
        assert ready, "the app deployed by the README's block never got ready"
        r = httpx.post(
            "http://127.0.0.1:8000/v1/completions",
            json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:  # end what the block started (and only that): `ray stop` would end every Ray
        ours = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get("SERVE_APP_TEST") == marker:
                    ours.append(p)
        stop(ours, grace_s=10)
