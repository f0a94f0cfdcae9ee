"""Order statistics the benchmark reports."""

from __future__ import annotations


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 by nearest rank; None each when there are no values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}
