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

from k3load.analysis.plot_inputs import PlotInputs

_META = {"Software": None}  # no version stamp: same data, same bytes


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight", metadata=_META)
    plt.close(fig)
    return buffer.getvalue()


def draw(inputs: PlotInputs) -> dict[str, bytes]:
    """The report's PNGs by name: latency and throughput against concurrency, and the timeline."""
    return ramp_plots(inputs.ramp) | timeline_plot(inputs)


def ramp_plots(ramp: dict[str, Any]) -> dict[str, bytes]:
    steps = ramp["steps"]
    if not steps:
        return {}
    users = [s["users"] for s in steps]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for key, label in (("ttft_p95_ms", "TTFT p95"), ("e2e_p95_ms", "e2e p95"), ("itl_p95_ms", "ITL p95")):
        ax.plot(users, [s[key] for s in steps], marker="o", label=label)
    if ramp.get("knee_users"):
        ax.axvline(ramp["knee_users"], color="green", linestyle="--", label="knee")
    ax.set(xlabel="concurrent users", ylabel="ms", title="Latency vs concurrency")
    ax.legend()
    latency = _png(fig)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(users, [s["output_tokens_per_s"] for s in steps], marker="o", label="output tok/s")
    ax2 = ax.twinx()
    ax2.plot(users, [s["requests_per_s"] for s in steps], marker="s", color="tab:orange", label="req/s")
    ax.set(xlabel="concurrent users", ylabel="output tokens/s", title="Throughput vs concurrency")
    ax2.set_ylabel("requests/s")
    return {"latency_vs_concurrency": latency, "throughput_vs_concurrency": _png(fig)}


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
