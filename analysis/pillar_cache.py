"""Pillar 3, prefix caching judged by reuse: the cold/warm control requests side by side.

Why so many "inconclusive" answers: K3 is hybrid, its KDA state is checkpointed only at block
boundaries, and a cache can fail to hit for reasons that say nothing about the deployment (only a
cold request ran, prefixes not byte-identical, eviction under capacity, a prompt shorter than one
block). Those are reported as "inconclusive, because ...", never as a pass or a fail. A cache that
is switched off or never hits is a fail; so is a hit that breaks the answers.
"""

from __future__ import annotations

import statistics
from typing import Any

from k3load.analysis.pillar import FAIL, INCONCLUSIVE, NOT_RUN, PASS, PillarResult
from k3load.analysis.rundata import RunData
from k3load.analysis.timeline import MetricIndex
from k3load.records import Attempt

WINDOW_SLACK_S = 2.5  # the sampler scrapes every second: let the window's last scrape land


def control_requests(data: RunData) -> list[Attempt]:
    """The control pair: the prefix_control stage if the plan had one, else the first user's
    shared-prefix requests. One scenario only, in send order, drill attempts left out."""
    names = {s.name for s in data.stages if s.kind == "prefix_control"}
    pool = [a for a in data.attempts if a.family == "shared_prefix" and not a.drill]
    chosen = [a for a in pool if a.stage in names] if names else []
    if not chosen and pool:
        first = min(pool, key=lambda a: a.send_ts)
        chosen = [a for a in pool if a.user_id == first.user_id]
    if not chosen:
        return []
    scenario = min(chosen, key=lambda a: a.send_ts).scenario
    return sorted((a for a in chosen if a.scenario == scenario), key=lambda a: a.send_ts)


def cache_config(data: RunData) -> dict[str, str]:
    """The last vllm:cache_config_info labels the sampler saw."""
    for event in reversed(data.events_named("cache_config")):
        labels = event.get("labels") or []
        if labels:
            return dict(labels[0])
    return {}


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "None", "") else None
    except ValueError:
        return None


def _table(control: list[Attempt]) -> list[dict[str, Any]]:
    return [{"request": i + 1, "role": "cold" if i == 0 else "warm", "turn": a.turn, "status": a.status,
             "prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens, "ttft_ms": a.ttft_ms,
             "e2e_ms": a.e2e_ms, "valid": a.valid,
             "failed_checks": sorted({f.check for f in a.findings if not f.ok})} for i, a in enumerate(control)]


def _window_numbers(index: MetricIndex, t0: float, t1: float) -> dict[str, Any]:
    delta = lambda name: index.delta(name, t0, t1)  # noqa: E731
    kv = index.gauge("vllm:kv_cache_usage_perc", t0, t1)
    return {"prefix_cache_queries": delta("vllm:prefix_cache_queries_total"),
            "prefix_cache_hits": delta("vllm:prefix_cache_hits_total"),
            "prompt_tokens_cached": delta("vllm:prompt_tokens_cached_total"),
            "prefill_kv_computed_tokens": delta("vllm:request_prefill_kv_computed_tokens_sum"),
            "kv_cache_usage_max": kv["max"] if kv else None,
            "e2e_latency_mean_s": index.histogram_mean("vllm:e2e_request_latency_seconds", t0, t1),
            "prefill_time_mean_s": index.histogram_mean("vllm:request_prefill_time_seconds", t0, t1)}


def _inconclusive(control: list[Attempt], config: dict[str, str], window: dict[str, Any],
                  limits: dict[str, float], metrics_present: bool) -> list[str]:
    reasons = []
    if not metrics_present:
        reasons.append("metrics missing: vllm:prefix_cache_queries / hits were not scraped during the control "
                       "window (is --disable-log-stats set?), so hits cannot be seen")
    if len(control) < 2:
        reasons.append("only the cold request ran: there is no warm request to compare")
    if len({a.prefix_sha256 for a in control}) > 1:
        reasons.append("the control requests' prefixes are not byte-identical (system prompt, tool definitions "
                       "order or formatting, or context changed between them)")
    cold = control[0]
    block = _int(config.get("block_size"))
    align = max(filter(None, [_int(config.get("cache_hit_alignment_tokens")), _int(config.get("mamba_block_size"))]),
                default=None)
    if cold.prompt_tokens is not None and block and cold.prompt_tokens < block:
        reasons.append(f"the prompt ({cold.prompt_tokens} tokens) is shorter than one cache block "
                       f"(block_size {block}, read from vllm:cache_config_info): nothing can be reused")
    elif cold.prompt_tokens is not None and align and cold.prompt_tokens < align:
        reasons.append(f"the prompt ({cold.prompt_tokens} tokens) is shorter than the state-checkpoint grid "
                       f"({align} tokens, read from vllm:cache_config_info): a hybrid model cannot resume there")
    kv_max = window.get("kv_cache_usage_max")
    if kv_max is not None and kv_max >= limits.get("max_kv_usage", 0.98):
        reasons.append(f"the KV cache was saturated (usage up to {kv_max:.0%}) during the control: "
                       "blocks may have been evicted for capacity")
    warm_cached = [a.cached_tokens for a in control[1:] if a.cached_tokens is not None]
    if len(warm_cached) >= 2 and any(b < max(warm_cached[:i + 1]) for i, b in enumerate(warm_cached[1:])):
        reasons.append(f"hits fell during the control ({warm_cached}): the shared prefix was evicted")
    if cold.cached_tokens and cold.prompt_tokens and cold.cached_tokens >= cold.prompt_tokens / 2:
        reasons.append(f"the cold request already had {cold.cached_tokens} of {cold.prompt_tokens} prompt tokens "
                       "cached: it was not cold (was the run id, which salts the prefix, reused?)")
    return reasons


def _failures(control: list[Attempt], window: dict[str, Any], config: dict[str, str],
              limits: dict[str, float]) -> tuple[list[str], dict[str, Any]]:
    cold, warm = control[0], control[1:]
    numbers: dict[str, Any] = {}
    if config.get("enable_prefix_caching") == "False":
        return ["prefix caching is off on the server (vllm:cache_config_info enable_prefix_caching=False)"], numbers
    hits = window.get("prefix_cache_hits")
    if not hits:
        return [f"no prefix-cache hits although the same prefix was sent {len(control)} times "
                f"(queries {window.get('prefix_cache_queries')}, hits {hits})"], numbers
    ratios = [a.cached_tokens / a.prompt_tokens for a in warm if a.cached_tokens is not None and a.prompt_tokens]
    numbers["warm_hit_ratio"] = statistics.fmean(ratios) if ratios else None
    reasons = []
    warm_cached = [a.cached_tokens for a in warm if a.cached_tokens is not None]
    if warm_cached and cold.cached_tokens is not None and statistics.fmean(warm_cached) <= cold.cached_tokens:
        # A shared head (e.g. tool declarations rendered first) may hit even for the cold request;
        # the warm requests must reuse more than that.
        reasons.append(f"hits did not rise from the second request: warm requests reused "
                       f"{statistics.fmean(warm_cached):.0f} tokens on average, the cold one {cold.cached_tokens}")
    if ratios and numbers["warm_hit_ratio"] < limits["min_warm_hit_ratio"]:
        reasons.append(f"warm requests reused only {numbers['warm_hit_ratio']:.0%} of their prompt "
                       f"(at least {limits['min_warm_hit_ratio']:.0%} expected)")
    warm_ttft = [a.ttft_ms for a in warm if a.ttft_ms is not None]
    if cold.ttft_ms and warm_ttft:
        numbers["ttft_gain"] = 1 - statistics.median(warm_ttft) / cold.ttft_ms
        if numbers["ttft_gain"] < limits["min_latency_gain"]:
            reasons.append(f"no latency effect: warm TTFT median {statistics.median(warm_ttft):.1f} ms vs cold "
                           f"{cold.ttft_ms:.1f} ms (gain {numbers['ttft_gain']:.0%}, at least "
                           f"{limits['min_latency_gain']:.0%} expected)")
    warm_valid = sum(a.valid for a in warm) / len(warm)
    if warm_valid < (1.0 if cold.valid else 0.0):
        broken = sorted({f.check for a in warm for f in a.findings if not f.ok})
        reasons.append(f"warm answers broke although the cold one was valid ({broken}): a hit that breaks "
                       "tool calls is not a pass")
    return reasons, numbers


def judge_prefix_cache(data: RunData, index: MetricIndex, limits: dict[str, float]) -> PillarResult:
    control = [a for a in control_requests(data) if a.status == "ok"]
    if not control:
        return PillarResult(NOT_RUN, ["no shared-prefix control request completed"])
    t0, t1 = control[0].send_ts - 0.5, control[-1].end_ts + WINDOW_SLACK_S
    window = _window_numbers(index, t0, t1)
    config = cache_config(data)
    numbers: dict[str, Any] = {"control": _table(control), "window": window,
                               "cache_config": {k: config.get(k) for k in (
                                   "block_size", "enable_prefix_caching", "mamba_block_size",
                                   "cache_hit_alignment_tokens", "num_gpu_blocks") if k in config}}
    # Absent counters are unknown, never zero hits: with --disable-log-stats vLLM 0.32 still serves
    # vllm:tool_call_parser_invocations_total, so "some vllm:* series" does not mean cache metrics.
    metrics_present = index.present(t0, t1) and window["prefix_cache_queries"] is not None
    reasons = _inconclusive(control, config, window, limits, metrics_present)
    if config.get("enable_prefix_caching") == "False" and index.present(t0, t1):
        reasons = []  # switched off is a fail whatever else was wrong
    if reasons:
        return PillarResult(INCONCLUSIVE, [f"inconclusive, because {r}" for r in reasons], numbers)
    failures, more = _failures(control, window, config, limits)
    numbers |= more
    if failures:
        return PillarResult(FAIL, failures, numbers)
    return PillarResult(PASS, [f"hits rose from the second request: {window['prefix_cache_hits']:.0f} hit tokens "
                               f"of {window['prefix_cache_queries']:.0f} queried, warm requests reused "
                               f"{numbers['warm_hit_ratio'] or 0:.0%} of their prompt, TTFT "
                               f"{numbers.get('ttft_gain', 0):.0%} lower than cold, answers intact"], numbers)
