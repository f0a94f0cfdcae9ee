import json
import re

from serve_app.constants import PACKAGE_DIR
from serve_app.observability.__main__ import DEFAULT_PATH, main
from serve_app.observability.dashboard import (
    DASHBOARD_UID,
    build_dashboard,
    dashboard_json,
    panel_queries,
)


def test_committed_dashboard_is_current() -> None:
    assert DEFAULT_PATH.read_text() == dashboard_json(), (
        "run `python -m serve_app.observability write`"
    )
    assert main(["check"]) == 0


def test_panels_cover_what_operators_watch() -> None:
    titles = " | ".join(p["title"] for p in build_dashboard()["panels"]).lower()
    for needed in ("goodput", "attainment", "ttft", "tpot", "tokens/s", "queue", "replicas"):
        assert needed in titles
    assert "kv cache" in titles and "rejections" in titles


def test_every_query_uses_a_metric_the_app_exports() -> None:
    source = "".join(
        (PACKAGE_DIR / part / "metrics.py").read_text() for part in ("ingress", "engine")
    )
    exported = set(re.findall(r'"(serve_app_[a-z_]+)"', source))
    for title, expr in panel_queries():
        names = set(re.findall(r"ray_(serve_app_[a-z_]+?)(?:_total|_bucket)?\b", expr))
        assert names and names <= exported, (title, expr)


def test_panels_use_the_datasource_variable() -> None:
    dashboard = build_dashboard()
    assert dashboard["uid"] == DASHBOARD_UID
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"]
    json.dumps(dashboard)


def test_a_row_shows_where_ttft_goes_stacked_by_stage() -> None:
    panels = build_dashboard()["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row")
    assert panels[row]["title"] == "Where TTFT goes"
    below = panels[row + 1 :]
    assert [p["title"] for p in below] == [
        "TTFT stages p50 by pool (stacked)",
        "TTFT stages p99 by pool (stacked)",
    ]
    for panel in below:
        assert panel["gridPos"]["y"] > panels[row]["gridPos"]["y"]
        assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
        assert "by (le, pool, stage)" in panel["targets"][0]["expr"]
