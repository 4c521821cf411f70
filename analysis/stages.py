"""Per-stage figures: the client's latencies and errors joined with the server's and the GPUs' view.

Why per stage: OOM and queueing have causes by phase (load, long input, concurrency, soak), and a
capacity planner reads each concurrency step on its own. A stage is judged against the plan's SLOs
and resource limits; the checks that failed are named.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from k3load.analysis.pillar import percentile
from k3load.analysis.rundata import RunData, StageWindow
from k3load.analysis.timeline import MetricIndex


def _latency(frame: pd.DataFrame) -> dict[str, float | None]:
    ok = frame[frame["status"] == "ok"]
    out: dict[str, float | None] = {}
    for column, label in (("ttft_ms", "ttft"), ("itl_mean_ms", "itl"), ("e2e_ms", "e2e")):
        values = [float(v) for v in ok[column].dropna()]
        for q in (50, 95, 99):
            out[f"{label}_p{q}_ms"] = percentile(values, q / 100)
    return out


def _gpu(data: RunData, t0: float, t1: float) -> dict[str, Any]:
    gpu = data.gpu
    if gpu.empty or "ts" not in gpu:
        return {"gpu_memory_peak_mib": None, "gpu_headroom_min_pct": None, "gpu_simulated": None}
    rows = gpu[(gpu["ts"] >= t0) & (gpu["ts"] <= t1) & gpu["memory_used_mib"].notna()]
    if rows.empty:
        return {"gpu_memory_peak_mib": None, "gpu_headroom_min_pct": None, "gpu_simulated": None}
    headroom = (1 - rows["memory_used_mib"] / rows["memory_total_mib"]) * 100
    return {"gpu_memory_peak_mib": float(rows["memory_used_mib"].max()),
            "gpu_headroom_min_pct": float(headroom.min()),
            "gpu_simulated": bool(rows.get("simulated", pd.Series([False])).fillna(False).any())}


def _load_errors(frame: pd.DataFrame) -> pd.Series:
    """Failures load can cause: 5xx, 408, 429, timeouts, cut streams, transport errors. A 4xx refusal
    (e.g. vLLM's 400 '"auto" tool choice requires --enable-auto-tool-choice') is the request's or the
    configuration's fault, not a shortage: it stays a gateway failure of the agent pillar."""
    status = frame["http_status"]
    refused = (frame["status"] == "http_error") & status.between(400, 499) & ~status.isin([408, 429])
    return (frame["status"] != "ok") & ~refused


def stage_stats(data: RunData, index: MetricIndex, stage: StageWindow) -> dict[str, Any]:
    t0, t1 = stage.start_ts, stage.end_ts
    frame = data.records[(data.records["stage"] == stage.name) & ~data.records["drill"].astype(bool)]
    duration = max(t1 - t0, 1e-9)
    ok = frame[frame["status"] == "ok"]
    kv = index.gauge("vllm:kv_cache_usage_perc", t0, t1)
    waiting = index.gauge("vllm:num_requests_waiting", t0, t1)
    running = index.gauge("vllm:num_requests_running", t0, t1)
    preemptions = index.delta("vllm:num_preemptions_total", t0, t1)
    downs = [e for e in data.events_named("server_down") if t0 <= e["ts"] <= t1]
    cpu = [m["load_generator_cpu_pct"] for m in data.metrics
           if t0 <= m.get("ts", 0) <= t1 and m.get("load_generator_cpu_pct") is not None]
    return {
        "stage": stage.name, "kind": stage.kind, "users": stage.users, "start_ts": t0, "duration_s": t1 - t0,
        "attempts": len(frame), "errors": int(_load_errors(frame).sum()),
        "error_rate": float(_load_errors(frame).mean()) if len(frame) else None,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": float(ok["completion_tokens"].fillna(0).sum()) / duration,
        "max_prompt_tokens_ok": int(ok["prompt_tokens"].max()) if ok["prompt_tokens"].notna().any() else None,
        **_latency(frame),
        "kv_usage_mean": kv["mean"] if kv else None, "kv_usage_max": kv["max"] if kv else None,
        "waiting_max": waiting["max"] if waiting else None,
        "waiting_sustained_s": index.sustained_positive_s("vllm:num_requests_waiting", t0, t1),
        "running_max": running["max"] if running else None,
        "load_generator_cpu_max_pct": max(cpu) if cpu else None,
        "preemptions": preemptions, "preemptions_per_min": preemptions / duration * 60 if preemptions is not None
        else None, "server_down_events": len(downs),
        # The engine's own gauges, not any vllm:* series: with --disable-log-stats vLLM 0.32 still
        # serves vllm:tool_call_parser_invocations_total, and KV, queue and preemptions are unknown.
        "metrics_present": kv is not None or waiting is not None or running is not None,
        **_gpu(data, t0, t1),
    }


def _over(value: float | None, limit: float) -> bool:
    return value is not None and value > limit


def stage_problems(stats: dict[str, Any], limits: dict[str, dict[str, float]]) -> list[str]:
    """What made a stage exceed the plan's limits (empty: within limits)."""
    slo, res = limits["slo"], limits["resources"]
    problems = []
    checks = [
        ("error_rate", slo["max_error_rate"], "error rate {v:.1%} > {lim:.1%}"),
        ("ttft_p95_ms", slo["ttft_p95_ms"], "TTFT p95 {v:.0f} ms > {lim:.0f} ms"),
        ("itl_p95_ms", slo["itl_p95_ms"], "ITL p95 {v:.0f} ms > {lim:.0f} ms"),
        ("e2e_p95_ms", slo["e2e_p95_ms"], "e2e p95 {v:.0f} ms > {lim:.0f} ms"),
        ("waiting_sustained_s", res["max_waiting_sustained_s"], "requests waited for {v:.0f} s on end > {lim:.0f} s"),
        ("preemptions_per_min", res["max_preemptions_per_min"], "{v:.1f} preemptions/min > {lim:.1f}"),
        ("kv_usage_max", res["max_kv_usage"], "KV cache usage reached {v:.0%} > {lim:.0%}"),
    ]
    for key, limit, text in checks:
        if _over(stats.get(key), limit):
            problems.append(text.format(v=stats[key], lim=limit))
    headroom = stats.get("gpu_headroom_min_pct")
    if headroom is not None and headroom < res["min_gpu_headroom_pct"]:
        problems.append(f"GPU memory headroom fell to {headroom:.1f}% < {res['min_gpu_headroom_pct']:.0f}%")
    if stats.get("server_down_events"):
        problems.append(f"server down {stats['server_down_events']} time(s)")
    return problems
