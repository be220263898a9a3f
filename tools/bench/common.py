"""Small helpers every bench script shares: percentiles, summaries, the version measured."""

from __future__ import annotations

import math
import statistics


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (with fewer than 100 values, p99 is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def spread(values: list[float]) -> dict[str, float]:
    """Median, nearest-rank p99, min and max of one measurement."""
    return {
        "median": statistics.median(values),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


def version() -> str:
    """The vacancyd version the bench measured, as installed."""
    from importlib import metadata

    try:
        return metadata.version("vacancyd")
    except metadata.PackageNotFoundError:
        return "(not installed)"
