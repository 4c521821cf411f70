"""What the report's plots draw, read off a judgment as plain numbers, apart from the drawing.

Why apart from analysis/outputs/plots.py: drawing needs matplotlib (0.4 s to import) and at an hour's soak the
PNGs take another half second; `k3load analyze` draws them in a child process beside the judgment
(analysis/outputs/plots_beside.py) and sends it these inputs, so the judging process never imports matplotlib.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from k3load.analysis.decision.ramp import Ramp
from k3load.analysis.run.gpu_memory import memory_curve
from k3load.analysis.run.timeline import MetricIndex
from k3load.sampler.vllm_metrics import VllmMetric


@dataclass
class PlotInputs:
    """Everything the report's plots draw, as plain numbers (picklable: `plots_beside` draws them in a
    child process). `ramp`: the ramp and its marks; the timeline's x values are seconds since the first stage."""

    ramp: Ramp
    stages: list[tuple[str, float, float]] = field(default_factory=list)  # (name, start, end), since t0
    series: list[tuple[str, list[float], list[float]]] = field(default_factory=list)  # (label, x, y)
    memory: tuple[list[float], list[float]] = ([], [])
    crashes: list[float] = field(default_factory=list)
    # a long soak by window (pillars.resources.numbers.soak_windows, analysis/pillars/headroom/soak_trend.py)
    soaks: list[dict[str, Any]] = field(default_factory=list)


TIMELINE_SERIES = ((VllmMetric.KV_CACHE_USAGE, "KV usage"), (VllmMetric.NUM_REQUESTS_WAITING, "waiting requests"))


def plot_inputs(ramp: Ramp, data: Any, index: MetricIndex, crashes: list[dict[str, Any]],
                soaks: list[dict[str, Any]] | None = None) -> PlotInputs:
    """What `draw` needs, read off the judgment's tables (cheap: no matplotlib here); `soaks`: the resources
    pillar's soak windows."""
    if not data.stages:
        return PlotInputs(ramp)
    t0, t1 = data.stages[0].start_ts, data.stages[-1].end_ts
    series = []
    for name, label in TIMELINE_SERIES:
        points = index.points(name, t0, t1)
        series.append((label, [p[0] - t0 for p in points], [p[1] for p in points]))
    curve = memory_curve(data.gpu, t0, t1)  # each GPU once per sampling round, whichever sources read it
    return PlotInputs(ramp, [(s.name, s.start_ts - t0, s.end_ts - t0) for s in data.stages], series,
                      (list(curve["ts"] - t0), list(curve["memory_used_mib"])), [c["ts"] - t0 for c in crashes],
                      list(soaks or []))


def report_plot_inputs(judgment: Any) -> PlotInputs:
    """The inputs of a finished judgment's plots."""
    numbers = judgment.pillars["resources"].numbers
    return plot_inputs(judgment.ramp, judgment.data, MetricIndex(judgment.data.metrics), numbers.get("crashes", []),
                       numbers.get("soak_windows", []))


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
