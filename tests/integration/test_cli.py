"""`serve-app run` stopped the way service managers stop it leaves no process behind."""

from __future__ import annotations

import contextlib
import copy
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.integration.conftest import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def one_pool_config(port: int) -> dict[str, object]:
    config = copy.deepcopy(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["profiles"] = ["low-latency"]
    args["routing"]["priors"] = {"low-latency": args["routing"]["priors"]["low-latency"]}
    return config


def test_sigterm_leaves_no_engine_behind(tmp_path: Path) -> None:
    """kill, systemd, docker stop and Kubernetes send SIGTERM to the main process only: the
    engine core processes, which a terminal's Ctrl-C reaches through the process group, must
    end too."""
    http, dashboard, metrics = free_ports(3)
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(one_pool_config(http)))
    cmd = [
        sys.executable, "-m", "serve_app", "run", str(config_path),
        "--dashboard-port", str(dashboard), "--metrics-port", str(metrics),
    ]  # fmt: skip
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{http}/ready", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-2000:]
        seen = psutil.Process(proc.pid).children(recursive=True)
        engines = [p for p in seen if "EngineCore" in " ".join(p.cmdline()) + p.name()]
        assert engines, [p.name() for p in seen]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(seen, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in seen:  # whatever the test found alive, it started: end it
            with contextlib.suppress(psutil.Error):
                p.kill()
        log.close()
