"""One real deployment shared by the integration tests: Ray on loopback, Serve, vLLM CPU engines.

Starting two engines takes ~40 s on 2 cores, so the app is deployed once per session from the
shipped serve_config.yaml (only the ports change) and every test talks to it over HTTP.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from serve_app import haproxy_loopback
from serve_app.bench.servers import free_ports
from serve_app.cli import HAPROXY_FILES, descendants, reap, serve_deploy, start_local_ray, wait_ok

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300


def haproxy_ports_env() -> dict[str, str]:
    """Free ports for what Serve's HAProxy mode (the default HTTP path) opens besides the app's
    own port, which Ray fixes otherwise (8404, 9101, 8500, 9500): apps the tests start run side
    by side with the shared one."""
    names = (
        "RAY_SERVE_HAPROXY_STATS_PORT",
        "RAY_SERVE_HAPROXY_METRICS_PORT",
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
    )
    return dict(zip(names, map(str, free_ports(len(names))), strict=True))


@contextlib.contextmanager
def haproxy_env_kept_to_ray(ports: dict[str, str]) -> Iterator[None]:
    """HAProxy's ports (and, from start_local_ray, its files and launcher) in os.environ while
    Ray starts, removed after: Ray's processes keep them, and the apps tests start (as
    subprocesses) get their own."""
    os.environ.update(ports)
    try:
        yield
    finally:
        for key in [*ports, *HAPROXY_FILES, haproxy_loopback.BINARY_ENV]:
            os.environ.pop(key, None)


@dataclass
class AppServer:
    url: str
    dashboard_url: str
    metrics_port: int
    config: dict[str, Any]
    api_keys_file: Path
    ready_seen: list[tuple[int, dict[str, str], str]] = field(default_factory=list)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)


def stream_then_leave(
    client: httpx.Client, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, int]]:
    """Start a streamed completion, read a few events, close it. Returns the pool's running count
    seen while streaming and the pool's state once idle (or after 5 s)."""
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        pool = r.headers["x-serve-pool"]
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        # the engine's report reaches the ingress within ~0.5 s
        deadline = time.monotonic() + 3
        running = 0
        while time.monotonic() < deadline and not running:
            running = client.get("/pools").json()[pool]["running"]
            time.sleep(0.1)
    # the stream is closed: within 5 s the engine must have no request left
    deadline = time.monotonic() + 5
    state: dict[str, int] = client.get("/pools").json()[pool]
    while time.monotonic() < deadline and (state["running"] or state["waiting"]):
        time.sleep(0.25)
        state = client.get("/pools").json()[pool]
    return running, state


def reached_directly(client: httpx.Client, timeout_s: float = 30) -> list[dict[str, Any]]:
    """The pool replicas `/pools` lists, once the ingress answering reaches every one over its
    socket (direct dispatch: it connects at its next refresh of the board), or at the timeout;
    the caller asserts."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = [r for p in client.get("/pools").json().values() for r in p["placement"]]
        if (replicas and all(r["direct_dispatch"] for r in replicas)) or (
            time.monotonic() > deadline
        ):
            return replicas
        time.sleep(0.5)


def engine_core_of(pool: str, under: psutil.Process | None = None) -> psutil.Process:
    """The vLLM engine core of the pool's replica among the descendants of `under`: by default
    this process, whose ray.init() started the shared app's Ray (other Ray instances on the
    machine, such as the two-node test's, run apps of the same name)."""
    root = under or psutil.Process()
    for p in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if f"ServeReplica:llm:pool-{pool}" in " ".join(p.cmdline()):
                for child in p.children(recursive=True):
                    if "EngineCore" in " ".join(child.cmdline() or [child.name()]):
                        return child
    raise LookupError(f"no engine core under pool {pool}")


def app_statuses(dashboard_url: str) -> dict[str, Any]:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    apps: dict[str, Any] = ServeSubmissionClient(dashboard_url).get_serve_details()["applications"]
    return apps


def redeploy(server: AppServer, config: dict[str, Any]) -> None:
    """`serve deploy` a changed config, then wait until the app serves again (a changed config
    may restart replicas, and the next test must not meet a half-deployed app)."""
    serve_deploy(config, server.dashboard_url)
    time.sleep(2)  # let the controller take the new config before we look
    deadline = time.monotonic() + READY_TIMEOUT_S
    while app_statuses(server.dashboard_url).get("llm", {}).get("status") != "RUNNING":
        if time.monotonic() > deadline:
            raise TimeoutError("app did not return to RUNNING")
        time.sleep(1)
    _wait_ready(server)


def _wait_ready(server: AppServer) -> None:
    wait_ok(f"{server.url}/ready", READY_TIMEOUT_S, poll_s=0.5, seen=server.ready_seen)


@pytest.fixture(scope="session")
def app_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppServer]:
    import ray
    from ray import serve

    dashboard_port, metrics_port, http_port = free_ports(3)
    # Four logical CPUs on two cores: the two engines plus room for an autoscaled replica.
    # HTTP through HAProxy, as `serve-app run` serves by default.
    with haproxy_env_kept_to_ray(haproxy_ports_env()):
        dashboard = start_local_ray(
            dashboard_port=dashboard_port,
            metrics_port=metrics_port,
            num_cpus=4,
            log_to_driver=False,
        )
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = http_port
    # An empty key file: the API is open until a test writes keys into it (they reload live).
    api_keys_file = tmp_path_factory.mktemp("auth") / "api-keys"
    api_keys_file.write_text("")
    config["applications"][0]["args"]["auth"] = {"api_keys_file": str(api_keys_file)}
    # tests pin a pool per request (x-route-policy: single:<pool>), e.g. the API parity test
    config["applications"][0]["args"]["routing"]["allow_policy_header"] = True
    server = AppServer(
        url=f"http://127.0.0.1:{config['http_options']['port']}",
        dashboard_url=dashboard,
        metrics_port=metrics_port,
        config=config,
        api_keys_file=api_keys_file,
    )
    try:
        serve_deploy(config, dashboard)
        _wait_ready(server)
        yield server
    finally:
        # as `serve-app run` stops: engine cores of replicas Ray killed outlive ray.shutdown()
        started_here = descendants()
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            reap(started_here)
