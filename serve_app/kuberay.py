"""cluster/rayservice.yaml's `serveConfigV2`, generated from serve_config.yaml.

    python -m serve_app.kuberay write   # rewrite the block in cluster/rayservice.yaml
    python -m serve_app.kuberay check   # exit 1 when the file and serve_config.yaml drift
    python -m serve_app.kuberay export  # print the cluster serve config (for `ray up` clusters)

Only the `serveConfigV2: |` block is rewritten (as text), so the comments of the rest of the
RayService survive. The cluster's serve config differs from the local one in two keys only: the
proxy listens on the pod's address and runs on every node (see CLUSTER_OVERRIDES).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIG = ROOT / "serve_config.yaml"
RAYSERVICE = ROOT / "cluster" / "rayservice.yaml"
BLOCK_KEY = "serveConfigV2: |"

# Inside a pod the proxy must accept connections on the pod's IP: the Kubernetes Service KubeRay
# creates (<name>-serve-svc) is what exposes it. One proxy per node spreads SSE's CPU cost.
CLUSTER_OVERRIDES: dict[str, Any] = {
    "proxy_location": "EveryNode",
    "http_options": {"host": "0.0.0.0"},
}


# A cluster's API is closed by default: keys come from the Secret serve-app-api-keys, which
# cluster/rayservice.yaml mounts here on every Ray pod (cluster/ray-cluster.yaml copies a file).
CLUSTER_API_KEYS_FILE = "/etc/serve-app/api-keys/keys"


def cluster_serve_config(local: dict[str, Any]) -> dict[str, Any]:
    """The local serve config with CLUSTER_OVERRIDES merged in (nested dicts merged by key) and
    every application reading its API keys from CLUSTER_API_KEYS_FILE."""
    out = copy.deepcopy(local)
    for key, value in CLUSTER_OVERRIDES.items():
        if isinstance(value, dict):
            out[key] = {**out.get(key, {}), **value}
        else:
            out[key] = value
    for app in out.get("applications", []):
        args = app.setdefault("args", {})
        args["auth"] = {**args.get("auth", {}), "api_keys_file": CLUSTER_API_KEYS_FILE}
    return out


def render(rayservice_text: str, serve_config: dict[str, Any]) -> str:
    """rayservice_text with its serveConfigV2 block replaced by serve_config as YAML."""
    lines = rayservice_text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == BLOCK_KEY]
    if len(starts) != 1:
        raise ValueError(f"expected exactly one '{BLOCK_KEY}' line, found {len(starts)}")
    start = starts[0]
    indent = len(lines[start]) - len(lines[start].lstrip()) + 2
    end = start + 1
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) >= indent
    ):
        end += 1
    body = yaml.safe_dump(serve_config, sort_keys=False, width=10_000)
    block = [" " * indent + line + "\n" for line in body.splitlines()]
    return "".join(lines[: start + 1] + block + lines[end:])


def serve_config_v2(rayservice_text: str) -> dict[str, Any]:
    """The serve config a RayService file carries, parsed."""
    spec = yaml.safe_load(rayservice_text)["spec"]
    config: dict[str, Any] = yaml.safe_load(spec["serveConfigV2"])
    return config


def expected(rayservice: Path = RAYSERVICE, serve_config: Path = SERVE_CONFIG) -> tuple[str, str]:
    """(the file as it is, the file as the generator would write it)."""
    current = rayservice.read_text()
    local = yaml.safe_load(serve_config.read_text())
    return current, render(current, cluster_serve_config(local))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.kuberay", description=__doc__)
    parser.add_argument("command", choices=["write", "check", "export"])
    parser.add_argument("--rayservice", type=Path, default=RAYSERVICE)
    parser.add_argument("--serve-config", type=Path, default=SERVE_CONFIG)
    args = parser.parse_args(argv)
    if args.command == "export":
        local = yaml.safe_load(args.serve_config.read_text())
        print(yaml.safe_dump(cluster_serve_config(local), sort_keys=False), end="")
        return 0
    current, wanted = expected(args.rayservice, args.serve_config)
    if args.command == "write":
        args.rayservice.write_text(wanted)
        print(f"wrote serveConfigV2 of {args.rayservice} from {args.serve_config}")
        return 0
    if current != wanted:
        print(
            f"{args.rayservice}: serveConfigV2 differs from {args.serve_config}; run "
            "`python -m serve_app.kuberay write`",
            file=sys.stderr,
        )
        return 1
    print(f"{args.rayservice}: serveConfigV2 matches {args.serve_config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
