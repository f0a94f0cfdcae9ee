"""Two Ray nodes on loopback (`ray start`, simulated GPUs), the app spread over them, a node lost.

The cluster is this test's own (separate from the session app): a head and a worker node, both
with node address 127.0.0.1 and their own ports, token authentication on, every process found and
stopped by the temporary directory it was started with.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from serve_app.cli import SERVE_ENV, SERVE_PROXY_ENV
from serve_app.engine.watchdog import stop, wait_ended
from tests.integration.conftest import ROOT, engine_core_of, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

LOOPBACK = "127.0.0.1"
HEAD_GPUS, WORKER_GPUS = 2, 1
RECOVERY_TIMEOUT_S = 300

# Ray turns a node address of 127.0.0.1 into the machine's outward address whenever multi-node
# clusters are enabled, which `ray start --address` requires. For a second node on loopback, this
# launcher runs Ray's own CLI with that one translation switched off.
RAY_START_ON_LOOPBACK = """
import sys
import ray._private.services as services
services.resolve_ip_for_localhost = lambda host: host
from ray.scripts.scripts import main
sys.argv = ["ray", *sys.argv[1:]]
main()
"""

# Holds one GPU of the head while the app deploys, so the head and the worker each have exactly
# one free GPU and the two pools must land one per node; released before the worker is stopped,
# so the head can take the lost replica.
GPU_HOLDER = """
import json, sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], log_to_driver=False)
nodes = {n["NodeManagerPort"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
head = next(n["NodeID"] for n in ray.nodes()
            if n["Alive"] and "node:__internal_head__" in n["Resources"])
worker = nodes[int(sys.argv[2])]
@ray.remote(num_gpus=1, num_cpus=0)
class Holder:
    def ready(self): return True
h = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
ray.get(h.ready.remote())
print(json.dumps({"head": head, "worker": worker}), flush=True)
sys.stdin.readline()
"""


@dataclass
class LoopbackCluster:
    temp_dir: str
    env: dict[str, str]
    gcs_address: str
    dashboard_url: str
    http_url: str
    worker_node_port: int
    node_ids: dict[str, str] = field(default_factory=dict)

    def processes(self) -> list[psutil.Process]:
        """Every Ray process of this cluster: each carries the temp dir on its command line."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(self.temp_dir in part for part in p.info["cmdline"] or ()):
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def worker_raylet(self) -> psutil.Process:
        flag = f"--node_manager_port={self.worker_node_port}"
        for p in self.processes():
            cmdline = p.cmdline()
            if any(part.endswith("raylet") for part in cmdline[:1]) and flag in cmdline:
                return p
        raise LookupError(f"no raylet with {flag}")


def _ray(env: dict[str, str], *args: str, loopback_launcher: bool = False) -> None:
    cmd = (
        [sys.executable, "-c", RAY_START_ON_LOOPBACK, *args]
        if loopback_launcher
        else [str(Path(sys.executable).with_name("ray")), *args]
    )
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=180)


@pytest.fixture
def cluster() -> Iterator[LoopbackCluster]:
    gcs_port, dashboard_port, http_port, worker_node_port, metrics_a, metrics_b = free_ports(6)
    temp_dir = tempfile.mkdtemp(prefix="rmn", dir="/tmp")  # short: Ray's socket paths live here
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
        "SERVE_APP_PLATFORM": "cpu",  # the GPUs are simulated: engines run on the CPU build
        **SERVE_ENV,  # Serve in the mode `serve-app run` uses
        # Serve's proxy on each node: two HAProxies on one machine would share Ray's fixed
        # stats, metrics and fallback ports (a real cluster has one node per machine)
        **SERVE_PROXY_ENV,
    }
    c = LoopbackCluster(
        temp_dir=temp_dir,
        env=env,
        gcs_address=f"{LOOPBACK}:{gcs_port}",
        dashboard_url=f"http://{LOOPBACK}:{dashboard_port}",
        http_url=f"http://{LOOPBACK}:{http_port}",
        worker_node_port=worker_node_port,
    )
    try:
        _ray(
            {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
            "start", "--head", f"--node-ip-address={LOOPBACK}", f"--port={gcs_port}",
            f"--dashboard-host={LOOPBACK}", f"--dashboard-port={dashboard_port}",
            f"--metrics-export-port={metrics_a}", f"--temp-dir={temp_dir}",
            "--num-cpus=2", f"--num-gpus={HEAD_GPUS}", "--disable-usage-stats",
        )  # fmt: skip
        _ray(
            {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},
            "start", f"--address={c.gcs_address}", f"--node-ip-address={LOOPBACK}",
            f"--node-manager-port={worker_node_port}", f"--metrics-export-port={metrics_b}",
            f"--temp-dir={temp_dir}", "--num-cpus=2", f"--num-gpus={WORKER_GPUS}",
            "--disable-usage-stats",
            loopback_launcher=True,
        )  # fmt: skip
        yield c
    finally:
        stop(c.processes(), grace_s=15)


def multinode_config(http_port: int) -> dict[str, Any]:
    config = copy.deepcopy(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    config["http_options"]["port"] = http_port
    config["proxy_location"] = "HeadOnly"  # one proxy: both nodes share 127.0.0.1's ports
    config["applications"][0]["args"]["num_gpus_per_replica"] = 1
    return config


def deploy(c: LoopbackCluster, config: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve = str(Path(sys.executable).with_name("serve"))
    subprocess.run(
        [serve, "deploy", "--address", c.dashboard_url, str(path)],
        env=c.env,
        check=True,
        timeout=120,
    )


def placements(client: httpx.Client) -> dict[str, list[dict[str, Any]]]:
    pools = client.get("/pools").json()
    return {name: pool["placement"] for name, pool in pools.items()}


def completion_ok(client: httpx.Client) -> bool:
    try:
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    except httpx.HTTPError:
        return False


def serving_both_pools(client: httpx.Client) -> bool:
    try:
        ready = client.get("/ready")
        return ready.status_code == 200 and all(len(p) == 1 for p in placements(client).values())
    except httpx.HTTPError:
        return False


def full_strength_without(client: httpx.Client, lost_node: str) -> bool:
    """Every pool has its one replica again, none of them on the lost node."""
    try:
        where = placements(client)
    except (httpx.HTTPError, ValueError):
        return False
    return all(len(rs) == 1 and rs[0]["node_id"] != lost_node for rs in where.values())


def test_pools_spread_over_two_nodes_and_survive_losing_one(
    cluster: LoopbackCluster, tmp_path: Path
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", GPU_HOLDER, cluster.gcs_address, str(cluster.worker_node_port)],
        env={**cluster.env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    nodes = json.loads(holder.stdout.readline())
    assert nodes["head"] != nodes["worker"]

    deploy(cluster, multinode_config(int(cluster.http_url.rsplit(":", 1)[1])), tmp_path)
    with httpx.Client(base_url=cluster.http_url, timeout=30) as client:
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not serving_both_pools(client):
            assert time.monotonic() < deadline, "app not ready on the two-node cluster"
            time.sleep(1)
        where = placements(client)
        print(f"\nplacement: {json.dumps(where)}")
        # Each engine replica holds its own (simulated) GPU; the two pools sit on different nodes.
        slots = [(r["node_id"], tuple(r["gpu_ids"])) for rs in where.values() for r in rs]
        assert all(gpus for _, gpus in slots), slots
        assert len(set(slots)) == len(slots) == 2
        assert {node for node, _ in slots} == {nodes["head"], nodes["worker"]}
        # a GPU each: admission protects each pool's decodes from its own prefills only
        shared = {n: p["shares_device_with"] for n, p in client.get("/pools").json().items()}
        assert shared == {name: [] for name in where}, shared
        assert completion_ok(client)

        holder.stdin.write("release\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0

        lost = [name for name, rs in where.items() if rs[0]["node_id"] == nodes["worker"]]
        lost_engines = [engine_core_of(name, under=cluster.worker_raylet()) for name in lost]
        lost_replicas = [
            next(p for p in e.parents() if "ServeReplica" in " ".join(p.cmdline()))
            for e in lost_engines
        ]
        cluster.worker_raylet().kill()  # the worker node's Ray process dies without warning
        killed_at = time.monotonic()
        outcomes: list[tuple[float, bool]] = []
        recovered_s = None
        while time.monotonic() - killed_at < RECOVERY_TIMEOUT_S:
            outcomes.append((time.monotonic() - killed_at, completion_ok(client)))
            if outcomes[-1][1] and full_strength_without(client, nodes["worker"]):
                recovered_s = time.monotonic() - killed_at
                break
            time.sleep(1)
        assert recovered_s is not None, f"no recovery within {RECOVERY_TIMEOUT_S} s"
        failed = [round(t, 1) for t, ok in outcomes if not ok]
        after = placements(client)
        print(
            f"worker node lost ({lost} was there): back at full strength in {recovered_s:.1f} s; "
            f"{len(failed)} of {len(outcomes)} probe requests failed meanwhile (at {failed} s); "
            f"placement now {json.dumps(after)}"
        )
        # The lost replica was rescheduled on the head's freed GPU; both still own a GPU each.
        slots = [(r["node_id"], tuple(r["gpu_ids"])) for rs in after.values() for r in rs]
        assert {node for node, _ in slots} == {nodes["head"]}
        assert len(set(slots)) == 2 and all(gpus for _, gpus in slots)
        assert all(completion_ok(client) for _ in range(5))
        # Its replicas exit once they notice (Ray's workers check on their raylet), and their
        # engines must end with them: on a node whose raylet died no part of Ray is left to end
        # them, and each would keep its GPU's memory.
        replicas_alive = wait_ended(lost_replicas, timeout_s=90)
        replicas_gone_s = time.monotonic() - killed_at
        engines_alive = wait_ended(lost_engines, timeout_s=15)
        print(
            f"\nraylet killed: its replicas gone by {replicas_gone_s:.1f} s, their engines "
            f"{'outlived them' if engines_alive else 'ended with them'}"
        )
        assert not replicas_alive, f"{replicas_alive} outlived their raylet by 90 s"
        assert not engines_alive, f"{engines_alive} outlived their replicas"
