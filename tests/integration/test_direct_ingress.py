"""Serve's direct ingress (what `serve-app run --haproxy` puts HAProxy in front of): the ingress
replica answers HTTP on its own port, without Serve's proxy, and the API behaves the same there.

HAProxy itself is not started here: Ray binds its stats and metrics frontends on every interface,
and test servers bind to 127.0.0.1 only. Its latency is measured by the streaming benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import psutil
import pytest
import yaml

from serve_app.bench.streaming import direct_ingress_url, stop_process, wait_ok
from tests.integration.conftest import ROOT, free_ports, stream_then_leave
from tests.integration.test_app import MODEL, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(proxy URL, ingress replica URL) of an app with one pool, run by `serve-app run`."""
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
    env = {**os.environ, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    with (tmp / "app.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        proxy = f"http://127.0.0.1:{http_port}"
        wait_ok(f"{proxy}/ready", proc, 400)
        yield proxy, direct_ingress_url(proc.pid)
    finally:
        stop_process(proc, timeout_s=180)


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
    timing = events[-2]["usage"].pop("server_timing")
    assert timing["prefill"] > 0
    assert timing["proxy"] < 50  # here: the replica's own HTTP server, stamped by the same hook
    assert events[-1] == {"done": True} and events[-2]["usage"] == full["usage"]
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == full["choices"][0]["text"]


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
