"""An engine replica's Prometheus gauges, through Ray's metrics API (see ingress/metrics.py)."""

from __future__ import annotations

from typing import Any

from ray.serve.metrics import Gauge

from serve_app.engine.protocol import EngineStats


class ReplicaMetrics:
    """Engine scheduler gauges, one series per replica (Serve adds the replica tag)."""

    def __init__(self, pool: str) -> None:
        tags: Any = ("pool",)  # Ray annotates tag_keys as a one-element tuple
        self._tags = {"pool": pool}
        self.waiting = Gauge("serve_app_engine_waiting", "Requests queued in the engine.", tags)
        self.running = Gauge("serve_app_engine_running", "Requests in the engine's batch.", tags)
        self.kv = Gauge("serve_app_kv_cache_usage", "KV cache blocks in use (0-1).", tags)
        self.prefix_hit = Gauge(
            "serve_app_prefix_cache_hit_rate", "Prefix cache hit rate since start (0-1).", tags
        )

    def update(self, stats: EngineStats) -> None:
        self.waiting.set(stats.waiting, self._tags)
        self.running.set(stats.running, self._tags)
        self.kv.set(stats.kv_cache_usage, self._tags)
        self.prefix_hit.set(stats.prefix_cache_hit_rate, self._tags)
