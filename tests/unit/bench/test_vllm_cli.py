"""The bench client's worker: vLLM's prompt sampling done once per set of arguments."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from serve_app.bench import vllm_cli


def test_prompts_are_sampled_once_and_each_run_gets_its_own_request_ids(monkeypatch) -> None:
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.benchmarks.datasets import SampleRequest

    sampled: list[int] = []

    def sample(args: Any, tokenizer: Any, **kwargs: Any) -> list[SampleRequest]:
        sampled.append(args.num_prompts)
        prefix = args.request_id_prefix
        return [SampleRequest(f"p{i}", 3, 8, request_id=f"{prefix}{i}") for i in range(2)]

    monkeypatch.setattr(serve, "get_samples", sample)
    monkeypatch.setattr(serve, "get_tokenizer", lambda name, **kw: object())
    monkeypatch.setattr(vllm_cli, "_patch_version_lookup", lambda: None)  # process-wide
    vllm_cli._load_bench()

    def args(prompts: int, prefix: str) -> argparse.Namespace:
        return argparse.Namespace(
            dataset_name="random", num_prompts=prompts, seed=0, request_id_prefix=prefix
        )

    first = serve.get_samples(args(2, "a-"), None)
    again = serve.get_samples(args(2, "b-"), None)
    other = serve.get_samples(args(3, "c-"), None)
    assert sampled == [2, 3]  # the second run with the same arguments sampled nothing
    assert [r.prompt for r in first] == [r.prompt for r in again] == ["p0", "p1"]
    assert [r.request_id for r in first] == ["a-0", "a-1"]
    assert [r.request_id for r in again] == ["b-0", "b-1"]
    assert [r.request_id for r in other] == ["c-0", "c-1"]
    assert serve.get_tokenizer("t") is serve.get_tokenizer("t")  # loaded once
