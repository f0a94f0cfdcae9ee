"""SLO routing on the real two-pool deployment: pool choice, refusals under a flood."""

from __future__ import annotations

import asyncio
import copy
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import pytest

from serve_app.bench.goodput import pools_idle
from serve_app.bench.servers import direct_ingress_urls
from serve_app.timing import parse_server_timing
from tests.integration.conftest import AppServer, redeploy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LONG_PROMPT = [100 + i % 3000 for i in range(2500)]  # longer than low-latency's 2048


def post(
    server: AppServer, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)


def test_prompt_longer_than_low_latency_context_goes_to_throughput(app_server: AppServer) -> None:
    r = post(app_server, {"prompt": LONG_PROMPT, "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.headers["x-serve-pool"] == "throughput"
    assert r.json()["usage"]["prompt_tokens"] == len(LONG_PROMPT)


def test_tight_ttft_goes_to_low_latency_while_throughput_is_busy(app_server: AppServer) -> None:
    long_body = {"prompt": [7] * 3500, "max_tokens": 16, "ignore_eos": True}
    # class batch (no latency target): the burst loads the throughput pool and is all served
    # (in the default class, admission refuses those that would wait past its 2 s TTFT)
    batch = {"x-slo-class": "batch"}
    with ThreadPoolExecutor(12) as pool, httpx.Client(base_url=app_server.url) as c:
        futures = [pool.submit(post, app_server, long_body, batch) for _ in range(12)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.get("/pools").json()["throughput"]["waiting"] < 3:
            time.sleep(0.02)
        busy = c.get("/pools").json()["throughput"]
        tight = post(
            app_server,
            {"prompt": "Hi!", "max_tokens": 4},
            {"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "200"},
        )
        long_statuses = [f.result().status_code for f in futures]
        # each ingress replica answers /pools with what it learned itself: ask several times
        learned = [c.get("/pools").json()["throughput"] for _ in range(10)]
    assert busy["waiting"] >= 3, busy
    # the requests that queued taught the wait in vLLM's queue apart from their own prefill
    # (one factor over both would have moved the two alike)
    assert any(p["wait_factor"] != p["ttft_factor"] for p in learned), learned
    assert tight.status_code == 200, tight.text
    assert tight.headers["x-serve-pool"] == "low-latency"
    assert tight.headers["x-route-reason"] in ("slo-fit", "slo-tight", "spillover")
    assert all(s == 200 for s in long_statuses), long_statuses


def test_unmeetable_slo_is_refused_unless_best_effort(app_server: AppServer) -> None:
    body = {"prompt": "Hello", "max_tokens": 4}
    strict = post(app_server, body, {"x-slo-ttft-ms": "1"})
    assert strict.status_code == 429, strict.text
    assert int(strict.headers["retry-after"]) >= 1
    assert strict.json()["error"]["code"] == "slo-unmeetable"
    lenient = post(app_server, body, {"x-slo-ttft-ms": "1", "x-slo-policy": "best-effort"})
    assert lenient.status_code == 200, lenient.text
    assert lenient.headers["x-route-reason"] == "best-effort"


async def _flood(url: str, n: int) -> list[tuple[int, float, dict[str, str], dict[str, Any]]]:
    body = {"prompt": "Write a story about a robot.", "max_tokens": 64, "ignore_eos": True}
    headers = {"x-slo-class": "interactive"}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one() -> tuple[int, float, dict[str, str], dict[str, Any]]:
            started = time.perf_counter()
            r = await client.post("/v1/completions", json=body, headers=headers)
            return r.status_code, time.perf_counter() - started, dict(r.headers), r.json()

        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), 240)


def test_flood_is_refused_early_and_admitted_requests_complete(app_server: AppServer) -> None:
    results = asyncio.run(_flood(app_server.url, 160))
    refused = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert len(refused) + len(served) == len(results), {r[0] for r in results}
    assert refused and served
    for _, _, headers, body in refused:
        assert int(headers["retry-after"]) >= 1
        assert body["error"]["code"] in ("saturated", "slo-unmeetable", "protects-running")
    for _, _, _, body in served:
        assert body["usage"]["completion_tokens"] == 64
    refused_ms = sorted(r[1] * 1e3 for r in refused)
    served_ms = sorted(r[1] * 1e3 for r in served)
    print(
        f"\nflood of {len(results)}: {len(served)} served "
        f"(median {statistics.median(served_ms):.0f} ms), "
        f"{len(refused)} refused (median {statistics.median(refused_ms):.0f} ms, "
        f"max {refused_ms[-1]:.0f} ms)"
    )


def test_pools_on_one_cpu_protect_each_others_decodes(app_server: AppServer) -> None:
    """Both engines run on this machine's cores, as their replicas report: a prefill admitted
    to one pool is checked against the decodes of the other too."""
    pools = httpx.get(f"{app_server.url}/pools").json()
    assert pools["low-latency"]["shares_device_with"] == ["throughput"], pools
    assert pools["throughput"]["shares_device_with"] == ["low-latency"], pools


HOLD_MS = 20  # one poll of routing.hold_poll_ms


@dataclass(frozen=True)
class Burst:
    responses: list[httpx.Response]
    tpot_ms: float  # the documents' TPOT target
    prefill_ms: float  # one document's prefill at the faster of the rates read around the burst

    def slacks(self, at_once: bool = False) -> list[float]:
        """Each admitted document's slack (2 tokens: its target less its own predicted TPOT);
        `at_once`: only those admitted as the burst came (routed within one hold poll)."""
        return [
            self.tpot_ms - float(r.headers["x-route-predicted-tpot-ms"])
            for r in self.responses
            if r.status_code == 200 and (not at_once or _route_ms([r])[0] < HOLD_MS)
        ]

    @property
    def binds(self) -> bool:
        """No document admitted as the burst came had room for another's prefill in its slack
        (one held and admitted later is predicted beside fewer documents, so with more slack:
        not what the burst met)."""
        return max(self.slacks(at_once=True), default=0.0) < self.prefill_ms

    def __str__(self) -> str:
        return (
            f"target {self.tpot_ms:.0f} ms, slacks {[round(s) for s in self.slacks()]} ms against "
            f"a prefill of {self.prefill_ms:.0f} ms, route ms {_route_ms(self.responses)}, "
            f"{sum(r.status_code == 429 for r in self.responses)} refused"
        )


def _prefill_tok_s(ingress: str) -> float:
    """The throughput pool's measured prefill rate (or the prior's 0.05 ms a token)."""
    return float(httpx.get(f"{ingress}/pools").json()["throughput"]["prefill_tok_s"] or 20_000)


def _burst(ingress: str, ks: tuple[int, ...], policy: str) -> Burst:
    """Documents (3,000 tokens, only `throughput` holds them) sent together to one ingress
    replica (each learns on its own, and the target is set from its prediction), with a TPOT
    target just above what routing predicts for one now (it learns from what ran before: a
    fixed target could be unmeetable), so that each has far less slack than a prompt's prefill
    takes; `ks` makes each prompt its own (no prefix cache hits). The pools are idle first: a
    prediction made beside requests of earlier tests would set a target with room to spare."""
    docs = [
        {"prompt": [100 + (i * k) % 3000 for i in range(3000)], "max_tokens": 2, "ignore_eos": True}
        for k in (*ks, ks[0] + 1)
    ]
    deadline = time.monotonic() + 60
    while not pools_idle(httpx.get(f"{ingress}/pools").json()) and time.monotonic() < deadline:
        time.sleep(0.5)
    url = f"{ingress}/v1/completions"
    probe = httpx.post(url, json=docs.pop(), headers={"x-slo-class": "batch"}, timeout=120)
    assert probe.status_code == 200, probe.text
    # the slack of each (2 tokens: target - predicted TPOT) is a fifth of one prompt's prefill
    before = _prefill_tok_s(ingress)
    tpot_ms = float(probe.headers["x-route-predicted-tpot-ms"]) + 0.2 * 3000 * 1000 / before
    headers = {"x-slo-ttft-ms": "30000", "x-slo-tpot-ms": f"{tpot_ms:.0f}"}
    with ThreadPoolExecutor(len(docs)) as pool:
        responses = list(
            pool.map(
                lambda doc: httpx.post(
                    url, json=doc, headers=headers | {"x-route-policy": policy}, timeout=120
                ),
                docs,
            )
        )
    faster = max(before, _prefill_tok_s(ingress))
    return Burst(responses, float(f"{tpot_ms:.0f}"), 3000 * 1000 / faster)


def _route_ms(responses: list[httpx.Response]) -> list[float]:
    return sorted(
        parse_server_timing(r.headers["server-timing"])["route"]
        for r in responses
        if r.status_code == 200
    )


def test_documents_sent_together_wait_for_each_others_tpot(app_server: AppServer) -> None:
    """Admission protects the requests queued for their first token, not only those decoding:
    documents sent together, while none of them decodes yet, do not all go to the engine at
    once (each would decode while the others prefill). The later ones wait at the ingress,
    which shows as their `route` stage (or are refused for it). Protecting only the decoding
    requests (`slo:headroom:decoding`) lets the whole burst in at once."""
    # one ingress replica (the flood before may have scaled them to two)
    ingress = _ingress_urls()[0]
    at_once = _burst(ingress, (1, 3, 7, 11), "slo:headroom:decoding")
    # what the probe teaches routing may move the burst's own predictions past the target's
    # margin: a burst whose slacks do not bind shows nothing, and is sent again (new prompts)
    keys = iter([(13, 17, 19, 23), (29, 31, 37, 41), (43, 47, 53, 59)])
    bursts = [_burst(ingress, next(keys), "slo:headroom:queued")]
    while not bursts[-1].binds and len(bursts) < 3:
        bursts.append(_burst(ingress, next(keys), "slo:headroom:queued"))
    protected = bursts[-1]
    print(
        f"\n4 documents together: decoding-only route ms {_route_ms(at_once.responses)}; "
        f"queued too: {'; '.join(map(str, bursts))}"
    )
    for burst in (at_once, protected):
        refused = [r for r in burst.responses if r.status_code == 429]
        assert all(r.status_code in (200, 429) for r in burst.responses), [
            r.text for r in burst.responses
        ]
        assert all(r.json()["error"]["code"] == "protects-running" for r in refused), [
            r.text for r in refused
        ]
        assert all(
            r.headers["x-serve-pool"] == "throughput" for r in burst.responses if r.is_success
        )
    assert all(r.status_code == 200 for r in at_once.responses)
    assert max(_route_ms(at_once.responses)) < HOLD_MS
    assert protected.binds, bursts
    assert (
        any(r.status_code == 429 for r in protected.responses)
        or max(_route_ms(protected.responses)) >= HOLD_MS
    ), protected


def _ingress_urls() -> list[str]:
    """Each ingress replica's own HTTP address (its Ray runs under pytest, not under an app
    process: every process is searched)."""
    return direct_ingress_urls(psutil.process_iter())


def _others_protect(url: str, pool: str) -> dict[str, Any]:
    return httpx.get(f"{url}/pools").json()[pool]["protected_by_other_ingresses"]


def test_an_ingress_protects_the_requests_another_ingress_admitted(app_server: AppServer) -> None:
    """Two ingress replicas: a document streaming through one, with a TPOT target, is
    protected by the other too (each posts what it protects to the pool-state board, and takes
    the others' posts with the pools' state), and its pace is the other's floor under the
    pool's predicted TPOT."""
    config = copy.deepcopy(app_server.config)
    for d in config["applications"][0]["deployments"]:
        if d["name"] == "Ingress":
            d["autoscaling_config"] = {**d["autoscaling_config"], "min_replicas": 2}
    redeploy(app_server, config)
    try:
        deadline = time.monotonic() + 60
        while len(urls := _ingress_urls()) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        assert len(urls) == 2, urls
        one, other = urls
        assert _others_protect(other, "throughput") == {}
        doc = {"prompt": [100 + i % 3000 for i in range(3000)], "max_tokens": 200}
        body = doc | {"ignore_eos": True, "stream": True}
        # a loose target: the document keeps a positive slack for the whole of its decode
        headers = {"x-slo-ttft-ms": "30000", "x-slo-tpot-ms": "1000"}
        seen: list[dict[str, Any]] = []
        with httpx.stream(
            "POST", f"{one}/v1/completions", json=body, headers=headers, timeout=120
        ) as streamed:
            assert streamed.status_code == 200, streamed.read()[:500]
            chunks = streamed.iter_lines()
            next(chunks)  # its first token: it decodes now
            deadline = time.monotonic() + 3  # a few board round trips (0.25 s each way)
            while time.monotonic() < deadline:
                seen = list(_others_protect(other, "throughput").values())
                if any(p["decode_pace_ms"] is not None for p in seen):  # decoding, paced
                    break
                time.sleep(0.05)
            view = httpx.get(f"{other}/pools").json()["throughput"]
            for _ in chunks:
                pass
        print(
            f"\nthe other ingress sees: {seen}; its decode slack {view['decode_slack_ms']} ms, "
            f"pace {view['decode_pace_ms']} ms"
        )
        assert len(seen) == 1 and (seen[0]["decode_slack_ms"] or 0) > 0, seen
        assert view["decode_slack_ms"] is not None
        assert view["decode_pace_ms"] is not None  # the pool's pace, from the only one decoding
        deadline = time.monotonic() + 3  # and withdraws it once the document is done
        while _others_protect(other, "throughput") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _others_protect(other, "throughput") == {}
    finally:
        redeploy(app_server, app_server.config)
