"""The Grafana dashboard, built in code from the metrics in serve_app/ingress/metrics.py and
serve_app/engine/metrics.py.

Every panel's PromQL is listed by `panel_queries()` so tests can evaluate each one against a
real Prometheus. Ray exports our metrics with a `ray_` prefix (counters with `_total`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DASHBOARD_UID = "serve-app-slo"
DATASOURCE_VAR = "datasource"
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""
    width: int = 12
    stacked: bool = False


def _rate(metric: str, by: str, selector: str = "") -> str:
    return f"sum by ({by}) (rate({metric}{selector}[{RATE}]))"


def _quantile(q: float, metric: str) -> Query:
    expr = f"histogram_quantile({q}, sum by (le, pool) (rate({metric}_bucket[{RATE}])))"
    return Query(expr, f"p{int(q * 100)} {{{{pool}}}}")


SLO = "ray_serve_app_slo_requests_total"
MET = '{result="met"}'
PANELS: tuple[Panel, ...] = (
    Panel(
        "Goodput: requests/s served within their SLO, by class",
        "reqps",
        (Query(_rate(SLO, "slo_class", MET), "{{slo_class}}"),),
        "Served requests that met every latency target they carried, per second.",
    ),
    Panel(
        "SLO attainment by class and pool",
        "percentunit",
        (
            Query(
                _rate(SLO, "slo_class, pool", MET) + " / " + _rate(SLO, "slo_class, pool"),
                "{{slo_class}} @ {{pool}}",
            ),
        ),
        "Share of served requests that met their SLO.",
    ),
    Panel(
        "TTFT p50 / p99 by pool (at the ingress)",
        "ms",
        (_quantile(0.5, "ray_serve_app_ttft_ms"), _quantile(0.99, "ray_serve_app_ttft_ms")),
    ),
    Panel(
        "TPOT p50 / p99 by pool",
        "ms",
        (_quantile(0.5, "ray_serve_app_tpot_ms"), _quantile(0.99, "ray_serve_app_tpot_ms")),
    ),
    Panel(
        "Tokens/s by pool",
        "short",
        (
            Query(_rate("ray_serve_app_generation_tokens_total", "pool"), "generated {{pool}}"),
            Query(_rate("ray_serve_app_prompt_tokens_total", "pool"), "prompt {{pool}}"),
        ),
    ),
    Panel(
        "Requests/s by outcome",
        "reqps",
        (Query(_rate("ray_serve_app_requests_total", "outcome"), "{{outcome}}"),),
    ),
    Panel(
        "Rejections/s by reason",
        "reqps",
        (
            Query(
                _rate("ray_serve_app_route_decisions_total", "reason", '{pool="none"}'),
                "{{reason}}",
            ),
        ),
        "Requests refused before reaching an engine (429 SLO unmeetable / saturated, 400 "
        "too long, 503 no replica).",
    ),
    Panel(
        "Routing decisions/s by pool and reason",
        "reqps",
        (
            Query(
                _rate("ray_serve_app_route_decisions_total", "pool, reason", '{pool!="none"}'),
                "{{pool}}: {{reason}}",
            ),
        ),
    ),
    Panel(
        "Queue depth by pool (engine waiting / running)",
        "short",
        (
            Query("sum by (pool) (ray_serve_app_engine_waiting)", "waiting {{pool}}"),
            Query("sum by (pool) (ray_serve_app_engine_running)", "running {{pool}}"),
        ),
    ),
    Panel(
        "Replicas by pool",
        "short",
        (Query("count by (pool) (ray_serve_app_engine_running)", "{{pool}}"),),
        "Engine replicas reporting scheduler stats.",
    ),
    Panel(
        "KV cache usage by pool",
        "percentunit",
        (
            Query("avg by (pool) (ray_serve_app_kv_cache_usage)", "mean {{pool}}"),
            Query("max by (pool) (ray_serve_app_kv_cache_usage)", "max {{pool}}"),
        ),
    ),
    Panel(
        "Prefix cache hit rate by pool",
        "percentunit",
        (Query("avg by (pool) (ray_serve_app_prefix_cache_hit_rate)", "{{pool}}"),),
    ),
)


STAGE = "ray_serve_app_ttft_stage_ms"


def _stage_quantile(q: float) -> Query:
    expr = f"histogram_quantile({q}, sum by (le, pool, stage) (rate({STAGE}_bucket[{RATE}])))"
    return Query(expr, "{{pool}} {{stage}}")


# A row of its own: where each first token's time goes, stage by stage (serve_app/timing.py).
TTFT_ROW = "Where TTFT goes"
STAGE_PANELS: tuple[Panel, ...] = (
    Panel(
        "TTFT stages p50 by pool (stacked)",
        "ms",
        (_stage_quantile(0.5),),
        "Median time of each stage of the first token's way: proxy, ingress (parse and "
        "tokenize), route, dispatch, engine_in, queue, prefill, engine_out, return, emit. "
        "Stacked, the stages of one pool add up to about its TTFT.",
        stacked=True,
    ),
    Panel(
        "TTFT stages p99 by pool (stacked)",
        "ms",
        (_stage_quantile(0.99),),
        "99th percentile of each stage (quantiles of stages do not add up exactly; the stack "
        "shows which stage dominates the tail).",
        stacked=True,
    ),
)


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    custom = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60}
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": f"${{{DATASOURCE_VAR}}}"},
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": panel.unit, **({"custom": custom} if panel.stacked else {})},
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "table", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": f"${{{DATASOURCE_VAR}}}"},
                "expr": q.expr,
                "legendFormat": q.legend,
            }
            for i, q in enumerate(panel.queries)
        ],
    }


def _row_json(title: str, panel_id: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        "panels": [],
    }


def _grid(panels: tuple[Panel, ...], out: list[dict[str, Any]], y: int) -> int:
    """Append the panels laid out left to right from height y; returns the y below them."""
    x = 0
    for panel in panels:
        if x + panel.width > 24:
            x, y = 0, y + 8
        out.append(_panel_json(panel, len(out) + 1, x, y))
        x += panel.width
    return y + 8


def build_dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = _grid(PANELS, panels, 0)
    panels.append(_row_json(TTFT_ROW, len(panels) + 1, y))
    _grid(STAGE_PANELS, panels, y + 1)
    return {
        "uid": DASHBOARD_UID,
        "title": "serve-app: SLO routing and goodput",
        "tags": ["serve-app", "llm", "ray-serve", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": DATASOURCE_VAR,
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    return [(p.title, q.expr) for p in PANELS + STAGE_PANELS for q in p.queries]
