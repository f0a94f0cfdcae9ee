import argparse

from serve_app.bench.tune import grid, pareto


def row(tok_s: float, p99: float, mem: float) -> dict[str, object]:
    return {"output_tok_s": tok_s, "ttft_ms": {"p99": p99}, "peak_mem_gib": mem, "args": {}}


def test_pareto_keeps_only_undominated_points() -> None:
    fast = row(100, 10, 2)
    big = row(200, 30, 4)
    dominated = row(90, 40, 5)  # worse than fast on every axis
    lean = row(50, 50, 1)
    assert pareto([fast, big, dominated, lean]) == [fast, big, lean]


def test_grid_is_the_product_of_given_axes() -> None:
    args = argparse.Namespace(
        block_size="16,32",
        max_model_len=None,
        max_num_seqs="64",
        kv_cache_dtype="auto,fp8",
        chunked_prefill="on,off",
    )
    combos = grid(args)
    assert len(combos) == 8
    assert {
        "block_size": 16,
        "max_num_seqs": 64,
        "kv_cache_dtype": "fp8",
        "enable_chunked_prefill": False,
    } in combos
