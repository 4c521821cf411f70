"""What the report's soak plot draws, panel by panel: each windowed figure against hours into the soak, and the
trend line the judgment drew through it (analysis/pillars/headroom/soak_trend.py).

Why apart from the drawing (analysis/outputs/plots.py): the panels are plain numbers a test can hold to the
judgment's own trends (the line ends at the trend's `fitted_at_end`, its slope is the trend's); the drawing only
renders them. A soak with no windows has no panels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Series:
    """One figure's points: x in hours since the soak began (each window's midpoint), None where not known."""

    key: str
    label: str
    x: list[float]
    y: list[float | None]
    band: tuple[list[float | None], list[float | None]] | None = None  # the figure's interval per window


@dataclass(frozen=True)
class TrendLine:
    """The judgment's least-squares line for one figure, from the first window's midpoint to the soak's end."""

    key: str
    x: tuple[float, float]
    y: tuple[float, float]
    slope_per_h: float
    limit: float | None
    rising_to_limit: bool  # the judgment named it: it reaches its limit within the horizon


@dataclass(frozen=True)
class Panel:
    ylabel: str
    series: list[Series]
    trends: list[TrendLine] = field(default_factory=list)
    limits: list[tuple[str, float]] = field(default_factory=list)  # (what, value): a horizontal line each


# (ylabel, (window key, label, interval key or None) ...) per panel, in the order drawn
PANELS = (
    ("ms (p95)", (("ttft_p95_ms", "TTFT p95", None), ("ttfa_p95_ms", "TTFA p95", None))),
    ("error rate", (("error_rate", "load errors", "error_rate_ci95"),)),
    ("KV cache usage", (("kv_usage_max", "KV usage max", None), ("kv_usage_mean", "KV usage mean", None))),
    ("share / %", (("prefix_cache_hit_share", "prefix-cache hit share", None),
                   ("gpu_growth_pct", "GPU memory growth (%)", None))),
)


def soak_panels(soak: dict[str, Any]) -> list[Panel]:
    """The panels of one soak entry (`pillars.resources.numbers.soak_windows[i]`)."""
    windows = soak.get("windows") or []
    if not windows:
        return []
    window_s = float(soak["window_s"])
    x = [(float(w["offset_s"]) + window_s / 2) / 3600 for w in windows]
    end_h = len(windows) * window_s / 3600
    trends = soak.get("trends") or {}
    panels = []
    for ylabel, figures in PANELS:
        series, lines, limits = [], [], []
        for key, label, interval in figures:
            values = [w.get(key) for w in windows]
            if all(v is None for v in values):
                continue
            band = None
            if interval:
                spans = [w.get(interval) or [None, None] for w in windows]
                band = ([s[0] for s in spans], [s[1] for s in spans])
            series.append(Series(key, label, x, values, band))
            found = trends.get(key)
            if found:
                lines.append(_line(key, found, x[0], end_h))
                if found.get("limit") is not None:
                    limits.append((f"{label} limit", float(found["limit"])))
        if series:
            panels.append(Panel(ylabel, series, lines, limits))
    return panels


def _line(key: str, found: dict[str, Any], start_h: float, end_h: float) -> TrendLine:
    """The trend's line from the first midpoint to the soak's end: through `fitted_at_end` at the end, its slope."""
    slope, at_end = float(found["slope_per_h"]), float(found["fitted_at_end"])
    return TrendLine(key, (start_h, end_h), (at_end - slope * (end_h - start_h), at_end), slope, found.get("limit"),
                     found.get("crosses_in_h") is not None)
