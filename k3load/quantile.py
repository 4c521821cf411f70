"""The one percentile k3load reports: nearest rank, an element of the data, never an interpolation.

Why one definition: an attempt's inter-token p99 (written into its record) and a stage's TTFT p95 (in
the verdict) must mean the same thing, and a value that was really observed can be found in the
records; an interpolated p99 of 50 values is a number no request had.
"""

from __future__ import annotations


def nearest_rank_index(count: int, q: float) -> int:
    """The position, in ascending order, of the q-quantile of `count` values (count > 0)."""
    return min(round(q * (count - 1)), count - 1)


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The q-quantile of values already sorted ascending (at least one)."""
    return sorted_values[nearest_rank_index(len(sorted_values), q)]
