"""The report's "Soak by window" section: a long soak window by window, and each figure's trend through it.

Why its own section: the stage table gives a soak one row, its p95 over all of it; a reader of a day's soak
needs to see the drift (analysis/pillars/headroom/soak_trend.py), and a shorter soak has no section at all.
"""

from __future__ import annotations

from typing import Any

from k3load.analysis.outputs.markdown import fmt, table

WINDOW_COLUMNS = ("offset_s", "attempts", "error_rate", "ttft_p95_ms", "ttfa_p95_ms", "kv_usage_max",
                  "gpu_growth_pct", "prefix_cache_hit_share")
TREND_COLUMNS = ("figure", "windows", "slope_per_h", "slope_ci99", "r2", "fitted_at_end", "limit", "crosses_in_h")


def markdown(numbers: dict[str, Any]) -> str:
    soaks = numbers.get("soak_windows") or []
    if not soaks:
        return ""
    out = ["## Soak by window\n\nEach figure per window of the soak's load; its trend is a least-squares line "
           "through the windows, the slope per hour with a 99% interval, `crosses_in_h` the hours after the soak's "
           "end until its limit at the interval's cautious end (0: over it already; empty: not within the "
           "horizon, or no limit).\n\n"]
    for soak in soaks:
        out.append(f"### {fmt(soak['stage'])}: {len(soak['windows'])} windows of {soak['window_s'] / 60:g} min, "
                   f"horizon {soak['horizon_h']:g} h\n\n")
        out.append(table(soak["windows"], WINDOW_COLUMNS) + "\n")
        out.append(table(list(soak["trends"].values()), TREND_COLUMNS) + "\n")
    return "".join(out)
