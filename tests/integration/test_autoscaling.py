"""A pool scales up on its engines' queue depth and back to its minimum when the load stops."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from serve_app.engine.protocol import GenerationRequest
from tests.integration.conftest import AppServer, app_statuses, redeploy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

POOL = "pool-low-latency"
# Serve's own ongoing-request target is set so high that it alone would never scale this pool:
# any scale-up comes from the engines' waiting queues (serve_app.autoscaling).
TEST_AUTOSCALING = {
    "min_replicas": 1,
    "initial_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1000,
    "upscale_delay_s": 1,
    "downscale_delay_s": 4,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "policy": {
        "policy_function": "serve_app.autoscaling:EngineQueuePolicy",
        "policy_kwargs": {"target_waiting_per_replica": 2},
    },
}


@pytest.fixture(scope="module", autouse=True)
def shipped_config_after(app_server: AppServer) -> Iterator[None]:
    """Each test deploys its own autoscaling config; the shipped one comes back once, after the
    last (a redeploy restarts every engine)."""
    yield
    redeploy(app_server, app_server.config)


def running_replicas(dashboard_url: str) -> int:
    app = app_statuses(dashboard_url).get("llm", {})
    if app.get("status") != "RUNNING" or POOL not in app.get("deployments", {}):
        return 0  # (re)deploying
    replicas: list[dict[str, Any]] = app["deployments"][POOL]["replicas"]
    return sum(r["state"] == "RUNNING" for r in replicas)


def wait_for(predicate: Any, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(1)
    raise TimeoutError(f"condition not met in {timeout_s} s")


async def _load(stop: threading.Event, concurrency: int = 64, budget_s: float = 300) -> None:
    """Keep `concurrency` requests in flight on the pool (more than its engine batches, 32)."""
    from ray import serve

    handle = serve.get_deployment_handle(POOL, app_name="llm")
    deadline = time.monotonic() + budget_s

    async def worker(i: int) -> None:
        n = 0
        while not stop.is_set() and time.monotonic() < deadline:
            n += 1
            request = GenerationRequest(f"autoscale-{i}-{n}", [5] * 200, 128, ignore_eos=True)
            async for _ in handle.options(stream=True).generate.remote(request):
                pass

    await asyncio.gather(*(worker(i) for i in range(concurrency)))


def test_queue_depth_scales_the_pool_up_and_back_down(app_server: AppServer) -> None:
    config = copy.deepcopy(app_server.config)
    config["applications"][0]["deployments"].append(
        {"name": POOL, "autoscaling_config": TEST_AUTOSCALING}
    )
    redeploy(app_server, config)
    stop = threading.Event()
    worker = threading.Thread(target=lambda: asyncio.run(_load(stop)), daemon=True)

    try:
        wait_for(lambda: running_replicas(app_server.dashboard_url) == 1, 120)
        worker.start()
        up_s = wait_for(lambda: running_replicas(app_server.dashboard_url) == 2, 240)
        stop.set()
        worker.join(30)
        down_s = wait_for(lambda: running_replicas(app_server.dashboard_url) == 1, 180)
        print(
            f"\nscaled up to 2 after {up_s:.0f} s of load; "
            f"back to 1 {down_s:.0f} s after it stopped"
        )
    finally:
        stop.set()


# Neither Serve's ongoing-request target nor the engines' queues can scale the pool here: only
# requests refused for want of its capacity (refused demand) can.
REFUSAL_AUTOSCALING = {
    **TEST_AUTOSCALING,
    "policy": {
        "policy_function": "serve_app.autoscaling:EngineQueuePolicy",
        "policy_kwargs": {"target_waiting_per_replica": 1000},
    },
}


def _interactive_load(
    url: str, stop: threading.Event, statuses: list[int], clients: int = 48, budget_s: float = 200
) -> None:
    """`clients` users sending interactive requests back to back, bounded in time."""
    deadline = time.monotonic() + budget_s
    body = {"prompt": "tell me a long story " * 20, "max_tokens": 64, "ignore_eos": True}

    def user() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set() and time.monotonic() < deadline:
                r = client.post(
                    "/v1/completions", json=body, headers={"x-slo-class": "interactive"}
                )
                statuses.append(r.status_code)
                if r.status_code == 429:
                    time.sleep(0.2)

    threads = [threading.Thread(target=user, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(budget_s + 60)


def test_sustained_refusals_scale_the_pool_up(app_server: AppServer) -> None:
    config = copy.deepcopy(app_server.config)
    app = config["applications"][0]
    # two queued requests per replica saturate a pool: the load is refused early and often
    app["args"]["routing"] = {**app["args"]["routing"], "max_waiting_per_replica": 2}
    app["deployments"].append({"name": POOL, "autoscaling_config": REFUSAL_AUTOSCALING})
    redeploy(app_server, config)
    stop = threading.Event()
    statuses: list[int] = []
    worker = threading.Thread(
        target=_interactive_load, args=(app_server.url, stop, statuses), daemon=True
    )
    try:
        wait_for(lambda: running_replicas(app_server.dashboard_url) == 1, 120)
        worker.start()
        try:
            up_s = wait_for(lambda: running_replicas(app_server.dashboard_url) == 2, 180)
        except TimeoutError:
            counts = {code: statuses.count(code) for code in sorted(set(statuses))}
            raise AssertionError(f"no second replica after 180 s; statuses: {counts}") from None
        stop.set()
        worker.join(90)
        refused = statuses.count(429)
        print(f"\nscaled up to 2 after {up_s:.0f} s; {refused} of {len(statuses)} refused (429)")
        assert refused > 0
        assert set(statuses) <= {200, 429, 503}, sorted(set(statuses))
    finally:
        stop.set()
