"""Pool state: what every pool's replicas report, aggregated into one snapshot per pool.

Replicas push a `ReplicaReport` to the board a few times a second; the ingress pulls the whole
board as often, in the background, so routing reads a local copy and never waits on it. The
ingresses also tell the board how many requests they refused for want of each pool's capacity;
the board hands each replica its share, which the pool's autoscaling counts as demand. And each
ingress posts what its admission protects on each pool (`Protected`), which the board hands to
the other ingresses with the pools' state.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from serve_app.constants import STATS_PERIOD_S, STATS_STALE_AFTER_S
from serve_app.engine.protocol import BoardReply, Placement, ReplicaReport
from serve_app.routing.estimator import Protected

REFUSALS_WINDOW_S = 5.0
# An ingress posts what it protects every STATS_PERIOD_S; a post older than a few of those is
# from an ingress that is gone, and the requests it protected with it.
PROTECTED_STALE_AFTER_S = 4 * STATS_PERIOD_S


@dataclass(frozen=True, slots=True)
class IngressPost:
    """What an ingress tells the board at each refresh, sent with its request for the snapshot:
    one call, not one per kind of news (a Serve call costs both processes more CPU than
    what it carries). Empty fields: nothing new; `protected` None: no post (an empty dict
    withdraws the last one)."""

    ingress_id: str
    lag_ms_by_pool: Mapping[str, float] | None = None
    refused: Mapping[str, int] | None = None
    protected: Mapping[str, Protected] | None = None


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A pool's state as the router sees it: sums and means over its live replicas."""

    pool: str
    replicas: int = 0
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    ttft_ms_recent_p50: float | None = None
    tpot_ms_recent_p50: float | None = None
    updated_at: float = 0.0
    placements: tuple[tuple[str, Placement], ...] = ()  # (replica id, where it runs)
    queued_tokens: int = 0  # prompt tokens queued for prefill, all replicas
    prefill_tok_s: float | None = None  # mean measured prefill rate per replica
    # what each ingress's admission protects on this pool: (ingress id, its latest post)
    protected: tuple[tuple[str, Protected], ...] = ()

    @property
    def ready(self) -> bool:
        return self.replicas > 0


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def aggregate(
    pools: Iterable[str],
    reports: Iterable[ReplicaReport],
    now: float,
    protected: Mapping[str, Mapping[str, Protected]] | None = None,
) -> dict[str, PoolSnapshot]:
    """One snapshot per pool from the latest report of each replica, and `protected`'s posts
    (ingress id -> pool -> what it protects there).

    Reports older than STATS_STALE_AFTER_S, or from an unhealthy engine, are left out: that
    replica is gone or dying, and counting it would route work to it.
    """
    posts = protected or {}
    live: dict[str, list[ReplicaReport]] = {p: [] for p in pools}
    for r in reports:
        if r.pool in live and r.stats.healthy and now - r.reported_at <= STATS_STALE_AFTER_S:
            live[r.pool].append(r)
    out = {}
    for pool, rs in live.items():
        n = len(rs)
        out[pool] = PoolSnapshot(
            pool=pool,
            replicas=n,
            waiting=sum(r.stats.waiting for r in rs),
            running=sum(r.stats.running for r in rs),
            kv_cache_usage=sum(r.stats.kv_cache_usage for r in rs) / n if n else 0.0,
            prefix_cache_hit_rate=(
                sum(r.stats.prefix_cache_hit_rate for r in rs) / n if n else 0.0
            ),
            ttft_ms_recent_p50=_p50([v for r in rs for v in r.ttft_ms_recent]),
            tpot_ms_recent_p50=_p50([v for r in rs for v in r.tpot_ms_recent]),
            updated_at=max((r.reported_at for r in rs), default=0.0),
            placements=tuple(sorted((r.replica_id, r.placement) for r in rs)),
            queued_tokens=sum(r.queued_tokens for r in rs),
            prefill_tok_s=_mean([r.prefill_tok_s for r in rs if r.prefill_tok_s is not None]),
            protected=tuple(
                (ingress, by_pool[pool]) for ingress, by_pool in posts.items() if pool in by_pool
            ),
        )
    return out


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


class PoolStateBoard:
    """Latest report per replica. A Serve deployment with one replica and no CPU reservation."""

    def __init__(self, pools: list[str]) -> None:
        self._pools = list(pools)
        self._reports: dict[str, ReplicaReport] = {}
        # ingress replica -> (when, {pool: how late its chunks arrive, ms})
        self._lags: dict[str, tuple[float, dict[str, float]]] = {}
        self._refusals: deque[tuple[float, str, int]] = deque()  # (when, pool, how many)
        # ingress replica -> (when it posted, {pool: what it protects there})
        self._protected: dict[str, tuple[float, dict[str, Protected]]] = {}

    def consumer_lag(self, ingress_id: str, lag_ms_by_pool: dict[str, float]) -> None:
        self._lags[ingress_id] = (time.time(), lag_ms_by_pool)

    def protect(
        self, ingress_id: str, by_pool: dict[str, Protected], now: float | None = None
    ) -> None:
        """What an ingress's admission protects now, per pool (an empty post: nothing)."""
        self._protected[ingress_id] = (time.time() if now is None else now, by_pool)

    def refused(self, counts: dict[str, int], now: float | None = None) -> None:
        """An ingress refused `counts[pool]` requests for want of that pool's capacity."""
        now = time.time() if now is None else now
        self._refusals.extend((now, pool, n) for pool, n in counts.items() if n > 0)

    def _refused_per_s(self, pool: str, now: float) -> float:
        while self._refusals and self._refusals[0][0] < now - REFUSALS_WINDOW_S:
            self._refusals.popleft()
        return sum(n for _, p, n in self._refusals if p == pool) / REFUSALS_WINDOW_S

    def report(self, report: ReplicaReport) -> BoardReply:
        """Store a replica's report; answer the worst recent consumer lag of its pool and the
        replica's share of the pool's refused demand."""
        self._reports[report.replica_id] = report
        fresh = report.reported_at - STATS_STALE_AFTER_S
        lags = [
            lags[report.pool]
            for at, lags in self._lags.values()
            if at >= fresh and report.pool in lags
        ]
        # Forget replicas long gone so the board does not grow across scale-downs.
        cutoff = report.reported_at - 10 * STATS_STALE_AFTER_S
        for rid in [k for k, r in self._reports.items() if r.reported_at < cutoff]:
            del self._reports[rid]
        for iid in [k for k, (at, _) in self._lags.items() if at < cutoff]:
            del self._lags[iid]
        replicas = sum(
            r.pool == report.pool and r.reported_at >= fresh for r in self._reports.values()
        )
        share = self._refused_per_s(report.pool, report.reported_at) / max(replicas, 1)
        return BoardReply(max(lags, default=None), share)

    def exchange(self, post: IngressPost, now: float | None = None) -> Mapping[str, PoolSnapshot]:
        """An ingress's refresh: take its news, answer the pools' state."""
        now = time.time() if now is None else now
        if post.lag_ms_by_pool:
            self.consumer_lag(post.ingress_id, dict(post.lag_ms_by_pool))
        if post.refused:
            self.refused(dict(post.refused), now)
        if post.protected is not None:
            self.protect(post.ingress_id, dict(post.protected), now)
        return self.snapshot(now)

    def snapshot(self, now: float | None = None) -> Mapping[str, PoolSnapshot]:
        now = time.time() if now is None else now
        for ingress in [
            i for i, (at, _) in self._protected.items() if now - at > PROTECTED_STALE_AFTER_S
        ]:
            del self._protected[ingress]
        posts = {ingress: by_pool for ingress, (_, by_pool) in self._protected.items()}
        return aggregate(self._pools, self._reports.values(), now, posts)
