"""The shape every pillar judgment returns, and the thresholds they judge against.

Why thresholds live in the plan: what counts as "within SLO" belongs to the deployment being
accepted, not to the harness; the defaults below are a starting point a plan overrides key by key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3load.quantile import nearest_rank_index

# resources.recovery_hold_s has no fixed default: unset, the hold after a crash is the crash stage's duration, at
# most RECOVERY_HOLD_CAP_S (k3load/loadgen/recovery.py); a plan's value is held as given.
RECOVERY_HOLD_CAP_S = 120.0
DEFAULT_THRESHOLDS: dict[str, dict[str, float]] = {
    "agent_api": {"min_attempts": 20, "min_valid_rate": 0.95, "max_tool_call_gap_ms": 30000.0,
                  "min_stream_pairs": 10, "min_reference_attempts": 20, "min_reference_trigger_f1": 0.9,
                  "max_reference_schema_accuracy_drop": 0.05, "min_reproducible_share": 0.99},
    # ttfa: the first answer token after the model's reasoning (a thinking model's wait: generous by default)
    "slo": {"ttft_p95_ms": 3000.0, "ttfa_p95_ms": 30000.0, "itl_p95_ms": 250.0, "e2e_p95_ms": 60000.0,
            "max_error_rate": 0.02},
    "resources": {"max_waiting_sustained_s": 10.0, "max_preemptions_per_min": 5.0, "max_kv_usage": 0.98,
                  "min_gpu_headroom_pct": 5.0, "max_gpu_growth_pct": 50.0, "min_gpu_runway_h": 24.0,
                  "max_drain_s": 10.0, "max_restart_s": 600.0},
    "prefix_cache": {"min_warm_hit_ratio": 0.3, "min_latency_gain": 0.1, "min_reuse_of_design": 0.5},
    # `k3load diff A B`: how much worse B may be than A before the command exits non-zero (analysis/diff.py)
    "diff": {"min_comparable_attempts": 20, "min_trigger_f1": 0.9, "min_tool_name_agreement": 0.9,
             "max_schema_accuracy_drop": 0.05, "max_structured_output_drop": 0.05,
             "max_latency_p95_increase": 0.5, "max_throughput_drop": 0.3, "min_relative_change": 0.25,
             "min_latency_change_ms": 5.0},
}


# `thresholds.agent` is the agent pillar's section by the name issue 33 gave it (`thresholds.agent.
# min_reproducible_share`): one section, two spellings in a plan, merged into `agent_api` before any rule reads it.
SECTION_ALIASES = {"agent": "agent_api"}


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
