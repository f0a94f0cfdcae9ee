"""Starting and stopping the servers benchmarks and tests compare, from one profile.

`vllm_serve` starts vLLM's own OpenAI server with a profile's engine arguments as flags, on
127.0.0.1, served under the name the app gives the model; `servers` starts it beside the app
(`serve-app run`) with that profile as the app's only pool; `stop_process` ends what was
started.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from serve_app.app import _served_name
from serve_app.cli import wait_ok
from serve_app.engine.builtin_model import resolve_model
from serve_app.engine.cpu_layout import cpu_list, plan_here
from serve_app.profiles import (
    Platform,
    ResolvedProfile,
    detect_platform,
    engine_env,
    engine_threads,
    find_profile,
    load_profile,
    profiles_dir,
)

ROOT = Path(__file__).resolve().parents[2]

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


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    """SIGTERM, then SIGKILL after timeout_s."""
    stop_processes([proc], timeout_s)


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 120) -> None:
    """SIGTERM to every one first, then wait for each, SIGKILL after timeout_s: they stop
    together, and an interruption while waiting (a second SIGTERM, Ctrl-C) leaves none of them
    running unsignalled."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def vllm_serve(
    profile: ResolvedProfile,
    port: int,
    log: Path,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
    cpu_layout: bool = True,
) -> subprocess.Popen[bytes]:
    """`vllm serve` with the profile's model and engine arguments on 127.0.0.1:port (output to
    `log`), under the model name the app serves it as; ready when /health answers 200. On a CPU
    host, with `cpu_layout`, in the layout `serve-app run` gives a one-pool app there: the
    engine's model threads on cores of their own, every other process on the rest."""
    cmd = [
        sys.executable, "-m", "serve_app.bench.vllm_cli", "serve", resolve_model(profile.model),
        "--host", LOOPBACK, "--port", str(port),
        "--served-model-name", _served_name(profile.model),
        *vllm_serve_flags(profile), *(extra_args or []),
    ]  # fmt: skip
    env = {**os.environ, **engine_env(profile)}
    layout = None
    if cpu_layout and profile.platform is Platform.CPU:
        layout = plan_here(engine_threads(profile))
    if layout is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(layout.engines)
    env.update(extra_env or {})
    serving = layout.serving if layout is not None else None
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=None if serving is None else lambda: os.sched_setaffinity(0, serving),
        )  # fmt: skip


def _bench_profile(profile_path: Path, out_dir: Path) -> Path:
    """The profile with its pool fixed at one replica that takes every request at once."""
    raw = yaml.safe_load(profile_path.read_text())
    raw["pool"] = {
        **raw.get("pool", {}),
        "min_replicas": 1,
        "max_replicas": 1,
        "max_ongoing_requests": 4096,
        "target_waiting_per_replica": None,
    }
    path = out_dir / profile_path.name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _app_config(
    profile: str, profiles: Path, port: int, server_timing: bool = True
) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["server_timing"] = server_timing
    args["profiles"] = [profile]
    args["profiles_dir"] = str(profiles)
    args["routing"]["default_class"] = "batch"
    args["routing"]["max_waiting_per_replica"] = 100_000
    args["routing"]["priors"] = {k: v for k, v in args["routing"]["priors"].items() if k == profile}
    return config


# Ports for the servers started here (the bench's, the tests') come from below the kernel's
# ephemeral range, which every outgoing connection (Ray's processes open many as they start)
# takes its local port from: a port picked there can be taken by a connection before the server
# binds it. Ray's own worker ports are 10002-19999 by default.
LISTEN_PORTS = range(20_000, 32_768)


def _ephemeral_ports() -> range:
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    return range(32_768, 61_000)


def free_ports(n: int) -> list[int]:
    """n distinct free ports outside the ephemeral range: all bound at once, so none is handed
    out twice."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in LISTEN_PORTS if p not in ephemeral]
    sockets: list[socket.socket] = []
    try:
        for port in random.sample(candidates, len(candidates)):
            if len(sockets) == n:
                break
            s = socket.socket()
            try:
                s.bind((LOOPBACK, port))
            except OSError:  # in use
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < n:
            raise RuntimeError(f"fewer than {n} free ports in {LISTEN_PORTS}")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    return free_ports(1)[0]


def vllm_variants(vllm_args: list[str], api_servers: list[int]) -> list[tuple[str, list[str]]]:
    """(target name, `vllm serve` flags) per configuration of vLLM's server to compare: one
    per API-server count when given, else one."""
    if not api_servers:
        return [("vllm serve", vllm_args)]
    return [(f"vllm serve x{n}", [*vllm_args, f"--api-server-count={n}"]) for n in api_servers]


@contextmanager
def servers(
    profile_name: str,
    ports: tuple[int, int, int, int],
    log_dir: Path,
    app_env: dict[str, str],
    vllm_env: dict[str, str],
    vllm_args: list[str],
    app_args: list[str] | None = None,
    fallback_proxy: bool = False,
    direct_ingress: bool = False,
    server_timing: bool = True,
    api_servers: list[int] | None = None,
    vllm_cpu_layout: bool = True,
    with_vllm: bool = True,
) -> Iterator[tuple[list[Server], ResolvedProfile]]:
    """`vllm serve` (one per API-server count in `api_servers`, else one; none without
    `with_vllm`) and the app
    (`serve-app run` with `app_args`), ready; all stopped on exit. Targets: every `vllm serve`,
    the app at its address, with fallback_proxy Serve's proxy that HAProxy falls back to, with
    direct_ingress the app's ingress replica's own port; `vllm_cpu_layout`: `vllm serve` in the
    app's CPU layout (see vllm_serve)."""
    vllm_port, app_port, dashboard_port, metrics_port = ports
    source = find_profile(profile_name, profiles_dir())
    profiles = Path(tempfile.mkdtemp(prefix="bench-profiles-"))
    bench_path = _bench_profile(source, profiles)
    profile = load_profile(bench_path).resolve(detect_platform())
    config_path = profiles / "serve_config.yaml"
    app_config = _app_config(profile.name, profiles, app_port, server_timing)
    config_path.write_text(yaml.safe_dump(app_config))
    app_cmd = [
        sys.executable, "-m", "serve_app", "run", str(config_path), "--port", str(app_port),
        "--dashboard-port", str(dashboard_port), "--metrics-port", str(metrics_port),
        *(app_args or []),
    ]  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[subprocess.Popen[bytes]] = []
    targets: list[Server] = []
    with (log_dir / "app.log").open("wb") as alog:
        try:
            # vLLM sizes its KV cache from the memory free while it profiles, which another
            # engine starting on the same GPU at that moment makes wrong (it then finds none):
            # one after the other, unless the profile fixes the KV cache's size.
            together = profile.engine.kv_cache_memory_bytes is not None
            variants = vllm_variants(vllm_args, api_servers or []) if with_vllm else []
            for n, (name, flags) in enumerate(variants):
                port = vllm_port if n == 0 else free_port()
                log = log_dir / f"{name.replace(' ', '-')}.log"
                proc = vllm_serve(profile, port, log, flags, vllm_env, vllm_cpu_layout)
                started.append(proc)
                targets.append(Server(name, f"http://{LOOPBACK}:{port}", proc))
                if not together:
                    wait_ok(f"{targets[-1].url}/health", 900, proc=proc)
            app = subprocess.Popen(
                app_cmd, env={**os.environ, **app_env}, stdout=alog, stderr=subprocess.STDOUT
            )
            started.insert(0, app)
            for server in targets if together else []:
                wait_ok(f"{server.url}/health", 900, proc=server.proc)
            wait_ok(f"http://{LOOPBACK}:{app_port}/ready", 900, proc=app)
            targets.append(Server("app", f"http://{LOOPBACK}:{app_port}", app))
            if fallback_proxy:
                fallback = f"http://{LOOPBACK}:{FALLBACK_PROXY_PORT}"
                wait_ok(f"{fallback}/ready", 60, proc=app)
                targets.append(Server("app serve-proxy", fallback, app))
            if direct_ingress:
                targets.append(Server("app direct", direct_ingress_url(app.pid), app))
            yield targets, profile
        finally:
            stop_processes(started)


# Behind HAProxy, Serve's proxy stays up as HAProxy's fallback on this port (Ray's default).
FALLBACK_PROXY_PORT = 8500
# Serve's direct ingress gives each ingress replica its own HTTP port from this range.
DIRECT_INGRESS_PORTS = range(30000, 31001)


def direct_ingress_urls(processes: Iterable[psutil.Process]) -> list[str]:
    """The HTTP address of every ingress replica among `processes` under Serve's direct ingress
    (each ingress replica serves HTTP on a port of its own), sorted."""
    urls = []
    for proc in processes:
        try:
            if "ServeReplica:llm:Ingress" not in " ".join(proc.cmdline()):
                continue
            ports = [
                c.laddr.port
                for c in proc.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port in DIRECT_INGRESS_PORTS
            ]
        except psutil.Error:
            continue
        urls += [f"http://{LOOPBACK}:{port}" for port in ports]
    return sorted(urls)


def direct_ingress_url(app_root: int, timeout_s: float = 60) -> str:
    """The HTTP address of the app's (first) ingress replica under Serve's direct ingress."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if urls := direct_ingress_urls(psutil.Process(app_root).children(recursive=True)):
            return urls[0]
        time.sleep(1)
    raise TimeoutError("no ingress replica listens on a direct-ingress port")
