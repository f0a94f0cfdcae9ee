"""The ingress's routing state around the pure policy: pool views, local load, learned models.

Board snapshots arrive a few times a second; between them, a burst of requests would all see the
same stale queue. So the router also counts this ingress's own requests per pool (dispatched and
waiting for a first token, or streaming) and uses the larger of the two counts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from serve_app.constants import STATS_STALE_AFTER_S
from serve_app.pool_state import PoolSnapshot
from serve_app.routing.config import Policy, RoutingConfig
from serve_app.routing.estimator import LatencyModel
from serve_app.routing.policy import (
    Decision,
    PoolView,
    RequestFeatures,
    decide,
    decide_plain,
)
from serve_app.routing.slo import SLO


@dataclass(slots=True)
class _Local:
    waiting: int = 0
    running: int = 0


@dataclass(frozen=True, slots=True)
class Load:
    """A pool's per-replica load as the policy saw it when routing a request."""

    waiting: float
    running: float


class Router:
    def __init__(self, pools: Mapping[str, int], config: RoutingConfig) -> None:
        """`pools` maps each pool name to its max_model_len."""
        self._config = config
        self._max_len = dict(pools)
        self._models = {name: LatencyModel(config.prior(name)) for name in pools}
        self._local = {name: _Local() for name in pools}
        self._snapshots: dict[str, PoolSnapshot] = {name: PoolSnapshot(name) for name in pools}
        self._turn = 0
        self._failed: dict[str, list[float]] = {name: [] for name in pools}

    def update(self, snapshots: Mapping[str, PoolSnapshot]) -> None:
        for name, snap in snapshots.items():
            if name in self._snapshots:
                self._snapshots[name] = snap

    @property
    def snapshots(self) -> Mapping[str, PoolSnapshot]:
        return self._snapshots

    def replica_failed(self, pool: str, now: float) -> None:
        """A replica of `pool` failed a request: count it out until the board has noticed
        (an unhealthy or silent replica leaves the snapshot within STATS_STALE_AFTER_S)."""
        self._failed[pool].append(now + STATS_STALE_AFTER_S)

    def _replicas(self, name: str, now: float) -> int:
        failed = self._failed[name]
        if failed:
            failed[:] = [t for t in failed if t > now]
        return max(0, self._snapshots[name].replicas - len(failed))

    def views(self, now: float | None = None) -> list[PoolView]:
        now = time.time() if now is None else now
        views = []
        for name, snap in self._snapshots.items():
            local = self._local[name]
            views.append(
                PoolView(
                    name=name,
                    max_model_len=self._max_len[name],
                    replicas=self._replicas(name, now),
                    waiting=max(snap.waiting, local.waiting),
                    running=max(snap.running, local.running),
                    model=self._models[name],
                    updated_at=snap.updated_at,
                )
            )
        return views

    def decide(
        self,
        features: RequestFeatures,
        slo: SLO,
        now: float,
        policy: Policy = Policy.SLO,
        single_pool: str | None = None,
    ) -> Decision:
        if policy is Policy.SLO:
            return decide(features, slo, self.views(now), self._config, now)
        self._turn += 1
        only = single_pool if policy is Policy.SINGLE else None
        return decide_plain(features, self.views(now), now, self._turn, only)

    def load_of(self, pool: str) -> Load:
        view = next(v for v in self.views() if v.name == pool)
        r = max(view.replicas, 1)
        return Load(view.waiting / r, view.running / r)

    def dispatched(self, pool: str) -> None:
        self._local[pool].waiting += 1

    def first_token(self, pool: str) -> None:
        local = self._local[pool]
        local.waiting -= 1
        local.running += 1

    def finished(self, pool: str, got_first_token: bool) -> None:
        local = self._local[pool]
        if got_first_token:
            local.running -= 1
        else:
            local.waiting -= 1

    def learn(
        self,
        pool: str,
        prompt_tokens: int,
        load: Load,
        ttft_ms: float | None,
        tpot_ms: float | None,
    ) -> None:
        self._models[pool] = self._models[pool].learn(
            prompt_tokens, load.waiting, load.running, ttft_ms, tpot_ms, self._config.learning_rate
        )

    def model(self, pool: str) -> LatencyModel:
        return self._models[pool]
