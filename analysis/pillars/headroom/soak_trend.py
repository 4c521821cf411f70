"""A long soak by window, and the trend of each figure through it: drift over a day, not one number for the day.

Why: a soak's stage row is one p95 over all of it, so a TTFT that creeps from 400 ms to 2.8 s over a day reads as
a p95 somewhere between, within the SLO, and the creep that will cross it tomorrow is not seen (the seed's
continuous operation: fragmentation, reuse falling off). A soak whose load lasted at least `MIN_WINDOWS` windows
(`resources.soak_window_s`, 5 minutes by default) is cut into windows, each with its own TTFT and TTFA p95, error
rate (Wilson interval), KV usage, GPU memory growth and prefix-cache hit share; a shorter soak has none (its row
says it all, and verdict.json is as before).

The trend: a least-squares line through the windows' values against their midpoints, its slope per hour with a
99% interval (Student's t over the windows; 99% because several figures are tested at once). A figure with a
limit creeps when even the interval's cautious end rises (TTFT, TTFA, KV usage, error rate: up is bad) and the
line, drawn on from the soak's end at that cautious slope, crosses the limit within `resources.soak_horizon_h`
(24 h by default): named as a failing reason with the rate and when it crosses. The prefix-cache hit share has
no limit of its own here; its fall is said when the interval's cautious end still falls. GPU memory's own creep
(a runway to out of memory) is judged from every reading in gpu_memory (pillar_resources.gpu_memory_judgment);
the windows show its growth beside the rest.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from k3load.analysis.pillars.headroom.gpu_growth import GpuGrowth, stage_figures
from k3load.analysis.pillars.headroom.stages import load_errors, sent_while_down
from k3load.analysis.pillars.pillar import percentiles
from k3load.analysis.run.down_spells import DownSpell
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.rundata import RunData
from k3load.analysis.run.stats import wilson
from k3load.analysis.run.timeline import MetricIndex
from k3load.sampler.vllm_metrics import VllmMetric

MIN_WINDOWS = 3  # fewer windows: no trend (a line through two points has no interval)
MAX_WINDOWS = 2000  # a plan's tiny soak_window_s (0.01 s over a day: 8.6 M windows) widens to the soak / this
# Student's t, two-sided 99%, by degrees of freedom (windows - 2); past the table, the normal's 2.576.
_T99 = {1: 63.657, 2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355, 9: 3.250, 10: 3.169,
        12: 3.055, 15: 2.947, 20: 2.845, 25: 2.787, 30: 2.750, 40: 2.704, 60: 2.660, 120: 2.617}


@dataclass(frozen=True)
class Figure:
    """One windowed figure: its key in a window's row, how a reader names it, its limit and which way is bad."""

    key: str
    said: str
    unit: str
    limit: tuple[str, str] | None  # (section, threshold) of the plan's limits; None: no limit (said, not judged)
    up_is_bad: bool = True


FIGURES = (
    Figure("ttft_p95_ms", "TTFT p95", "ms", ("slo", "ttft_p95_ms")),
    Figure("ttfa_p95_ms", "TTFA p95", "ms", ("slo", "ttfa_p95_ms")),
    Figure("error_rate", "the error rate", "", ("slo", "max_error_rate")),
    Figure("kv_usage_max", "KV cache usage", "", ("resources", "max_kv_usage")),
    Figure("gpu_growth_pct", "GPU memory growth", "%", None),
    Figure("prefix_cache_hit_share", "the prefix-cache hit share", "", None, up_is_bad=False),
)


@dataclass(frozen=True)
class Trend:
    """A line through one figure's windows: slope per hour, its 99% interval, and where it goes."""

    figure: str
    windows: int
    slope_per_h: float
    slope_ci99: tuple[float, float]
    r2: float
    fitted_at_end: float  # the line's value at the soak's end
    limit: float | None
    crosses_in_h: float | None  # rising clearly: hours after the soak's end until the limit at the cautious slope
    # (0: over it already); None: no clear rise, no limit, or not within the horizon

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"slope_ci99": list(self.slope_ci99)}


def _t99(dof: int) -> float:
    if dof <= 0:
        return math.inf
    known = [d for d in _T99 if d <= dof]
    return _T99[max(known)] if dof <= 120 else 2.576


def fit(hours: list[float], values: list[float]) -> tuple[float, tuple[float, float], float, float] | None:
    """(slope per hour, its 99% interval, R², intercept) of the least-squares line; None under MIN_WINDOWS points
    or without spread in time."""
    if len(hours) < MIN_WINDOWS:
        return None
    x, y = np.asarray(hours, dtype=float), np.asarray(values, dtype=float)
    spread = float(((x - x.mean()) ** 2).sum())
    if spread <= 0:
        return None
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / spread)
    intercept = float(y.mean() - slope * x.mean())
    residual = float(((y - (intercept + slope * x)) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    half = _t99(len(x) - 2) * math.sqrt(residual / (len(x) - 2) / spread) if len(x) > 2 else math.inf
    return slope, (slope - half, slope + half), (1.0 - residual / total) if total > 0 else 0.0, intercept


def trend(figure: Figure, hours: list[float], values: list[float], end_h: float, limit: float | None,
          horizon_h: float) -> Trend | None:
    """The figure's trend, with when it crosses its limit at the cautious slope (None: it does not, within the
    horizon, or it has no limit)."""
    fitted = fit(hours, values)
    if fitted is None:
        return None
    slope, (low, high), r2, intercept = fitted
    at_end = intercept + slope * end_h
    crosses = None
    if limit is not None and figure.up_is_bad and low > 0:  # a clear rise only: a flat figure is the stage row's
        if at_end > limit:
            crosses = 0.0
        elif (limit - at_end) / low <= horizon_h:
            crosses = (limit - at_end) / low
    return Trend(figure.key, len(values), slope, (low, high), r2, at_end, limit, crosses)


def windows_of(data: RunData, index: MetricIndex, soak: tuple[str, float, float], window_s: float,
               spells: list[DownSpell], growth: GpuGrowth) -> list[dict[str, Any]]:
    """The soak's load time cut into whole windows of `window_s` (the last, shorter, part left out: too few
    requests to compare), each window's figures."""
    name, t0, t1 = soak
    count = int((t1 - t0) // window_s)
    mine = data.columns.rows(name)
    mine = mine[~mine.flag("drill")]
    # each record's window: the last edge at or before its send (the same edges as floats: a record on an edge
    # is in the window that starts there); before the first or at the last edge and after, none
    window = np.searchsorted(np.array([t0 + i * window_s for i in range(count + 1)]), mine.number("send_ts"),
                             side="right") - 1
    placed = np.flatnonzero((window >= 0) & (window < count))
    placed = placed[np.argsort(window[placed], kind="stable")]
    bounds = np.searchsorted(window[placed], np.arange(count + 1))
    rows = []
    for i in range(count):  # a day's soak is 288 windows: each a slice of the records put in order once
        w0, w1 = t0 + i * window_s, t0 + (i + 1) * window_s
        rows.append(_window(mine.take(placed[bounds[i]:bounds[i + 1]]), index, w0, w1, t0, spells, growth))
    return rows


def _window(frame: Rows, index: MetricIndex, w0: float, w1: float, t0: float, spells: list[DownSpell],
            growth: GpuGrowth) -> dict[str, Any]:
    down = sent_while_down(frame, spells)
    errors = load_errors(frame) & ~down
    rate = wilson(int(errors.sum()), int((~down).sum()))
    ok = frame[frame.code_is("status", "ok")]
    p95 = {}
    for column in ("ttft_ms", "ttfa_ms"):
        values = ok.number(column)
        values = values[~np.isnan(values)].tolist()
        p95[column.replace("_ms", "_p95_ms")] = percentiles(values, (0.95,))[0] if values else None
    kv = index.gauge(VllmMetric.KV_CACHE_USAGE, w0, w1)
    hits = index.delta(VllmMetric.PREFIX_CACHE_HITS_TOTAL, w0, w1)
    queries = index.delta(VllmMetric.PREFIX_CACHE_QUERIES_TOTAL, w0, w1)
    gpu = stage_figures(growth, w0, w1)
    return {"offset_s": w0 - t0, "start_ts": w0, "end_ts": w1, "attempts": len(frame),
            "errors": int(errors.sum()), "error_rate": rate.value if len(frame) else None,
            "error_rate_ci95": [rate.low, rate.high] if len(frame) else None, **p95,
            "kv_usage_max": kv["max"] if kv else None, "kv_usage_mean": kv["mean"] if kv else None,
            "gpu_growth_pct": gpu["gpu_growth_max_pct"],
            "prefix_cache_hit_share": hits / queries if hits is not None and queries else None}


def soak_trends(data: RunData, index: MetricIndex, soaks: list[tuple[str, float, float]],
                limits: dict[str, dict[str, float]], spells: list[DownSpell], growth: GpuGrowth
                ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(one entry per long soak: its windows and trends; failing reasons; notes). Empty where no soak lasted
    MIN_WINDOWS windows."""
    resources = limits.get("resources") or {}
    window_s = float(resources.get("soak_window_s") or 300.0)
    horizon_h = float(resources.get("soak_horizon_h", 24.0))
    out: list[dict[str, Any]] = []
    reasons: list[str] = []
    notes: list[str] = []
    for soak in soaks:
        name, t0, t1 = soak
        if t1 - t0 < MIN_WINDOWS * window_s:
            continue
        window_s = max(window_s, (t1 - t0) / MAX_WINDOWS)  # said in the entry's window_s
        rows = windows_of(data, index, soak, window_s, spells, growth)
        end_h = len(rows) * window_s / 3600
        trends: dict[str, Any] = {}
        for figure in FIGURES:
            points = [((r["offset_s"] + window_s / 2) / 3600, float(r[figure.key])) for r in rows
                      if r.get(figure.key) is not None]
            limit = float((limits.get(figure.limit[0]) or {})[figure.limit[1]]) if figure.limit else None
            found = trend(figure, [p[0] for p in points], [p[1] for p in points], end_h, limit, horizon_h)
            if found is None:
                continue
            trends[figure.key] = found.to_dict()
            said = _said(figure, found, window_s)
            if found.crosses_in_h is not None and figure.limit is not None:
                named = f"{figure.limit[0]}.{figure.limit[1]} ({_value(figure, limit)})"
                when = f"it is over {named} at the soak's end already" if found.crosses_in_h == 0 else \
                    f"drawn on at the interval's cautious end it reaches {named} {_hours(found.crosses_in_h)} after " \
                    "the soak's end"
                reasons.append(f"soak {name}: {said}; {when}, within the {horizon_h:g} h horizon "
                               "(resources.soak_horizon_h; records and metrics.jsonl by window)")
            elif not figure.up_is_bad and found.slope_ci99[1] < 0:
                notes.append(f"soak {name}: {said}: reuse falls off as the soak goes on (not judged: no limit)")
        out.append({"stage": name, "window_s": window_s, "horizon_h": horizon_h, "windows": rows, "trends": trends})
    return out, reasons, notes


def _value(figure: Figure, value: float | None) -> str:
    if value is None:
        return "unknown"
    if figure.unit == "ms":
        return f"{value:,.0f} ms"
    if figure.unit == "%":
        return f"{value:.1f}%"
    return f"{value:.1%}"


def _rate(figure: Figure, value: float) -> str:
    """A change per hour: ms for latencies, points for a percentage or a share."""
    if figure.unit == "ms":
        return f"{value:+,.0f} ms"
    return f"{value:+.1f} points" if figure.unit == "%" else f"{value * 100:+.2f} points"


def _said(figure: Figure, found: Trend, window_s: float) -> str:
    def per(value: float) -> str:
        return _rate(figure, value)

    low, high = found.slope_ci99
    return (f"{figure.said} moves {per(found.slope_per_h)} per hour (99% CI {per(low)} to {per(high)}) over "
            f"{found.windows} windows of {window_s / 60:g} min, {_value(figure, found.fitted_at_end)} at the end")


def _hours(hours: float) -> str:
    return f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.0f} min"
