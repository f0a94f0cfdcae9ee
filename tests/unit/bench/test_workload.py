import itertools
import statistics
from pathlib import Path

import pytest

from serve_app.bench.workload import (
    Arrival,
    Lengths,
    Workload,
    WorkloadError,
    expand,
    load_workload,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("path", sorted((ROOT / "workloads").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_workloads_load(path: Path) -> None:
    workload = load_workload(path)
    specs = expand(workload)
    assert len(specs) == workload.requests


def test_seed_table_matches_the_seed() -> None:
    specs = expand(load_workload(ROOT / "workloads" / "seed-table.yaml"))
    assert len(specs) == 100
    assert all(30 <= len(s.prompt_token_ids) <= 300 for s in specs)
    assert {s.max_tokens for s in specs} == {256}


def test_expansion_is_deterministic_and_avoids_special_ids() -> None:
    workload = load_workload(ROOT / "workloads" / "mixed.yaml")
    a, b = expand(workload), expand(workload)
    assert a == b
    assert min(t for s in a for t in s.prompt_token_ids) >= 5
    assert {s.slo_class for s in a} == {"interactive", "batch"}


def test_poisson_arrivals_are_increasing_at_about_the_rate() -> None:
    workload = Workload(
        name="w",
        arrival=Arrival(kind="poisson", rate=10),
        prompt_tokens=Lengths(value=10),
        output_tokens=Lengths(value=10),
        requests=2000,
    )
    offsets = [s.arrival_s for s in expand(workload)]
    assert offsets == sorted(offsets)
    assert 180 < offsets[-1] < 220  # 2000 requests at 10/s


def test_windowed_poisson_arrivals_offer_every_request_within_the_window() -> None:
    def workload(seed: int, window_s: float | None) -> Workload:
        return Workload(
            name="w",
            arrival=Arrival(kind="poisson", rate=5, window_s=window_s),
            prompt_tokens=Lengths(kind="uniform", min=1, max=50),
            output_tokens=Lengths(value=10),
            slo_mix={"interactive": 0.7, "standard": 0.3},
            requests=150,
            seed=seed,
        )

    lasts = []
    for seed in range(20):
        windowed = expand(workload(seed, 30.0))
        offsets = [s.arrival_s for s in windowed]
        assert offsets == sorted(offsets) and offsets[0] >= 0 and offsets[-1] < 30
        assert offsets[-1] > 28  # 150 uniform draws: the last within 2 s of the end
        plain = expand(workload(seed, None))
        lasts.append(plain[-1].arrival_s)
    assert max(lasts) - min(lasts) > 3  # exponential gaps alone: the window varies by draw
    # bursts as in a Poisson process: gaps as variable as exponential ones (coefficient ~1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert 0.7 < statistics.stdev(gaps) / statistics.mean(gaps) < 1.3


def test_window_s_is_for_poisson_arrivals_only() -> None:
    with pytest.raises(ValueError, match="window_s"):
        Arrival(kind="constant", rate=1, window_s=10)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "arrival: {kind: closed}\nprompt_tokens: {value: 1}\noutput_tokens: {value: 1}",
            "concurrency",
        ),
        ("arrival: {kind: poisson}\nprompt_tokens: {value: 1}\noutput_tokens: {value: 1}", "rate"),
        (
            "arrival: {kind: closed, concurrency: 1}\nprompt_tokens: {kind: uniform, min: 5}\n"
            "output_tokens: {value: 1}",
            "max",
        ),
        (
            "arrival: {kind: closed, concurrency: 1}\nprompt_tokens: {value: 1}\n"
            "output_tokens: {value: 1}\nslo_mix: {a: 1}\nslo_classes: {b: {}}",
            "without targets",
        ),
    ],
)
def test_bad_workloads_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message):
        load_workload(path)


def test_a_content_salt_changes_the_prompts_and_nothing_else() -> None:
    workload = load_workload(ROOT / "workloads" / "slo-mix.yaml")
    a, b = expand(workload), expand(workload.model_copy(update={"content_salt": 1}))
    shape = [(len(s.prompt_token_ids), s.max_tokens, s.slo_class, s.arrival_s) for s in a]
    assert shape == [(len(s.prompt_token_ids), s.max_tokens, s.slo_class, s.arrival_s) for s in b]
    # no prompt, nor any 16-token block of one (a KV block), is shared between the two runs
    blocks = {tuple(s.prompt_token_ids[:16]) for s in a}
    assert not blocks & {tuple(s.prompt_token_ids[:16]) for s in b}
