"""Starting and stopping the servers benchmarks and tests compare: `vllm serve` from a profile.

`vllm_serve` starts vLLM's own OpenAI server with a profile's engine arguments as flags, on
127.0.0.1, served under the name the app gives the model; `wait_ok` polls a readiness URL and
`stop_process` ends what was started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from serve_app.app import _served_name
from serve_app.engine.builtin_model import resolve_model
from serve_app.profiles import ResolvedProfile, engine_env

LOOPBACK = "127.0.0.1"


def vllm_serve_flags(profile: ResolvedProfile) -> list[str]:
    """The profile's engine arguments as `vllm serve` flags (booleans as --x / --no-x)."""
    flags = []
    for key, value in profile.engine.to_vllm_kwargs().items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]


def wait_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Poll url until 200; fail at once if the server process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy in {timeout_s} s")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    """SIGTERM, then SIGKILL after timeout_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def vllm_serve(
    profile: ResolvedProfile,
    port: int,
    log: Path,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """`vllm serve` with the profile's model and engine arguments on 127.0.0.1:port (output to
    `log`), under the model name the app serves it as; ready when /health answers 200."""
    cmd = [
        sys.executable, "-m", "serve_app.bench.vllm_cli", "serve", resolve_model(profile.model),
        "--host", LOOPBACK, "--port", str(port),
        "--served-model-name", _served_name(profile.model),
        *vllm_serve_flags(profile), *(extra_args or []),
    ]  # fmt: skip
    env = {**os.environ, **engine_env(profile), **(extra_env or {})}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
