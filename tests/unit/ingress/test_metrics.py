"""Metric labels stay bounded whatever clients send."""

from serve_app.ingress.metrics import OTHER_CLASS, IngressMetrics


def test_unknown_classes_share_one_label_and_no_class_is_the_default() -> None:
    metrics = IngressMetrics(frozenset({"interactive", "batch"}), "interactive")
    assert metrics.label("batch") == "batch"
    assert metrics.label("") == "interactive"
    assert {metrics.label(f"bogus-{i}") for i in range(50)} == {OTHER_CLASS}
