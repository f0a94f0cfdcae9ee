"""A real Prometheus scrapes Ray's metrics endpoint while traffic of several SLO classes runs;
then every panel query of the Grafana dashboard is evaluated against it and must return data."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from serve_app.observability.dashboard import RATE, panel_queries
from serve_app.timing import Stage
from tests.integration.conftest import AppServer, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def prometheus(app_server: AppServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is required (make test installs it)"
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "ray",
                "static_configs": [{"targets": [f"127.0.0.1:{app_server.metrics_port}"]}],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    (port,) = free_ports(1)
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def latest(selector: str) -> str:
    """The series' last sample within a minute: an instant query of the bare selector finds
    nothing right after a scrape that timed out (Prometheus marks every series stale then)."""
    return f"last_over_time({selector}[1m])"


def traffic(server: AppServer) -> dict[int, int]:
    """A bounded mix: three classes, stream and not, one refusal, one bad request."""
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for i in range(24):
            cls = ("interactive", "standard", "batch")[i % 3]
            body = {"prompt": f"Request {i}: tell me about Ray.", "max_tokens": 24}
            body |= {"ignore_eos": True, "stream": i % 2 == 0}
            r = c.post("/v1/completions", json=body, headers={"x-slo-class": cls})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        for headers in ({"x-slo-ttft-ms": "1"}, {"x-slo-class": "nope"}):
            r = c.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    return statuses


def test_every_dashboard_query_returns_data(app_server: AppServer, prometheus: str) -> None:
    deadline = time.monotonic() + 120
    statuses = traffic(app_server)
    assert statuses == {200: 24, 429: 1, 400: 1}
    # Ray pushes metrics to its node agent every few seconds; wait for them, then let the
    # 1 s scrapes collect enough samples for rate() over the dashboard's window.
    while time.monotonic() < deadline and not query(prometheus, "ray_serve_app_slo_requests_total"):
        time.sleep(1)
    traffic(app_server)  # a second round so every rate() sees an increase
    time.sleep(8)
    empty = []
    for title, expr in panel_queries():
        result = query(prometheus, expr.replace(RATE, "1m"))
        if not result:
            empty.append((title, expr))
    assert not empty, f"panel queries with no data: {empty}"
    served_series = latest('ray_serve_app_requests_total{outcome="served"}')
    served = query(prometheus, f"sum({served_series})")
    assert float(served[0]["value"][1]) >= 48
    # every stage of the TTFT breakdown was measured, the engine's from vLLM's timestamps
    stages = query(prometheus, f"count by (stage) ({latest('ray_serve_app_ttft_stage_ms_count')})")
    assert {s["metric"]["stage"] for s in stages} == {s.value for s in Stage}
    # the refused request of an unknown class is labelled `other`, not by what the client sent
    classes = query(prometheus, f"count by (slo_class) ({latest('ray_serve_app_requests_total')})")
    assert {c["metric"]["slo_class"] for c in classes} == {
        "interactive",
        "standard",
        "batch",
        "other",
    }
