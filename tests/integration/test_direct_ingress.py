"""`serve-app run`'s default HTTP path: HAProxy takes the HTTP port and forwards to the ingress
replica's own HTTP server (Serve's direct ingress); the API behaves the same through either,
and nothing listens beyond 127.0.0.1 (Ray binds HAProxy's stats and metrics frontends on every
interface unless serve_app/haproxy_loopback.py moves them). Its latency is measured by the
streaming benchmark.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest
import yaml

from serve_app.bench.servers import direct_ingress_url, stop_process
from serve_app.cli import wait_ok
from tests.integration.conftest import ROOT, free_ports, haproxy_ports_env, stream_then_leave
from tests.integration.test_app import MODEL, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@dataclass(frozen=True)
class HAProxyApp:
    proxy: str  # HAProxy's frontend: the app's HTTP port
    direct: str  # the ingress replica's own HTTP server
    pid: int  # `serve-app run`
    ports: dict[str, int]  # HAProxy's: http, stats, metrics


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HAProxyApp]:
    """An app with one pool, run by `serve-app run` as a user runs it."""
    http_port, dashboard_port, metrics_port = free_ports(3)
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = http_port
    args = config["applications"][0]["args"]
    args["profiles"] = ["low-latency"]
    args["routing"]["priors"] = {"low-latency": args["routing"]["priors"]["low-latency"]}
    tmp = tmp_path_factory.mktemp("direct-ingress")
    (tmp / "serve_config.yaml").write_text(yaml.safe_dump(config))
    cmd = [
        sys.executable, "-m", "serve_app", "run", str(tmp / "serve_config.yaml"),
        "--dashboard-port", str(dashboard_port), "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    haproxy_ports = haproxy_ports_env()  # instead of Ray's fixed 8404, 9101, 8500, 9500
    env = {**os.environ, **haproxy_ports}
    with (tmp / "app.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        proxy = f"http://127.0.0.1:{http_port}"
        wait_ok(f"{proxy}/ready", 400, proc=proc)
        ports = {
            "http": http_port,
            "stats": int(haproxy_ports["RAY_SERVE_HAPROXY_STATS_PORT"]),
            "metrics": int(haproxy_ports["RAY_SERVE_HAPROXY_METRICS_PORT"]),
        }
        yield HAProxyApp(proxy, direct_ingress_url(proc.pid), proc.pid, ports)
    finally:
        stop_process(proc, timeout_s=180)


@pytest.fixture(scope="module")
def urls(app: HAProxyApp) -> tuple[str, str]:
    """(HAProxy's URL, ingress replica URL)."""
    return app.proxy, app.direct


def loopback(ip: str) -> bool:
    """127.0.0.1, ::1, or 127.0.0.1 as an IPv6 dual-stack socket shows it (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def test_nothing_listens_beyond_loopback(app: HAProxyApp) -> None:
    """Every socket the app's processes listen on, HAProxy's stats and metrics frontends
    included, is on 127.0.0.1."""
    tree = psutil.Process(app.pid).children(recursive=True)
    pids = {p.pid for p in tree}
    haproxy = {p.pid for p in tree if p.name() == "haproxy"}
    listening = [
        (c.laddr.ip, c.laddr.port, c.pid)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    print(f"\n{len(listening)} listening sockets, {len(haproxy)} HAProxy processes")
    assert haproxy, "HAProxy is not running"
    haproxy_ports = {port for _, port, pid in listening if pid in haproxy}
    assert set(app.ports.values()) <= haproxy_ports, (app.ports, haproxy_ports)
    names = {p.pid: p.name() for p in tree if p.is_running()}
    outside = [(ip, port, names.get(pid, "")) for ip, port, pid in listening if not loopback(ip)]
    # Known exception, Ray's own: every Serve replica starts its inter-deployment gRPC server
    # on [::]:<random port> (hard-coded in ray/serve/_private/replica.py, Ray 2.60, whatever
    # the transport); README "Security" says so. Anything else beyond loopback fails here.
    replicas = {pid for pid, name in names.items() if name.startswith("ray::ServeReplica")}
    grpc = [entry for entry in outside if entry[2].startswith("ray::ServeReplica")]
    print(f"beyond loopback: {len(grpc)} Serve replica gRPC servers ({len(replicas)} replicas)")
    assert [e for e in outside if e not in grpc] == [], outside
    assert len(grpc) <= len(replicas)
    # HAProxy's Prometheus exporter answers on loopback
    r = httpx.get(f"http://127.0.0.1:{app.ports['metrics']}/metrics", timeout=5)
    assert r.status_code == 200 and "haproxy_" in r.text


def test_the_ingress_replica_listens_on_loopback_only(urls: tuple[str, str]) -> None:
    _, direct = urls
    port = int(direct.rsplit(":", 1)[1])
    listeners = [
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert listeners == ["127.0.0.1"]


def test_a_stream_on_the_replica_port_equals_the_proxied_completion(urls: tuple[str, str]) -> None:
    proxy, direct = urls
    request = {"model": MODEL, "prompt": "The weather today is", "max_tokens": 24}
    request |= {"temperature": 0.9, "seed": 99, "ignore_eos": True}
    full = httpx.post(f"{proxy}/v1/completions", json=request, timeout=60).json()
    streamed = {**request, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{direct}/v1/completions", json=streamed, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-serve-pool"] == "low-latency"
        events = sse_events(r)
    timing = events[-2]["server_timing"]
    assert timing["prefill"] > 0
    assert timing["proxy"] < 50  # here: the replica's own HTTP server, stamped by the same hook
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert events[-1] == {"done": True}
    assert {k: events[-3]["usage"][k] for k in counts} == {k: full["usage"][k] for k in counts}
    assert "".join(e["choices"][0]["text"] for e in events[:-3]) == full["choices"][0]["text"]


def test_a_bad_request_on_the_replica_port_names_the_parameter(urls: tuple[str, str]) -> None:
    _, direct = urls
    body = {"model": MODEL, "prompt": "hi", "max_tokens": -1}
    r = httpx.post(f"{direct}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    ok = httpx.post(f"{direct}/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_a_client_leaving_the_replica_port_aborts_the_engine_request(
    urls: tuple[str, str],
) -> None:
    _, direct = urls
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 1500}
    body |= {"ignore_eos": True, "stream": True}
    with httpx.Client(base_url=direct, timeout=60) as c:
        running, state = stream_then_leave(c, body)
    assert running >= 1
    assert (state["running"], state["waiting"]) == (0, 0)
