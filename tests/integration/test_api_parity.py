"""The app answers as `vllm serve` does (serve_app/bench/parity.py: the requests and the rules).

`vllm serve` runs beside the shared app with the throughput profile's engine arguments (CPU);
every request goes to both (to the app's throughput pool, by `x-route-policy`). The table is
written to $SERVE_APP_PARITY_REPORT when set (docs/results/api-parity.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_app.bench.parity import CASES, compare, json_content, table
from serve_app.bench.servers import stop_process, vllm_serve
from serve_app.cli import descendants, reap, wait_ok
from serve_app.profiles import (
    ResolvedProfile,
    detect_platform,
    find_profile,
    load_profile,
    profiles_dir,
)
from tests.integration.conftest import AppServer, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

POOL = "throughput"
APP_HEADERS = {"x-route-policy": f"single:{POOL}", "x-slo-class": "batch"}


@pytest.fixture(scope="module")
def profile() -> ResolvedProfile:
    return load_profile(find_profile(POOL, profiles_dir())).resolve(detect_platform())


@pytest.fixture(scope="module")
def vllm_url(profile: ResolvedProfile, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    (port,) = free_ports(1)
    log = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
    before = set(descendants())
    proc = vllm_serve(profile, port, log)
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", 300, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 60)
        reap([p for p in descendants() if p not in before])


def test_the_app_answers_as_vllm_serve_does(
    app_server: AppServer, vllm_url: str, profile: ResolvedProfile
) -> None:
    assert len(CASES) >= 40
    with (
        httpx.Client(base_url=vllm_url, timeout=300) as ref,
        httpx.Client(base_url=app_server.url, timeout=300) as app,
    ):
        rows = compare(ref, app, profile.max_model_len, APP_HEADERS)
    if report := os.environ.get("SERVE_APP_PARITY_REPORT"):
        Path(report).write_text(table(rows))
    for row in rows:
        if row.app_status != 200:  # an OpenAI-shaped error, as vllm serve's
            assert row.app["error"]["message"] and row.app["error"]["type"], row
        elif "json" in row.name:  # structured outputs: what the app answered parses
            json_content(row.app)
    different = [r for r in rows if not r.identical]
    assert not different, [r.name for r in different] + [
        json.dumps([different[0].vllm, different[0].app], ensure_ascii=False)[:4000]
    ]
