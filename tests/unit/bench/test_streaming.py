from pathlib import Path

from serve_app.bench import streaming

ROOT = Path(__file__).resolve().parents[3]


def row(target: str, tok_s: float, ttft: float, conc: int = 4) -> dict[str, object]:
    """One `vllm bench serve` result as the bench records it."""
    return {
        "target": target,
        "concurrency": conc,
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "median_tpot_ms": 5.0,
    }


def test_summary_pairs_runs_and_takes_ratios() -> None:
    rows = [row("vllm serve", 100, 10), row("app", 90, 13), row("app", 100, 12)]
    rows.append(row("vllm serve", 100, 10))
    (s,) = streaming.summarize(rows)
    assert s["tok_s_ratio"] == 0.95 and s["tok_s_ratio_min"] == 0.9
    assert s["ttft_p50_delta_ms"] == 2.5
    assert "| 4 | 100 | 95 | 0.950 (0.900)" in streaming.table([s])


def test_summary_takes_the_direct_ingress_target_against_vllm_too() -> None:
    rows = [row("vllm serve", 100, 10, 1), row("app", 80, 20, 1), row("app direct", 90, 15, 1)]
    (s,) = streaming.summarize(rows)
    assert s["tok_s_ratio"] == 0.8 and s["ttft_p50_delta_ms"] == 10
    assert s["direct_tok_s_ratio"] == 0.9 and s["direct_ttft_p50_delta_ms"] == 5
    text = streaming.table([s])
    assert "| 1 | 100 | 80 | 0.800 (0.800)" in text and "| 1 | 100 | 90 | 0.900 (0.900)" in text
    assert "app direct tok/s" in text


def test_plot_writes_a_png(tmp_path: Path) -> None:
    summary = [
        {"concurrency": c, "vllm_tok_s": 100.0 * c, "app_tok_s": 90.0 * c, "tok_s_ratio": 0.9}
        | {"vllm_ttft_p50_ms": 10.0, "app_ttft_p50_ms": 12.0}
        for c in (1, 64)
    ]
    streaming.plot(summary, tmp_path / "s.png", "t")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
