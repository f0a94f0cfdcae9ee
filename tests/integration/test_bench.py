"""The benchmark harness and vLLM's own client, against the deployed app."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.bench.__main__ import main as bench_main
from serve_app.bench.vllm_cli import BenchClient, PoolTimeout
from serve_app.engine.builtin_model import ensure_builtin
from tests.integration.conftest import AppServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKLOAD = """
arrival: {kind: closed, concurrency: 4}
prompt_tokens: {kind: uniform, min: 20, max: 200}
output_tokens: {kind: fixed, value: 16}
slo_mix: {interactive: 1, batch: 1}
slo_classes: {interactive: {ttft_ms: 5000, tpot_ms: 1000}, batch: {}}
requests: 12
duration_s: 120
"""


def test_harness_measures_the_app(app_server: AppServer, tmp_path: Path) -> None:
    workload = tmp_path / "tiny.yaml"
    workload.write_text(WORKLOAD)
    code = bench_main(
        [
            "run",
            "--workload",
            str(workload),
            "--target",
            f"app:{app_server.url}",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    (row,) = json.loads((tmp_path / "run-tiny.json").read_text())
    for key in ("target", "requests", "errors", "output_tok_s", "req_s", "goodput_req_s"):
        assert key in row
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(row[key]) == {"p50", "p90", "p99"} and row[key]["p50"] > 0
    assert row["requests"] == 12 and row["errors"] == 0
    assert set(row["slo_attainment"]) == {"interactive", "batch"}
    assert row["peak_mem_gib"] and row["peak_mem_gib"] > 0.1  # the app's engine processes
    assert (tmp_path / "run-tiny.png").stat().st_size > 1000
    assert "| app:" in (tmp_path / "run-tiny.md").read_text()
    # every served request's TTFT breakdown, from the app's Server-Timing, shares adding to 1
    where = row["ttft_stages"]
    assert where["n"] == 12
    assert {"ingress", "dispatch", "queue", "prefill", "return", "emit", "outside"} <= set(
        where["stages"]
    )
    assert sum(s["share"] for s in where["stages"].values()) == pytest.approx(1.0, abs=0.05)
    assert where["predicted_ttft_ms"]["p50"] > 0


def _bench_argv(url: str, tmp_path: Path) -> list[str]:
    tokenizer = ensure_builtin("ernie-4.5-tiny")
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    argv += ["--model", "ernie-4.5-tiny", "--tokenizer", str(tokenizer), "--dataset-name"]
    argv += ["random", "--random-input-len", "64", "--random-output-len", "16", "--ignore-eos"]
    argv += ["--num-prompts", "8", "--max-concurrency", "2", "--save-result"]
    return [*argv, "--result-dir", str(tmp_path)]


def test_vllm_bench_serve_runs_against_the_app(app_server: AppServer, tmp_path: Path) -> None:
    """vLLM's own client, through its CLI and then twice from the worker the streaming bench
    keeps up between runs (the same prompts each time: the second run samples none)."""
    argv = _bench_argv(app_server.url, tmp_path)
    cli = [sys.executable, "-m", "serve_app.bench.vllm_cli", "bench", "serve"]
    subprocess.run([*cli, *argv, "--result-filename", "cli.json"], check=True, timeout=240)
    log = tmp_path / "bench.log"
    with BenchClient() as client:
        for name in ("first.json", "second.json"):
            client.run([*argv, "--result-filename", name], log, timeout_s=240)
    names = ("cli.json", "first.json", "second.json")
    results = [json.loads((tmp_path / name).read_text()) for name in names]
    for result in results:
        assert result["completed"] == 8
        assert result["median_ttft_ms"] > 0 and result["output_throughput"] > 0
    # all three sent the same prompts: the same number of prompt tokens
    assert len({r["total_input_tokens"] for r in results}) == 1
    assert log.read_text().count("Serving Benchmark Result") == 2


def test_a_bench_run_past_its_timeout_ends_the_worker_and_the_next_one_runs(
    app_server: AppServer, tmp_path: Path
) -> None:
    """Nothing listens at the first address: that run waits for a server (vLLM's ready check)
    until the client's timeout ends its worker; a new worker runs the next."""
    nowhere = [*_bench_argv("http://127.0.0.1:9", tmp_path), "--ready-check-timeout-sec", "600"]
    with BenchClient() as client:
        with pytest.raises(PoolTimeout):
            client.run([*nowhere, "--result-filename", "x.json"], tmp_path / "a.log", 20)
        argv = _bench_argv(app_server.url, tmp_path)
        client.run([*argv, "--result-filename", "y.json"], tmp_path / "b.log", 240)
    assert not (tmp_path / "x.json").exists()
    assert json.loads((tmp_path / "y.json").read_text())["completed"] == 8
