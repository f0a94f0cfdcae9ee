"""On a GPU: a replica killed without warning frees its GPU before the pool is back, and a
SIGTERM to `serve-app run` leaves no engine and no GPU memory behind. Also one head + tail
truncated request. Writes lifecycle.json (and the app's log) to $OUT.

    OUT=/some/dir python docs/results/gpu-lifecycle/check.py   # from the repository root

The app: docs/results/goodput/serve_config.h200.yaml reduced to its throughput pool (one GPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

OUT = Path(os.environ["OUT"])
URL = "http://127.0.0.1:8000"
POOL = "throughput"


def gpu_used_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [int(x) for x in out.split()]


def procs(app: psutil.Process, marker: str) -> list[psutil.Process]:
    found = []
    for p in app.children(recursive=True):
        try:
            if marker in " ".join(p.cmdline()) or marker in p.name():
                found.append(p)
        except psutil.Error:
            pass
    return found


def wait(pred: Any, timeout_s: float, every_s: float = 0.1) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if pred():
            return time.monotonic() - start
        time.sleep(every_s)
    return None


def ended(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def is_ready() -> bool:
    try:
        return httpx.get(f"{URL}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def serving() -> bool:
    try:
        r = httpx.post(
            f"{URL}/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            timeout=10,
        )
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    config = yaml.safe_load(Path("docs/results/goodput/serve_config.h200.yaml").read_text())
    args = config["applications"][0]["args"]
    args["profiles"] = [POOL]
    args["routing"]["priors"] = {POOL: args["routing"]["priors"][POOL]}
    config["applications"][0]["deployments"] = [{"name": "Ingress", "num_replicas": 1}]
    (OUT / "serve_config.yaml").write_text(yaml.safe_dump(config))
    result: dict[str, Any] = {"machine": "one H200, 16 cores", "gpu_mib_idle": gpu_used_mib()}
    log = (OUT / "app.log").open("w")
    app = subprocess.Popen(
        [sys.executable, "-m", "serve_app", "run", str(OUT / "serve_config.yaml")],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    parent = psutil.Process(app.pid)
    try:
        ready = wait(lambda: app.poll() is not None or is_ready(), 400, 1)
        result["ready_s"] = ready
        assert app.poll() is None and ready is not None, "the app did not start"
        result["gpu_mib_serving"] = gpu_used_mib()
        pasted = "The quick brown fox jumps over the lazy dog. " * 1500
        r = httpx.post(
            f"{URL}/v1/completions",
            timeout=60,
            json={"prompt": pasted, "max_tokens": 8, "truncate_prompt": True},
        )
        result["truncation"] = {
            "status": r.status_code,
            "usage": r.json().get("usage"),
            "header": r.headers.get("x-serve-truncated-tokens"),
        }
        (engine,) = procs(parent, "EngineCore")
        (replica,) = procs(parent, f"ServeReplica:llm:pool-{POOL}")
        result["engine_children"] = [p.name() for p in engine.children(recursive=True)]
        killed = time.monotonic()
        replica.send_signal(signal.SIGKILL)
        wait(lambda: ended(engine), 60)
        result["engine_gone_s"] = time.monotonic() - killed
        result["gpu_mib_after_kill"] = gpu_used_mib()
        freed = wait(lambda: gpu_used_mib()[0] < 2048, 60, 0.5)
        result["gpu_freed_s"] = None if freed is None else time.monotonic() - killed
        # the replacement's engine had not started when the old one's memory was free
        result["new_engines_when_freed"] = len(procs(parent, "EngineCore"))
        wait(serving, 400, 1)
        result["pool_back_s"] = time.monotonic() - killed
        seen = parent.children(recursive=True)
        app.send_signal(signal.SIGTERM)
        result["exit_code"] = app.wait(180)
        _, alive = psutil.wait_procs(seen, timeout=30)
        result["left_after_sigterm"] = [f"{p.pid} {p.name()}" for p in alive if not ended(p)]
        result["gpu_mib_after_stop"] = gpu_used_mib()
    finally:
        if app.poll() is None:
            os.killpg(app.pid, signal.SIGKILL)
        log.close()
        (OUT / "lifecycle.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
