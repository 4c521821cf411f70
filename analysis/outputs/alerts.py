"""`alerts.yaml`: Prometheus alerting rules for after go-live, from the limits this run accepted.

Why generated: the thresholds that were proven here (KV ceiling, concurrency, input length, queue,
TTFT SLO, GPU memory growth) are exactly what must page someone when production drifts past them; the
spec's rollback conditions (recurring OOM, persistent cache pressure, tool-call failures, leaving the
official requirements) become rules too. Series names are vLLM's and dcgm-exporter's.

Why the KV alert sits at the measured ceiling: the acceptance proved the deployment only up to the
highest KV usage a stage within limits reached; above it is unproven. (It used to be clamped to at
least 50%, which put the alert above what was ever seen.) A run that never loaded the KV cache has no
ceiling: the plan's `max_kv_usage` is used and the file says so. A limit the run did not establish
(no concurrency step held, no input length measured) gives no alert, with a comment saying why.
`analysis/outputs/dashboard.py` draws the same figures (`accepted()`), so the panels and the pages agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml
from prometheus_client.utils import floatToGoString

from k3load.analysis.pillars.pillar import rounded, thresholds
from k3load.sampler.prom import split_key
from k3load.sampler.vllm_metrics import VllmMetric

PROMPT_BUCKET = VllmMetric.REQUEST_PROMPT_TOKENS_BUCKET.value
HIT_RATIO_FLOOR = 0.1  # production prefix-cache hit ratio under which the cache has collapsed
PARSER_NO_CALL_CEILING = 0.5  # share of parser invocations that extract no tool call


@dataclass(frozen=True)
class PromptBucket:
    """The histogram bucket a prompt-length limit is checked against: its bound and the `le` spellings
    that may carry it (vLLM writes `10000.0`, Prometheus 3 may normalise, Go writes `1e+06`)."""

    le: float
    spellings: tuple[str, ...]

    def matcher(self) -> str:
        """`le=~"..."` without backslashes (`[.]`, `[+]`), so YAML and PromQL quoting need no escapes."""
        forms = "|".join(s.replace(".", "[.]").replace("+", "[+]") for s in self.spellings)
        return f'le=~"{forms}"'


@dataclass(frozen=True)
class Accepted:
    """The limits the hand-over draws, each with where it comes from (`*_note`, said in the files)."""

    limits: dict[str, dict[str, float]]  # the plan's thresholds, defaults filled in
    kv_ceiling: float
    kv_measured: bool
    kv_note: str
    max_concurrency: int | None
    concurrency_note: str
    max_input_tokens: int | None
    input_bucket: PromptBucket | None
    input_note: str
    notes: list[str] = field(default_factory=list)  # YAML comments: fallbacks and omitted alerts
    gpu_free_floor_mib: float | None = None  # free memory below which a GPU has grown past what was accepted
    gpu_note: str = ""
    ttfa_note: str = ""  # the first answer token after the reasoning: no vLLM series, said rather than alerted


def _kv(judgment: Any, plan_max: float) -> tuple[float, bool, str]:
    measured = judgment.limits.kv_cache_usage_ceiling
    if measured is not None and measured > 0:
        ceiling = min(rounded(float(measured)), plan_max)  # rounded as verdict.json states it
        return ceiling, True, (f"the measured ceiling, the highest KV usage a stage within limits reached "
                               f"({ceiling:.1%}); above it the deployment is unproven")
    why = ("no stage within limits read vllm:kv_cache_usage_perc (metrics missing, or no stage held)"
           if measured is None else "KV usage stayed at 0% in every stage within limits: the run never "
           "loaded the KV cache")
    return plan_max, False, f"no measured ceiling ({why}); the plan's max_kv_usage ({plan_max:.0%}) instead"


def _concurrency(judgment: Any) -> tuple[int | None, str]:
    users = judgment.limits.max_concurrency
    stepped = bool(judgment.ramp.steps)
    if users is None:
        return None, ("no concurrency step held within limits" if stepped else "no stage held within limits")
    ran_out = judgment.limits.ran_out_first
    where = (f"the largest concurrency step within limits ({users} users, one request in flight each"
             + (f"; {ran_out} ran out above it)" if ran_out else ")")) if stepped else \
        f"the largest stage within limits ({users} users; no concurrency ramp was run)"
    return int(users), where


def _bucket_bounds(metrics: list[dict[str, Any]]) -> dict[float, set[str]]:
    """The prompt-length buckets the server exposed, from the last scrape that carried them."""
    for line in reversed(metrics):
        bounds: dict[float, set[str]] = {}
        for key in line.get("samples") or {}:
            if key.startswith(PROMPT_BUCKET + "{"):
                le = split_key(key)[1].get("le")
                if le is not None:
                    bounds.setdefault(float(le), set()).add(le)
        if bounds:
            return bounds
    return {}


def _input(judgment: Any) -> tuple[int | None, PromptBucket | None, str]:
    limit = judgment.limits.max_input_tokens
    if limit is None:
        return None, None, "no input length was measured within limits (no answered request in a stage within " \
                           "limits carried the server's prompt_tokens)"
    bounds = _bucket_bounds(judgment.data.metrics)
    if not bounds:
        return int(limit), None, f"the run never scraped {PROMPT_BUCKET}: the server's bucket bounds are unknown"
    above = [b for b in bounds if limit <= b < float("inf")]
    if not above:
        top = max((b for b in bounds if b < float("inf")), default=0)
        return int(limit), None, (f"the server's largest finite prompt-length bucket ({top:.0f} tokens) is below the "
                                  f"accepted {limit} tokens: its histogram cannot tell longer prompts apart")
    le = min(above)
    spellings = set(bounds[le]) | {floatToGoString(le), repr(le)} | ({str(int(le))} if le.is_integer() else set())
    rounding = ("exactly at the limit" if le == limit else f"the nearest bound at or above it: prompts of "
                f"{limit + 1}-{le:.0f} tokens pass unseen")
    return int(limit), PromptBucket(le, tuple(sorted(spellings))), \
        f"the accepted {limit} tokens, read from vLLM's prompt-length bucket le={le:.0f} ({rounding})"


def _gpu_floor(judgment: Any, growth_pct: float) -> tuple[float | None, str]:
    """The free memory a GPU may fall to: its start-up baseline (vLLM's reservation, flat on a healthy node)
    less the growth the plan accepts, taken from the GPU that had least free. Never the card's share: a
    headroom alert on a reserved card fires on every healthy node, a pager storm."""
    resources = judgment.pillars.get("resources") if hasattr(judgment, "pillars") else None
    baselines = ((resources.numbers if resources else {}).get("gpu_memory") or {}).get("baselines") or []
    if not baselines:
        return None, "no GPU memory was read in this run: no start-up baseline to alert against"
    free = min(max(b["total_mib"] - b["used_mib"], 0.0) for b in baselines)
    floor = free * (1 - growth_pct / 100)
    return floor, (f"{floor:,.0f} MiB free: the least free memory of any GPU after start-up ({free:,.0f} MiB, "
                   f"vLLM's reservation included) less the plan's max_gpu_growth_pct ({growth_pct:g}%)")


def _ttfa(judgment: Any, slo_ms: float) -> str:
    """What the run measured of TTFA. vLLM exports no series for it (`vllm:time_to_first_token_seconds` stops at
    the first reasoning token, vllm/v1/metrics/loggers.py), so no alert can watch it in production."""
    table = getattr(judgment, "stage_table", None) or []
    seen = [(s.ttfa_p95_ms, s.stage) for s in table if s.ttfa_p95_ms is not None]
    measured = (f"measured here at up to {max(seen)[0]:,.0f} ms (stage {max(seen)[1]})" if seen else
                "not measured in this run (no streamed answer)")
    return (f"time to the first answer token after the reasoning (TTFA) has no vLLM series (its TTFT ends at the "
            f"first reasoning token): the accepted slo.ttfa_p95_ms is {slo_ms:,.0f} ms, {measured}; re-run k3load "
            "against production to watch it")


def accepted(judgment: Any) -> Accepted:
    limits = thresholds(judgment.data.plan.thresholds if judgment.data.plan else None)
    kv, measured, kv_note = _kv(judgment, limits["resources"]["max_kv_usage"])
    users, users_note = _concurrency(judgment)
    tokens, bucket, input_note = _input(judgment)
    notes = [f"K3KVCachePressure: {kv_note}."]
    if users is None:
        notes.append(f"K3ConcurrencyAboveAccepted omitted: {users_note}, so no concurrency was accepted.")
    if bucket is None:
        notes.append(f"K3InputAboveAccepted omitted: {input_note}.")
    floor, gpu_note = _gpu_floor(judgment, limits["resources"]["max_gpu_growth_pct"])
    notes.append(f"K3GPUMemoryGrowth: {gpu_note}." if floor is not None else
                 f"K3GPUMemoryGrowth omitted: {gpu_note} (K3GPUMemoryCreep still watches the trend).")
    ttfa_note = _ttfa(judgment, limits["slo"]["ttfa_p95_ms"])
    notes.append(f"No TTFA alert: {ttfa_note}.")
    return Accepted(limits, kv, measured, kv_note, users, users_note, tokens, bucket, input_note, notes, floor,
                    gpu_note, ttfa_note)


def _rule(name: str, expr: str, duration: str, severity: str, summary: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": duration, "labels": {"severity": severity, "source": "k3load"},
            "annotations": {"summary": summary}}


def _gpu_rules(acc: Accepted) -> list[dict[str, Any]]:
    """GPU memory past what the run accepted: the free memory under its floor (vLLM's reservation is the
    baseline, never the alarm)."""
    if acc.gpu_free_floor_mib is None:
        return []
    return [_rule("K3GPUMemoryGrowth", f"min(DCGM_FI_DEV_FB_FREE) < {acc.gpu_free_floor_mib:.0f}", "5m", "critical",
                  f"a GPU's free memory fell under {acc.gpu_note}: memory grew outside the KV pool "
                  "(recurring OOM is a rollback condition)")]


def _limit_rules(acc: Accepted) -> list[dict[str, Any]]:
    """The accepted concurrency and input length, where the run established them."""
    out = []
    if acc.max_concurrency is not None:
        out.append(_rule("K3ConcurrencyAboveAccepted", "sum by (model_name) (vllm:num_requests_running) + "
                         f"sum by (model_name) (vllm:num_requests_waiting) > {acc.max_concurrency}", "5m", "warning",
                         f"requests running + waiting above {acc.max_concurrency} for 5 minutes; the accepted "
                         f"concurrency is {acc.concurrency_note}"))
    if acc.input_bucket is not None:
        bucket = f"{PROMPT_BUCKET}{{{acc.input_bucket.matcher()}}}"
        out.append(_rule("K3InputAboveAccepted", "sum by (model_name) (increase(vllm:request_prompt_tokens_count[5m])) "
                         f"- sum by (model_name) (increase({bucket}[5m])) > 0", "0m", "warning",
                         f"prompts longer than the accepted input length: {acc.input_note}"))
    return out


def rules(judgment: Any, acc: Accepted | None = None) -> list[dict[str, Any]]:
    acc = acc or accepted(judgment)
    res, slo = acc.limits["resources"], acc.limits["slo"]
    runway_s = max(res["min_gpu_runway_h"], 1.0) * 3600
    return [
        _rule("K3KVCachePressure", f"max(vllm:kv_cache_usage_perc) > {acc.kv_ceiling:g}", "5m", "warning",
              f"KV cache usage above {acc.kv_ceiling:.1%} for 5 minutes: {acc.kv_note}"),
        *_limit_rules(acc),
        _rule("K3RequestsWaiting", "sum(vllm:num_requests_waiting) > 0 and sum(vllm:num_requests_running) > 0",
              f"{int(res['max_waiting_sustained_s'])}s", "warning",
              "requests are queueing behind running ones (sustained waiting)"),
        _rule("K3Preemptions", f"sum(rate(vllm:num_preemptions_total[5m])) * 60 > {res['max_preemptions_per_min']}",
              "5m", "warning", "preemptions above the accepted rate: KV pressure"),
        _rule("K3PrefixCacheHitRatioLow", "sum(rate(vllm:prefix_cache_hits_total[15m])) / "
              f"sum(rate(vllm:prefix_cache_queries_total[15m])) < {HIT_RATIO_FLOOR}", "30m", "warning",
              "prefix-cache hit ratio collapsed (persistent cache pressure is a rollback condition)"),
        _rule("K3TTFTAboveSLO", "histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"
              f"[5m]))) > {slo['ttft_p95_ms'] / 1000:.3f}", "10m", "warning", "TTFT p95 above the accepted SLO"),
        *_gpu_rules(acc),
        # A steady fall of free memory over an hour, projected: the leak the soak rule judges. Two hours of it:
        # a restart's own drop from an empty card to the reservation leaves the hour's window within the hour.
        _rule("K3GPUMemoryCreep", f"min(predict_linear(DCGM_FI_DEV_FB_FREE[1h], {runway_s:.0f})) < 0", "2h",
              "warning", f"at the last hour's trend a GPU runs out of memory within {runway_s / 3600:g} h "
              "(min_gpu_runway_h): memory creeping outside vLLM's KV pool (a leak or fragmentation)"),
        _rule("K3ServerRestarts", "changes(process_start_time_seconds{job=~\".*vllm.*\"}[1h]) > 1", "0m", "critical",
              "the server restarted more than once in an hour: recurring OOM or crash is a rollback condition"),
        _rule("K3ToolCallParserNoCalls", "sum(rate(vllm:tool_call_parser_invocations_total{outcome=\"no_tool_call\"}"
              f"[15m])) / sum(rate(vllm:tool_call_parser_invocations_total[15m])) > {PARSER_NO_CALL_CEILING}", "30m",
              "warning", "the tool-call parser extracts no call from most outputs: check tool-call schema failures "
              "(re-run the k3load agent scenarios); non-reproducible tool calls are a rollback condition"),
        _rule("K3CacheConfigDiffers", "count(group by (block_size, num_gpu_blocks, enable_prefix_caching, "
              "mamba_block_size) (vllm:cache_config_info)) > 1", "0m", "warning",
              "engines serve with different cache configurations: an update may have left the accepted "
              "configuration; re-run the precheck"),
    ]


def render(judgment: Any) -> str:
    acc = accepted(judgment)
    doc = {"groups": [{"name": "k3load-accepted-limits", "rules": rules(judgment, acc)}]}
    head = (f"# Generated by k3load from run {judgment.data.run.get('run_id', '?')} (verdict {judgment.verdict}).\n"
            "# Load into Prometheus as a rule file; thresholds are the limits this run accepted.\n"
            "# dashboard.json beside this file draws the same limits for Grafana.\n")
    notes = "".join(f"# {note}\n" for note in acc.notes)
    return head + notes + yaml.safe_dump(doc, sort_keys=False, width=120)
