"""The shape every pillar judgment returns, and the thresholds they judge against.

Why thresholds live in the plan: what counts as "within SLO" belongs to the deployment being
accepted, not to the harness; the defaults (declared in thresholds_table.py) are a starting point a plan
overrides key by key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3load.analysis.pillars.thresholds_table import SECTION_ALIASES, defaults
from k3load.quantile import nearest_rank_index

# resources.recovery_hold_s has no fixed default: unset, the hold after a crash is the crash stage's duration, at
# most RECOVERY_HOLD_CAP_S (k3load/loadgen/recovery.py); a plan's value is held as given.
RECOVERY_HOLD_CAP_S = 120.0
# Declared in analysis/pillars/thresholds_table.py (with the plan schema's part and the limit rules' own).
DEFAULT_THRESHOLDS: dict[str, dict[str, float]] = defaults()


def thresholds(plan_thresholds: dict[str, dict[str, float]] | None) -> dict[str, dict[str, float]]:
    merged = {k: dict(v) for k, v in DEFAULT_THRESHOLDS.items()}
    for section, values in (plan_thresholds or {}).items():
        merged.setdefault(SECTION_ALIASES.get(section, section), {}).update(values)
    return merged


@dataclass
class PillarResult:
    status: str
    reasons: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    # keys of `numbers` an issue named at the pillar itself (`pillars.agent_api.reproducibility`, issue 33): written
    # there too, so the contract's path and the numbers every reader already walks hold the same figures
    surfaced: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        numbers = rounded(self.numbers)
        return {"status": self.status, "reasons": self.reasons, "numbers": numbers,
                **{key: numbers[key] for key in self.surfaced if key in numbers}}


def rounded(value: Any, digits: int = 4) -> Any:
    """Floats rounded so the verdict file is stable byte for byte across platforms."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


NUMPY_FROM = 4096  # above this many values a selection beats a sort


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank value at q (k3load.quantile), of the values that are known (None left out)."""
    return percentiles(values, (q,))[0]


def percentiles(values: list[float] | np.ndarray, qs: Sequence[float]) -> list[float | None]:
    """`percentile(values, q)` for each q, the values cleaned, checked and selected from once (a stage's
    p50, p95 and p99 of 360,000 latencies are one pass, not three). `values` may be a float64 array (a
    frame's column: no None in it, and no Python float made of each value to be checked again)."""
    if isinstance(values, np.ndarray) and values.dtype == np.float64 and values.ndim == 1:
        if len(values) < NUMPY_FROM:
            return percentiles(values.tolist(), qs)
        array: np.ndarray | None = values
    else:
        clean = [v for v in values if v is not None]
        if not clean:
            return [None] * len(qs)
        array = np.fromiter(clean, dtype=float, count=len(clean)) \
            if len(clean) >= NUMPY_FROM and all(type(v) is float for v in clean) else None
    if array is not None:
        indexes = [nearest_rank_index(len(array), q) for q in qs]
        # The index-th smallest by selection, O(n): the same value a sort gives, when no NaN (which
        # sorts nowhere) and no -0.0 (which equals 0.0 yet prints apart) can make the pick ambiguous.
        if not np.isnan(array).any() and not np.signbit(array[array == 0]).any():
            picked = np.partition(array, sorted(set(indexes)))
            return [float(picked[i]) for i in indexes]
        clean = array.tolist()
    indexes = [nearest_rank_index(len(clean), q) for q in qs]
    ordered = sorted(clean)
    return [ordered[i] for i in indexes]
