"""`dashboard.json`: a Grafana dashboard for after go-live, with this run's accepted limits drawn on it.

Why beside `alerts.yaml`: the spec's go-live step is "watch GPU memory, kv_cache_usage_perc, waiting
requests, preemptions, prefix-cache hits, time to first token and tool-call schema failures"; an
operator watching those wants to see where the acceptance stopped proving things, so every limit the
alerts page on (`alerts.accepted()`, the same figures) is a threshold line on its panel, and a limit
the run did not establish is said in the panel's description instead of drawn.

Grafana's dashboard model (schemaVersion 39, timeseries panels), a `${datasource}` Prometheus
variable and `model_name` / `instance` variables from vLLM's labels (`gpu_host` from dcgm-exporter's
`Hostname`: the exporter is a different scrape target). Import it with Dashboards > New > Import.
Same run directory, same bytes: no clock, ids from the run id.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from k3load.analysis.outputs.alerts import HIT_RATIO_FLOOR, PARSER_NO_CALL_CEILING, PROMPT_BUCKET, Accepted, accepted
from k3load.sampler.vllm_metrics import VllmMetric

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
VLLM = 'model_name=~"$model_name", instance=~"$instance"'
GPU = 'Hostname=~"$gpu_host"'
RATE = "$__rate_interval"
SCHEMA_VERSION = 39


def _steps(limits: list[tuple[float, str]], below_is_bad: bool = False) -> dict[str, Any]:
    """Grafana thresholds: a base colour, then each limit upwards (red under a floor with below_is_bad)."""
    base = "red" if below_is_bad else "green"
    by_value = dict(sorted(set(limits)))  # one step per value: of two at the same value, red ("r" > "o") wins
    steps = [{"color": base, "value": None}] + [{"color": c, "value": v} for v, c in by_value.items()]
    return {"mode": "absolute", "steps": steps}


def _panel(title: str, description: str, unit: str, targets: list[tuple[str, str]],
           limits: list[tuple[float, str]], below_is_bad: bool = False) -> dict[str, Any]:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never", "spanNulls": False,
              "thresholdsStyle": {"mode": "dashed" if limits else "off"}}
    if limits and not below_is_bad:
        custom["axisSoftMax"] = max(v for v, _ in limits)  # the axis reaches the limit even when traffic is low
    return {"type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
            "fieldConfig": {"defaults": {"unit": unit, "min": 0, "color": {"mode": "palette-classic"}, "custom": custom,
                                         "thresholds": _steps(limits, below_is_bad)}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"datasource": DATASOURCE, "editorMode": "code", "expr": expr, "legendFormat": legend,
                         "range": True, "refId": chr(ord("A") + i)} for i, (expr, legend) in enumerate(targets)]}


def _quantile(q: float, bucket: str) -> str:
    return f"histogram_quantile({q}, sum by (le, model_name) (rate({bucket}{{{VLLM}}}[{RATE}])))"


def _memory_panels(acc: Accepted) -> list[dict[str, Any]]:
    """Used and free per GPU. vLLM reserves its KV pool at start (--gpu-memory-utilization), so "used" sits near
    that share from the first scrape, flat: the line to watch is free memory against the run's floor (what was
    free after start-up less the accepted growth), and its trend, not the card's share."""
    source = ("dcgm-exporter's series, as k3load's sampler reads them from a dcgm-exporter URL (it reads NVML "
              "directly on a local host; production Prometheus sees the exporter)")
    floor = acc.gpu_free_floor_mib
    said = (f"Red: {acc.gpu_note} (alert K3GPUMemoryGrowth)." if floor is not None else
            f"No floor drawn: {acc.gpu_note}.")
    return [
        _panel("GPU memory used", f"DCGM_FI_DEV_FB_USED per GPU (MiB): flat at vLLM's start-up reservation on a "
               f"healthy node; the KV cache's fill shows in KV cache usage, not here. {source}.", "mbytes",
               [(f"DCGM_FI_DEV_FB_USED{{{GPU}}}", "{{Hostname}} GPU {{gpu}}")], []),
        _panel("GPU memory free", f"DCGM_FI_DEV_FB_FREE per GPU (MiB). {said} A steady fall is a creep (alert "
               f"K3GPUMemoryCreep). {source}.", "mbytes",
               [(f"DCGM_FI_DEV_FB_FREE{{{GPU}}}", "{{Hostname}} GPU {{gpu}}")],
               [(floor, "red")] if floor is not None else [], below_is_bad=True),
    ]


def _engine_panels(acc: Accepted) -> list[dict[str, Any]]:
    res = acc.limits["resources"]
    kv_lines = [(acc.kv_ceiling, "orange" if acc.kv_measured else "red"), (res["max_kv_usage"], "red")]
    users = acc.max_concurrency
    return [
        _panel("KV cache usage", f"vllm:kv_cache_usage_perc per engine. Orange: {acc.kv_note} (alert "
               f"K3KVCachePressure); red: the plan's max_kv_usage ({res['max_kv_usage']:.0%}).", "percentunit",
               [(f"vllm:kv_cache_usage_perc{{{VLLM}}}", "{{instance}} engine {{engine}}")], kv_lines),
        _panel("Requests running and waiting",
               (f"Red: the accepted concurrency, {users}: {acc.concurrency_note} (alert K3ConcurrencyAboveAccepted "
                "on running + waiting)." if users is not None else
                f"No accepted concurrency drawn: {acc.concurrency_note}.")
               + f" Waiting behind running requests for {res['max_waiting_sustained_s']:g} s pages "
               "(K3RequestsWaiting).", "short",
               [(f"sum by (model_name) (vllm:num_requests_running{{{VLLM}}})", "running {{model_name}}"),
                (f"sum by (model_name) (vllm:num_requests_waiting{{{VLLM}}})", "waiting {{model_name}}"),
                (f"sum by (model_name) (vllm:num_requests_running{{{VLLM}}}) + "
                 f"sum by (model_name) (vllm:num_requests_waiting{{{VLLM}}})", "running + waiting {{model_name}}")],
               [(float(users), "red")] if users is not None else []),
        _panel("Preemptions per minute", f"rate(vllm:num_preemptions_total) x 60; red: the plan's "
               f"max_preemptions_per_min ({res['max_preemptions_per_min']:g}), as alert K3Preemptions.", "short",
               [(f"sum by (model_name) (rate(vllm:num_preemptions_total{{{VLLM}}}[{RATE}])) * 60",
                 "{{model_name}}")], [(res["max_preemptions_per_min"], "red")]),
        _panel("Prefix-cache hit ratio", "rate(vllm:prefix_cache_hits_total) / rate(vllm:prefix_cache_queries_total) "
               f"(tokens). Red under {HIT_RATIO_FLOOR:.0%}: the cache has collapsed (alert K3PrefixCacheHitRatioLow). "
               f"The plan's min_warm_hit_ratio ({acc.limits['prefix_cache']['min_warm_hit_ratio']:.0%}) judged warm "
               "control requests, not production's mix, so it is not drawn.", "percentunit",
               [(f"sum by (model_name) (rate(vllm:prefix_cache_hits_total{{{VLLM}}}[{RATE}])) / "
                 f"sum by (model_name) (rate(vllm:prefix_cache_queries_total{{{VLLM}}}[{RATE}]))", "{{model_name}}")],
               [(HIT_RATIO_FLOOR, "green")], below_is_bad=True),
    ]


def _latency_panels(acc: Accepted) -> list[dict[str, Any]]:
    slo = acc.limits["slo"]
    rows = (("Time to first token", VllmMetric.TIME_TO_FIRST_TOKEN_BUCKET, "ttft_p95_ms",
             f" (alert K3TTFTAboveSLO). Its first token may be reasoning: {acc.ttfa_note}"),
            ("Inter-token latency", VllmMetric.INTER_TOKEN_LATENCY_BUCKET, "itl_p95_ms", ""),
            ("End-to-end latency", VllmMetric.E2E_REQUEST_LATENCY_BUCKET, "e2e_p95_ms", ""))
    return [_panel(title, f"p50 and p95 from {bucket} (interpolated within vLLM's buckets); red: the plan's "
                   f"{key} SLO ({slo[key]:g} ms){alert}.", "s",
                   [(_quantile(0.5, bucket), "p50 {{model_name}}"), (_quantile(0.95, bucket), "p95 {{model_name}}")],
                   [(round(slo[key] / 1000, 6), "red")]) for title, bucket, key, alert in rows]


def _agent_panels(acc: Accepted) -> list[dict[str, Any]]:
    tokens = acc.max_input_tokens
    prompt = _panel("Prompt length", ("p50 and p99 of vllm:request_prompt_tokens (interpolated within vLLM's "
                                      "buckets, 1-2-5 steps by default). Red: " + (f"the accepted input length, "
                                      f"{tokens} tokens: " if tokens is not None else "none drawn: ") + acc.input_note
                                     + (" (alert K3InputAboveAccepted)." if acc.input_bucket else ".")), "short",
                    [(_quantile(0.5, PROMPT_BUCKET), "p50 {{model_name}}"),
                     (_quantile(0.99, PROMPT_BUCKET), "p99 {{model_name}}")],
                    [(float(tokens), "red")] if tokens is not None else [])
    parser = _panel("Tool-call parser: outputs with no tool call",
                    "Share of vllm:tool_call_parser_invocations_total with outcome=no_tool_call. vLLM exports no "
                    "tool-call schema-failure metric: this counter only says whether its parser extracted a call "
                    "(a parser error counts as no_tool_call; streaming counts once per delta). Schema failures are "
                    "measured by k3load's own validation (records.jsonl, validation_summary.json): re-run the "
                    f"agent scenarios to see them. Red: {PARSER_NO_CALL_CEILING:.0%} (alert K3ToolCallParserNoCalls).",
                    "percentunit",
                    [(f'sum by (model_name) (rate(vllm:tool_call_parser_invocations_total{{{VLLM}, '
                      f'outcome="no_tool_call"}}[{RATE}])) / sum by (model_name) '
                      f'(rate(vllm:tool_call_parser_invocations_total{{{VLLM}}}[{RATE}]))', "{{model_name}}")],
                    [(PARSER_NO_CALL_CEILING, "red")])
    return [prompt, parser]


def _summary(judgment: Any, acc: Accepted) -> dict[str, Any]:
    run = judgment.data.run
    tokens_from = acc.input_note if acc.input_bucket or acc.max_input_tokens is None else \
        f"measured, but no alert: {acc.input_note}"
    lines = [f"Run `{run.get('run_id', '?')}`, model `{run.get('model', '?')}`, verdict **{judgment.verdict}**.",
             "", "| accepted limit | value | from |", "|---|---|---|",
             f"| concurrency (running + waiting) | {acc.max_concurrency if acc.max_concurrency is not None else '–'} "
             f"| {acc.concurrency_note} |",
             f"| input length (tokens) | {acc.max_input_tokens if acc.max_input_tokens is not None else '–'} "
             f"| {tokens_from} |", f"| KV cache usage | {acc.kv_ceiling:.1%} | {acc.kv_note} |", "",
             "Dashed lines on the panels are these limits and the plan's SLOs; alerts.yaml pages on the same figures."]
    return {"type": "text", "title": "Accepted limits", "options": {"mode": "markdown", "content": "\n".join(lines)}}


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"type": "query", "name": name, "label": label, "datasource": DATASOURCE, "definition": query,
            "query": {"query": query, "refId": f"{name}-variable"}, "refresh": 2, "includeAll": True, "multi": True,
            "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1,
            "regex": "", "hide": 0, "options": []}


def _templating() -> dict[str, Any]:
    source = {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
              "current": {}, "refresh": 1, "regex": "", "hide": 0, "options": []}
    return {"list": [source, _variable("model_name", "model", "label_values(vllm:num_requests_running, model_name)"),
                     _variable("instance", "vLLM instance",
                               'label_values(vllm:num_requests_running{model_name=~"$model_name"}, instance)'),
                     _variable("gpu_host", "GPU host", "label_values(DCGM_FI_DEV_FB_USED, Hostname)")]}


def dashboard(judgment: Any) -> dict[str, Any]:
    acc = accepted(judgment)
    run_id = str(judgment.data.run.get("run_id", "?"))
    panels = [_summary(judgment, acc), *_memory_panels(acc), *_engine_panels(acc), *_latency_panels(acc),
              *_agent_panels(acc)]
    for number, panel in enumerate(panels):
        wide = panel["type"] == "text"
        row = 0 if wide else 6 + (number - 1) // 2 * 8
        panel["id"] = number + 1
        panel["gridPos"] = {"h": 6 if wide else 8, "w": 24 if wide else 12, "x": 0 if wide else (number - 1) % 2 * 12,
                            "y": row}
    return {"id": None, "uid": "k3load-" + hashlib.sha256(run_id.encode()).hexdigest()[:12],
            "title": f"k3load accepted limits: {judgment.data.run.get('model', '?')} (run {run_id})",
            "description": f"Generated by k3load from run {run_id} (verdict {judgment.verdict}); thresholds are the "
                           "limits this run accepted.", "tags": ["k3load", "vllm", "kimi-k3"],
            "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1, "timezone": "browser",
            "refresh": "30s", "time": {"from": "now-6h", "to": "now"}, "fiscalYearStartMonth": 0, "links": [],
            "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                      "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                      "name": "Annotations & Alerts", "type": "dashboard"}]},
            "templating": _templating(), "panels": panels}


def render(judgment: Any) -> str:
    return json.dumps(dashboard(judgment), indent=2, ensure_ascii=False) + "\n"
