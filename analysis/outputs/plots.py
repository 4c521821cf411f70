"""PNG plots for the report: latency and throughput against concurrency, and the server's timelines
(KV usage, waiting requests, GPU memory) with stage bands and crash markers.

Why PNG bytes and not files: the HTML report is self-contained (one file a reviewer can archive and
sign), so plots are embedded as data URIs.
"""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from k3load.analysis.decision.ramp import Ramp, RampMarks
from k3load.analysis.outputs.plot_inputs import PlotInputs
from k3load.analysis.outputs.soak_panels import soak_panels

UNMARKED = RampMarks(slo={}, min_goodput=0.99, gpus=None, on_rate=False, capacity_load=None)  # marks not known
_META = {"Software": None}  # no version stamp: same data, same bytes


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight", metadata=_META)
    plt.close(fig)
    return buffer.getvalue()


def draw(inputs: PlotInputs) -> dict[str, bytes]:
    """The report's PNGs by name: latency and throughput against concurrency, and the timeline."""
    return ramp_plots(inputs.ramp) | timeline_plot(inputs) | soak_plots(inputs.soaks)


def ramp_plots(ramp: Ramp) -> dict[str, bytes]:
    steps = [s for s in ramp.steps if s.get("users")]
    if not steps:
        return {}
    marks = ramp.marks or UNMARKED
    on_rate = marks.on_rate  # a rate search's steps: the load is their arrival rate
    users = [s["sessions_per_s"] if on_rate else s["users"] for s in steps]
    load = "sessions arriving per second" if on_rate else "concurrent users"
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    slo = marks.slo
    for key, label, color in (("ttft_p95_ms", "TTFT p95", "tab:blue"),
                              ("ttfa_p95_ms", "first answer p95", "tab:purple"), ("e2e_p95_ms", "e2e p95", "tab:red")):
        values = [s.get(key) for s in steps]
        if any(v is not None for v in values):
            ax.plot(users, [float("nan") if v is None else v for v in values], marker="o", color=color, label=label)
            if slo.get(key):
                ax.axhline(slo[key], color=color, linestyle=":", linewidth=1, label=f"{label} SLO")
    _capacity_line(ax, marks)
    ax.set(xlabel=load, ylabel="ms", title="Latency and goodput vs load")
    ax.set_yscale("log")
    goodput = [s.get("goodput") for s in steps]
    if any(g is not None for g in goodput):
        ax2 = ax.twinx()
        ax2.plot(users, [float("nan") if g is None else g for g in goodput], marker="s", color="tab:green",
                 label="goodput")
        ax2.axhline(marks.min_goodput, color="tab:green", linestyle="--", linewidth=1,
                    label="goodput bound")
        ax2.set(ylabel="goodput (share of requests)", ylim=(0, 1.05))
        ax2.legend(loc="lower right", fontsize=7)
    if ax.get_legend_handles_labels()[0]:  # nothing to name where no latency was known
        ax.legend(loc="upper left", fontsize=7)
    latency = _png(fig)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(users, [s["output_tokens_per_s"] for s in steps], marker="o", label="output tok/s")
    ax2 = ax.twinx()
    ax2.plot(users, [s["requests_per_s"] for s in steps], marker="s", color="tab:orange", label="req/s")
    _capacity_line(ax, marks)
    ax.set(xlabel=load, ylabel="output tokens/s", title="Throughput vs load")
    ax2.set_ylabel("requests/s")
    return {"latency_vs_concurrency": latency, "throughput_vs_concurrency": _png(fig), "pareto": _pareto(steps, marks)}


def _capacity_line(ax: Any, marks: RampMarks) -> None:
    if marks.capacity_load:
        unit = "sessions/s" if marks.on_rate else "users"
        ax.axvline(marks.capacity_load, color="green", linestyle="--",
                   label=f"capacity {marks.capacity_load:g} {unit}")


def _pareto(steps: list[dict[str, Any]], marks: RampMarks) -> bytes:
    """Each step's decode speed per request (what one agent sees) against output tokens/s per GPU (what the fleet
    pays): the trade a planner picks a point on (vllm bench sweep's plot_pareto)."""
    gpus = marks.gpus or 1
    fig, ax = plt.subplots(figsize=(6, 3.4))
    on_rate = marks.on_rate
    # what one agent sees: its answer's decode speed, 1 / the median inter-token latency (vLLM's plot_pareto
    # reads 1 / TPOT); steps without a streamed answer are left out
    shown = [s for s in steps if s.get("itl_p50_ms")]
    x = [1000.0 / s["itl_p50_ms"] for s in shown]
    y = [s["output_tokens_per_s"] / gpus for s in shown]
    ax.plot(x, y, marker="o", color="tab:blue")
    for xi, yi, s in zip(x, y, shown, strict=True):
        load = s["sessions_per_s"] if on_rate else s["users"]
        held = load == marks.capacity_load
        ax.annotate(f"{load:g}" + ("/s" if on_rate else "") + (" (capacity)" if held else ""), (xi, yi), fontsize=7,
                    color="green" if held else "black", textcoords="offset points", xytext=(4, 4))
    per = "GPU" if marks.gpus else "replica (GPUs unknown)"
    ax.set(xlabel="output tokens/s per request (1 / ITL p50)", ylabel=f"output tokens/s per {per}",
           title="Per-user speed vs per-GPU throughput")
    return _png(fig)


def timeline_plot(inputs: PlotInputs) -> dict[str, bytes]:
    if not inputs.stages:
        return {}
    fig, axes = plt.subplots(3, 1, figsize=(7, 6), sharex=True)
    for ax, (label, x, y) in zip(axes[:2], inputs.series, strict=True):
        ax.plot(x, y)
        ax.set_ylabel(label)
    axes[2].plot(*inputs.memory)
    axes[2].set(ylabel="GPU MiB (all)", xlabel="seconds since the first stage")
    for i, (name, start, end) in enumerate(inputs.stages):
        for ax in axes:
            ax.axvspan(start, end, alpha=0.08 if i % 2 else 0.0, color="grey")
        axes[0].text(start, 1.02, name, fontsize=6, transform=axes[0].get_xaxis_transform())
    for crash in inputs.crashes:
        for ax in axes:
            ax.axvline(crash, color="red", linestyle=":")
    return {"timeline": _png(fig)}


def soak_plots(soaks: list[dict[str, Any]]) -> dict[str, bytes]:
    """A long soak by window (analysis/outputs/soak_panels.py): each figure per window against hours into the soak,
    the judgment's trend line through it (red where it reaches its limit within the horizon) and the limit."""
    out = {}
    for soak in soaks:
        panels = soak_panels(soak)
        if not panels:
            continue
        fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1.9 * len(panels)), sharex=True, squeeze=False)
        for ax, panel in zip(axes[:, 0], panels, strict=True):
            for series in panel.series:
                y = [float("nan") if v is None else v for v in series.y]
                ax.plot(series.x, y, marker=".", linewidth=1, label=series.label)
                if series.band is not None:
                    low, high = ([float("nan") if v is None else v for v in side] for side in series.band)
                    ax.fill_between(series.x, low, high, alpha=0.2)
            for line in panel.trends:
                color = "tab:red" if line.rising_to_limit else "grey"
                ax.plot(line.x, line.y, linestyle="--", linewidth=1, color=color)
            for what, value in panel.limits:
                ax.axhline(value, color="tab:red", linestyle=":", linewidth=1, label=what)
            ax.set_ylabel(panel.ylabel, fontsize=8)
            ax.legend(fontsize=6, loc="upper left")
        axes[0, 0].set_title(f"Soak {soak['stage']} by window of {float(soak['window_s']) / 60:g} min "
                             "(dashed: the judged trend)", fontsize=9)
        axes[-1, 0].set_xlabel("hours since the soak began")
        out[f"soak_{soak['stage']}"] = _png(fig)
    return out
