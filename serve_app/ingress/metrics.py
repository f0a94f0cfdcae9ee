"""The ingress's Prometheus metrics, through Ray's metrics API (so they reach Ray's endpoint and
dashboard; the engine replicas' own are in serve_app/engine/metrics.py).

`ray.serve.metrics` adds the deployment, replica and application tags. Ray prefixes every name
with `ray_` on its Prometheus endpoint (counters also get `_total`): `serve_app_requests` is
scraped as `ray_serve_app_requests_total`. Goodput is the rate of `serve_app_slo_requests`
with result="met": requests served within every latency target they carried.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from ray.serve.metrics import Counter, Histogram

from serve_app.timing import Stage

# Milliseconds: from a fast GPU token (~2 ms) to a long queue (~1 min).
TTFT_BOUNDARIES_MS: list[float] = [
    5,
    10,
    25,
    50,
    100,
    250,
    500,
    1000,
    2500,
    5000,
    10000,
    30000,
    60000,
]
TPOT_BOUNDARIES_MS: list[float] = [1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000]
# Milliseconds per TTFT stage: from a sub-millisecond hop to a long engine queue.
STAGE_BOUNDARIES_MS: list[float] = [0.1, 0.25, 0.5, 1, 2.5, *TTFT_BOUNDARIES_MS[:-1]]
# The label of a request whose SLO class is not configured (its headers were refused): client
# input never becomes a label value, so the number of series stays bounded.
OTHER_CLASS = "other"
STAGES = frozenset(Stage)


def _keys(*names: str) -> Any:
    # Ray annotates tag_keys as tuple[str] (one element); any tuple of names is meant.
    return names


class Outcome(StrEnum):
    SERVED = "served"
    REJECTED = "rejected"  # 429: SLO unmeetable or pools saturated
    CLIENT_ERROR = "client_error"
    SERVER_ERROR = "server_error"
    DISCONNECTED = "disconnected"


def outcome_of(status: int) -> Outcome:
    if status == 429:
        return Outcome.REJECTED
    if status >= 500:
        return Outcome.SERVER_ERROR
    if status >= 400:
        return Outcome.CLIENT_ERROR
    return Outcome.SERVED


class IngressMetrics:
    """What the ingress measures: per pool and SLO class, as the client sees it.

    `classes` are the configured SLO classes: any other class is labelled `other`, and a request
    that names none is labelled with the default class.
    """

    def __init__(self, classes: frozenset[str] = frozenset(), default_class: str = "") -> None:
        self._classes = classes
        self._default = default_class
        self.requests = Counter(
            "serve_app_requests",
            description="Requests by pool, SLO class and outcome.",
            tag_keys=_keys("pool", "slo_class", "outcome"),
        )
        self.routes = Counter(
            "serve_app_route_decisions",
            description="Routing decisions by pool and reason (pool 'none' for refusals).",
            tag_keys=_keys("pool", "reason"),
        )
        self.ttft = Histogram(
            "serve_app_ttft_ms",
            description="Time to first token at the ingress, ms.",
            boundaries=TTFT_BOUNDARIES_MS,
            tag_keys=_keys("pool", "slo_class"),
        )
        self.tpot = Histogram(
            "serve_app_tpot_ms",
            description="Mean time per output token after the first, ms.",
            boundaries=TPOT_BOUNDARIES_MS,
            tag_keys=_keys("pool", "slo_class"),
        )
        self.slo = Counter(
            "serve_app_slo_requests",
            description="Served requests by whether they met every latency target (goodput).",
            tag_keys=_keys("pool", "slo_class", "result"),
        )
        self.prompt_tokens = Counter(
            "serve_app_prompt_tokens", description="Prompt tokens served.", tag_keys=_keys("pool")
        )
        self.generation_tokens = Counter(
            "serve_app_generation_tokens",
            description="Tokens generated.",
            tag_keys=_keys("pool"),
        )
        self.stage = Histogram(
            "serve_app_ttft_stage_ms",
            description="The first token's time per stage of its way (serve_app/timing.py), ms.",
            boundaries=STAGE_BOUNDARIES_MS,
            tag_keys=_keys("pool", "slo_class", "stage"),
        )

    def label(self, slo_class: str) -> str:
        slo_class = slo_class.strip() or self._default
        return slo_class if slo_class in self._classes else OTHER_CLASS

    def request(self, pool: str, slo_class: str, outcome: Outcome) -> None:
        tags = {"pool": pool, "slo_class": self.label(slo_class), "outcome": outcome.value}
        self.requests.inc(1, tags)

    def stages(self, pool: str, slo_class: str, stages: Mapping[str, float]) -> None:
        """One request's TTFT stages (names other than the stages', e.g. the total, skipped)."""
        cls = self.label(slo_class)
        for name, ms in stages.items():
            if name in STAGES:
                self.stage.observe(ms, {"pool": pool, "slo_class": cls, "stage": name})

    def route(self, pool: str, reason: str) -> None:
        self.routes.inc(1, {"pool": pool, "reason": reason})

    def served(
        self,
        pool: str,
        slo_class: str,
        ttft_ms: float,
        tpot_ms: float | None,
        slo_met: bool,
        prompt_tokens: int,
        generated_tokens: int,
    ) -> None:
        tags = {"pool": pool, "slo_class": self.label(slo_class)}
        self.ttft.observe(ttft_ms, tags)
        if tpot_ms is not None:
            self.tpot.observe(tpot_ms, tags)
        self.slo.inc(1, {**tags, "result": "met" if slo_met else "missed"})
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens, {"pool": pool})
        if generated_tokens:
            self.generation_tokens.inc(generated_tokens, {"pool": pool})
