"""Small pure helpers the measurements and checks share."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation between closest ranks (as
    numpy's default); None for no values."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {
        "p50": r(percentile(values, 50)),
        "p95": r(percentile(values, 95)),
        "p99": r(percentile(values, 99)),
        "max": r(max(values)) if values else None,
        "mean": r(sum(values) / len(values)) if values else None,
        "count": len(values),
    }


def inversions(positions: Sequence[int]) -> int:
    """Messages handled after one that was sent later: `positions` are send positions in
    the order they were handled (each late message counted once)."""
    late, highest = 0, -1
    for s in positions:
        if s < highest:
            late += 1
        highest = max(highest, s)
    return late


def id_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])
