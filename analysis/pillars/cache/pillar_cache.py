"""Pillar 3, prefix caching judged by reuse: cold/warm control pairs side by side.

Why pairs: each cold request carries a fresh salt and its warm twin repeats the same bytes after it
finished, so the warm answer and latency compare like for like with their own cold twin. A warm
request asking a different question than the cold one would compare unlike answers and fail at
random on a merely weak model.

Rules, each with the evidence it needs (missing evidence makes it inconclusive, never pass or fail):
- `cache.enabled`: vllm:cache_config_info; off is a fail.
- `cache.hits`: /metrics prefix-cache hits over the control window, bracketed by good scrapes on every
  source, and the records' `cached_tokens`; warm twins must reuse more than their cold twins, at least
  `min_warm_hit_ratio` of their prompt; where both sources exist they must agree.
- `cache.latency`: the warm/cold TTFT ratio per pair; an exact one-sided sign test that the median
  ratio is below 1 - `min_latency_gain` (pass) or above it (fail), with a bootstrap interval shown.
- `cache.answers`: a hit that breaks the answers: warm twins invalid where their cold twins were
  valid, more often than chance (exact one-sided McNemar test on the discordant pairs).
- `cache.routing` (two or more replicas scraped): which replica each twin met, from the per-source request
  counters (analysis/pillars/cache/replicas.py). Warm twins sent to another replica than their cold twin, where they
  reused nothing, fail it: the router is not prefix-affine (the gateway layer), not eviction, and more pairs
  would not help. The hits and latency rules then judge only the pairs whose twins met one replica.
Why "inconclusive, because ...": K3 is hybrid, its KDA state is checkpointed only at block
boundaries, and a cache can miss for reasons that say nothing about the deployment (a prompt shorter
than one block, prefixes not byte-identical, eviction under capacity, a scrape gap).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from k3load.analysis.pillars.cache.replicas import Meeting, Routing, per_replica, reuse_by_meeting, reused, route_pairs
from k3load.analysis.pillars.pillar import PillarResult
from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.clusters import attempt_key
from k3load.analysis.run.lean import AnyAttempt
from k3load.analysis.run.rundata import RunData
from k3load.analysis.run.stats import bootstrap_median_ci, mcnemar_one_sided, sign_test_less, wilson
from k3load.analysis.run.timeline import MetricIndex
from k3load.events import Event
from k3load.outcomes import FAIL, GATEWAY, INCONCLUSIVE, NOT_RUN, PASS, Pillar
from k3load.sampler.vllm_metrics import VllmMetric

PILLAR = Pillar.PREFIX_CACHE  # the pillar these rules judge

WINDOW_SLACK_S = 2.5  # gauges: let the window's last scrape land
ALPHA = 0.05
MIN_PAIRS = 5  # the fewest pairs an exact one-sided sign test can decide at ALPHA (1/32 < 0.05 < 1/16)
SOURCES_AGREE = 0.10  # /metrics hits and the records' cached_tokens may differ by this share (or a block a request)
# The share of pairs a prefix-affine router may still send apart and lose (a load-aware rebalance, a replica
# rolled mid-run): routing fails only when the pairs split and lost are above it with 95% confidence, is said
# with the pass when below it with 95% confidence, and undecided between.
MAX_SPLIT_LOSS_SHARE = 0.05
ROUTING_FIX = ("use prefix-aware routing or session affinity, e.g. --k3-session-header NAME with a router keyed "
               "on it")
Pair = tuple[AnyAttempt, AnyAttempt]


def control_pairs(data: RunData) -> list[tuple[AnyAttempt, AnyAttempt]]:
    """(cold, warm) twins in pair order: the last attempt of each role (a retry replaces its try)."""
    by_pair: dict[int, dict[str, AnyAttempt]] = {}
    rows = data.columns.rows()
    roles = data.pick(rows[rows.code_is("control_role", "cold", "warm")])  # the control's records: read whole
    control = [a for a in roles if a.control_pair is not None and not a.drill]  # filtered before the (stable)
    # sort: the same order, without sorting the soak
    for attempt in sorted(control, key=lambda a: (a.send_ts, a.attempt)):
        by_pair.setdefault(int(attempt.control_pair or 0), {})[str(attempt.control_role)] = attempt
    return [(p["cold"], p["warm"]) for _, p in sorted(by_pair.items()) if "cold" in p and "warm" in p]


def cache_config(data: RunData) -> dict[str, str]:
    """The last vllm:cache_config_info labels the sampler saw."""
    for event in reversed(data.events_named(Event.CACHE_CONFIG)):
        labels = event.get("labels") or []
        if labels:
            return dict(labels[0])
    return {}


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "None", "") else None
    except ValueError:
        return None


def _table(pairs: list[tuple[AnyAttempt, AnyAttempt]]) -> list[dict[str, Any]]:
    rows = []
    for number, pair in enumerate(pairs, start=1):
        for a in pair:
            rows.append({"pair": number, "role": a.control_role, "turn": a.turn, "status": a.status,
                         "prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens, "ttft_ms": a.ttft_ms,
                         "e2e_ms": a.e2e_ms, "valid": a.valid,
                         "failed_checks": sorted({f.check for f in a.findings if not f.ok})})
    return rows


def _window(index: MetricIndex, t0: float, t1: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Counter deltas bracketed by good scrapes (and why not), gauges over the window."""
    names = {"prefix_cache_queries": VllmMetric.PREFIX_CACHE_QUERIES_TOTAL,
             "prefix_cache_hits": VllmMetric.PREFIX_CACHE_HITS_TOTAL,
             "prompt_tokens_cached": VllmMetric.PROMPT_TOKENS_CACHED_TOTAL,
             "prefill_kv_computed_tokens": VllmMetric.REQUEST_PREFILL_KV_COMPUTED_TOKENS_SUM}
    numbers: dict[str, Any] = {}
    gaps: dict[str, str] = {}
    for key, name in names.items():
        found = index.bracketed_delta(name, t0, t1)
        numbers[key] = found.value
        if found.missing:
            gaps[key] = found.missing
    kv = index.gauge(VllmMetric.KV_CACHE_USAGE, t0, t1 + WINDOW_SLACK_S)
    numbers["kv_cache_usage_max"] = kv["max"] if kv else None
    numbers["sources"] = index.bracketed_delta(names["prefix_cache_queries"], t0, t1).sources
    numbers["e2e_latency_mean_s"] = index.histogram_mean(VllmMetric.E2E_REQUEST_LATENCY, t0, t1 + WINDOW_SLACK_S)
    numbers["prefill_time_mean_s"] = index.histogram_mean(VllmMetric.REQUEST_PREFILL_TIME, t0,
                                                          t1 + WINDOW_SLACK_S)
    return numbers, gaps


def _inconclusive(pairs: list[tuple[AnyAttempt, AnyAttempt]], config: dict[str, str], window: dict[str, Any],
                  gaps: dict[str, str], limits: dict[str, float], metrics_seen: bool) -> list[str]:
    reasons = []
    if not metrics_seen:
        reasons.append("metrics missing: vllm:prefix_cache_queries / hits were not scraped during the control "
                       "(is --disable-log-stats set, or /metrics not reachable? see --k3-metrics-url)")
    elif "prefix_cache_hits" in gaps or "prefix_cache_queries" in gaps:
        cached = sum(w.cached_tokens or 0 for _, w in pairs)
        reasons.append(f"the server's counters do not cover the control window: "
                       f"{gaps.get('prefix_cache_hits') or gaps.get('prefix_cache_queries')} (the warm requests' own "
                       f"usage says {cached} cached tokens)")
    if any(c.prefix_sha256 != w.prefix_sha256 or c.request_sha256 != w.request_sha256 for c, w in pairs):
        reasons.append("a warm request's bytes differ from its cold twin's (system prompt, tool definitions order "
                       "or formatting, or context changed between them)")
    cold = pairs[0][0]
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
    warm_cold = [c for c, _ in pairs if c.cached_tokens and c.prompt_tokens and c.cached_tokens >= c.prompt_tokens / 2]
    if len(warm_cold) > len(pairs) / 2:
        reasons.append(f"{len(warm_cold)} of {len(pairs)} cold requests already had half their prompt cached: they "
                       "were not cold (was the run id, which salts the prefix, reused?)")
    return reasons


def _hits_rule(pairs: list[Pair], window: dict[str, Any], config: dict[str, str], limits: dict[str, float],
               judged: list[Pair] | None = None, scope: str | None = None) -> RuleResult:
    """`judged`: the pairs whose rise and ratio count (`scope` says which, when not all): the server's window
    covers every pair, so the two sources are compared over all of them."""
    hits = window.get("prefix_cache_hits")
    evidence = ("metrics.jsonl control window", "records.jsonl control pairs (cached_tokens)")
    judged = pairs if judged is None else judged
    ratios = [w.cached_tokens / w.prompt_tokens for _, w in judged if w.cached_tokens is not None and w.prompt_tokens]
    ratio = statistics.fmean(ratios) if ratios else None
    if scope and not judged:  # every pair met two replicas (or could not be told): no hit was to be had
        return RuleResult("cache.hits", PILLAR, INCONCLUSIVE, "inconclusive, because no pair's twins were "
                          "seen to meet one replica: the engine's cache cannot be judged apart from the routing",
                          None, len(pairs), evidence=evidence)
    if not hits:
        return RuleResult("cache.hits", PILLAR, FAIL, f"no prefix-cache hits although each of {len(pairs)} "
                          f"prefixes was sent twice (queries {window.get('prefix_cache_queries')}, hits {hits})",
                          hits, 1, evidence=evidence)
    recorded = sum(a.cached_tokens for pair in pairs for a in pair if a.cached_tokens is not None)
    has_usage = any(a.cached_tokens is not None for pair in pairs for a in pair)
    cached = window.get("prompt_tokens_cached")
    server = cached if cached is not None else hits
    slack = max(SOURCES_AGREE * max(server, recorded), (_int(config.get("block_size")) or 16) * 2 * len(pairs))
    if has_usage and abs(server - recorded) > slack:
        return RuleResult("cache.hits", PILLAR, INCONCLUSIVE, f"inconclusive, because the two sources of "
                          f"cache hits disagree: /metrics counted {server:.0f} cached tokens over the control window, "
                          f"the responses' usage {recorded}", server, recorded, evidence=evidence)
    if not judged:
        return RuleResult("cache.hits", PILLAR, INCONCLUSIVE, "inconclusive, because no pair's twins were "
                          "seen to meet one replica: the engine's cache cannot be judged apart from the routing",
                          None, len(pairs), evidence=evidence)
    risen = [w for c, w in judged if (w.cached_tokens or 0) > (c.cached_tokens or 0)]
    among = f"the {scope}" if scope else f"{len(judged)} pairs"
    if has_usage and not risen:
        return RuleResult("cache.hits", PILLAR, FAIL, f"hits did not rise from cold to warm in any of "
                          f"{among} (no warm twin reused more than its cold twin)", 0, len(judged),
                          evidence=evidence)
    if has_usage and len(risen) < len(judged):
        return RuleResult("cache.hits", PILLAR, INCONCLUSIVE, f"inconclusive, because hits rose in only "
                          f"{len(risen)} of {among}: the others' prefixes may have been evicted between "
                          "the twins", len(risen), len(judged), evidence=evidence)
    if ratio is not None and ratio < limits["min_warm_hit_ratio"]:
        return RuleResult("cache.hits", PILLAR, FAIL, f"warm requests reused only {ratio:.0%} of their "
                          f"prompt (at least {limits['min_warm_hit_ratio']:.0%} expected)", ratio,
                          limits["min_warm_hit_ratio"], evidence=evidence)
    return RuleResult("cache.hits", PILLAR, PASS, f"{hits:.0f} hit tokens of "
                      f"{window.get('prefix_cache_queries') or 0:.0f} queried, warm twins reused "
                      f"{ratio or 0:.0%} of their prompt (both sources agree{'; ' + scope if scope else ''})"
                      if has_usage else
                      f"{hits:.0f} hit tokens of {window.get('prefix_cache_queries') or 0:.0f} queried (the "
                      "responses carry no cached_tokens: one source only)", ratio, limits["min_warm_hit_ratio"],
                      evidence=evidence)


def _latency_rule(pairs: list[Pair], limits: dict[str, float], scope: str | None = None) -> RuleResult:
    """`scope`: which pairs these are when not all (those whose twins met one replica): then more pairs would
    not decide, more pairs that meet one replica would."""
    bound = 1 - limits["min_latency_gain"]
    ratios = [w.ttft_ms / c.ttft_ms for c, w in pairs if c.ttft_ms and w.ttft_ms is not None]
    evidence = ("records.jsonl control pairs (ttft_ms)",)
    if scope and len(ratios) < MIN_PAIRS:
        return RuleResult("cache.latency", PILLAR, INCONCLUSIVE, f"inconclusive, because only the {scope} "
                          f"compare like with like ({len(ratios)} with a first-token time on both sides): a sign test "
                          f"needs at least {MIN_PAIRS} to decide at 5% ({ROUTING_FIX})",
                          statistics.median(ratios) if ratios else None, bound, evidence=evidence)
    if len(ratios) < 2:
        return RuleResult("cache.latency", PILLAR, INCONCLUSIVE, "inconclusive, because fewer than two "
                          "pairs have a first-token time on both sides", None, bound, evidence=evidence)
    if len(ratios) < MIN_PAIRS:
        return RuleResult("cache.latency", PILLAR, INCONCLUSIVE, f"inconclusive, because only {len(ratios)} "
                          f"pairs completed: a sign test needs at least {MIN_PAIRS} to decide at 5% (lengthen the "
                          "prefix_control stage)", statistics.median(ratios), bound, evidence=evidence)
    median = statistics.median(ratios)
    ci = bootstrap_median_ci(ratios)
    faster = sign_test_less(ratios, bound)
    slower = sign_test_less([-r for r in ratios], -bound)
    ci_text = f", 95% bootstrap CI {ci[0]:.2f}-{ci[1]:.2f}" if ci else ""
    of = f" (the {scope})" if scope else ""
    text = f"warm/cold TTFT ratio median {median:.2f} over {len(ratios)} pairs{of}{ci_text} (at most {bound:.2f} needed"
    if faster < ALPHA:
        return RuleResult("cache.latency", PILLAR, PASS, f"{text}; sign test p={faster:.3f})", median, bound,
                          evidence=evidence, interval=ci)
    if slower < ALPHA:
        return RuleResult("cache.latency", PILLAR, FAIL, f"no latency effect: {text}; sign test that it is "
                          f"above p={slower:.3f})", median, bound, evidence=evidence, interval=ci)
    return RuleResult("cache.latency", PILLAR, INCONCLUSIVE, f"inconclusive, because the latency effect is "
                      f"not significant either way: {text}; sign test p={faster:.3f}; more pairs "
                      f"{'that meet one replica ' if scope else ''}would decide)",
                      median, bound, evidence=evidence, interval=ci)


def _judged(pairs: list[Pair], routing: Routing | None) -> tuple[list[Pair], str | None]:
    """The pairs the hits and latency rules judge, and which they are when not all. Why: a warm twin on
    another replica misses whatever the engine's cache does; judged with the others it reads as eviction.
    Every pair is judged where routing cannot have cost reuse (one replica, every pair met one, or every warm
    twin reused its prefix)."""
    if routing is None or routing.count(Meeting.SAME) == len(pairs) or all(reused(c, w) for c, w in pairs):
        return pairs, None
    same = [p for p, r in zip(pairs, routing.pairs, strict=True) if r.meeting is Meeting.SAME]
    return same, f"{len(same)} of {len(pairs)} pairs whose twins met one replica"


def _share(k: int, n: int) -> str:
    rate = wilson(k, n)
    return f"{k} of {n} ({k / n:.0%}, 95% CI {rate.low:.0%}-{rate.high:.0%})" if n else "none"


def _routing_rule(pairs: list[Pair], routing: Routing) -> RuleResult:
    """Did the router send warm twins to another replica than their cold twin, where they reused nothing?
    The per-source counters say so (analysis/pillars/cache/replicas.py); more pairs would not change it. A split twin
    whose
    response carries no cached_tokens is not seen either way (a cache shared across replicas could serve it)."""
    read = ", ".join(routing.counters) or "no per-request counter"
    evidence = (f"metrics.jsonl per source ({read})",
                "records.jsonl control pairs (send_ts, end_ts, cached_tokens)")
    routed = list(zip(pairs, routing.pairs, strict=True))
    split = [p for p, r in routed if r.meeting is Meeting.SPLIT]
    unknown = [(p, r) for p, r in routed if r.meeting is Meeting.UNKNOWN]
    lost, unseen = [p for p in split if reused(*p) is False], [p for p in split if reused(*p) is None]
    missed = [p for p, _ in unknown if not reused(*p)]
    n, told = len(pairs), [r for c, w in pairs if (r := reused(c, w)) is not None]
    got = f"warm twins that reused their prefix across the replicas: {_share(sum(told), len(told))}"
    share = wilson(len(split), n)
    interval = (share.low, share.high)
    sent = f"the router sent {len(split)} of {n} warm twins to another replica than their cold twin" + (
        f" ({len(unknown)} more could not be told)" if unknown else "")
    loss = wilson(len(lost), n - len(unknown))  # of the pairs whose meeting was told
    if lost and loss.low > MAX_SPLIT_LOSS_SHARE:
        return RuleResult("cache.routing", PILLAR, FAIL, f"{sent}, and {len(lost)} of them reused nothing: "
                          f"routing is not prefix-affine ({ROUTING_FIX}); the gateway layer, not eviction ({got})",
                          len(split), n, evidence=evidence, interval=interval)
    if lost and loss.high >= MAX_SPLIT_LOSS_SHARE:
        return RuleResult("cache.routing", PILLAR, INCONCLUSIVE, f"inconclusive, because {sent}, and "
                          f"{len(lost)} of them reused nothing ({_share(len(lost), loss.n)} of the pairs told): a "
                          f"rebalance now and then (at most {MAX_SPLIT_LOSS_SHARE:.0%} of conversations) or routing "
                          f"that is not prefix-affine; more pairs would tell which ({ROUTING_FIX}; {got})",
                          len(split), n, evidence=evidence, interval=interval)
    if unseen:
        return RuleResult("cache.routing", PILLAR, INCONCLUSIVE, f"inconclusive, because {sent}, and their "
                          "responses carry no cached_tokens: whether a cache shared across replicas served them is "
                          f"not seen (vLLM's --enable-prompt-tokens-details shows it; or {ROUTING_FIX})", len(split),
                          n, evidence=evidence, interval=interval)
    if missed:
        whys = sorted({r.why for _, r in unknown if r.why})
        return RuleResult("cache.routing", PILLAR, INCONCLUSIVE, f"inconclusive, because the per-source "
                          f"counters could not tell which replica {len(unknown)} of {n} pairs met ({'; '.join(whys)}) "
                          f"and {len(missed)} of them were not seen to reuse their prefix: routing or eviction "
                          f"(scrape faster than a pair lasts with --k3-sample-interval, or {ROUTING_FIX})",
                          len(unknown), n, evidence=evidence)
    said = [f"{routing.count(Meeting.SAME)} of {n} pairs' twins met one replica"]
    if split and len(lost) < len(split):
        said.append(f"{len(split) - len(lost)} met another and still reused their prefix (a cache shared across "
                    "replicas)")
    if lost:
        said.append(f"{len(lost)} met another and reused nothing ({_share(len(lost), loss.n)} of the pairs told, "
                    f"within the {MAX_SPLIT_LOSS_SHARE:.0%} a rebalancing router may lose)")
    said += [f"{len(unknown)} could not be told (each reused its prefix)"] if unknown else []
    return RuleResult("cache.routing", PILLAR, PASS, f"{', '.join(said)} over {len(routing.sources)} "
                      f"replicas (per-source {read}; {got})", len(split),
                      n, evidence=evidence, interval=interval)


def _answers_rule(pairs: list[tuple[AnyAttempt, AnyAttempt]]) -> RuleResult:
    broke = [w for c, w in pairs if c.valid and not w.valid]
    mended = [w for c, w in pairs if not c.valid and w.valid]
    p = mcnemar_one_sided(len(broke), len(mended))
    checks = sorted({f.check for w in broke for f in w.findings if not f.ok})
    evidence = ("records.jsonl control pairs (valid, findings)",)
    text = (f"warm twins broke in {len(broke)} pairs and mended in {len(mended)} of {len(pairs)} "
            f"(exact McNemar p={p:.3f})")
    if p < ALPHA:
        return RuleResult("cache.answers", PILLAR, FAIL, f"a hit that breaks the answers: {text}; "
                          f"broken checks {checks}", len(broke), len(mended), evidence=evidence)
    return RuleResult("cache.answers", PILLAR, PASS, f"answers intact: {text}", len(broke), len(mended),
                      evidence=evidence)


def through_blocks(rule: RuleResult) -> RuleResult:
    """`cache.latency` measured on streams a proxy buffered (analysis/pillars/headroom/buffering.py): the first read
    waits for a block to fill, which adds the same wait to both twins and only hides the cache's gain. A ratio
    that passes even so stands, said; one that fails is the proxy's as much as the cache's: inconclusive; one
    that could not tell says the blocks may be why (a verdict matrix row behind nginx's default proxy read a
    ratio median 0.68, CI 0.57-0.91 over 8 pairs, without naming them)."""
    if rule.status == FAIL:
        return replace(rule, status=INCONCLUSIVE, reason="inconclusive, because the stream is buffered by a proxy "
                       "(gateway: resources' stream_delivery): the client's first tokens came with the proxy's "
                       "blocks, which hide the cache's gain; " + rule.reason)
    if rule.status == PASS:
        return replace(rule, reason=rule.reason + " (through a proxy's blocks, which only hide a gain: the effect "
                       "shows even so)")
    if rule.status == INCONCLUSIVE:
        return replace(rule, reason=rule.reason + " (through a proxy's blocks, which hide the cache's gain: they may "
                       "be why the effect did not show; gateway: resources' stream_delivery)")
    return rule


def judge_prefix_cache(data: RunData, index: MetricIndex, limits: dict[str, float], buffered: bool = False
                       ) -> PillarResult:
    """`buffered`: the streams came through a proxy's blocks (analysis/pillars/headroom/buffering.py), so the latency
    rule's first-token times are the proxy's (`through_blocks`)."""
    pairs = [(c, w) for c, w in control_pairs(data) if c.status == "ok" and w.status == "ok"]
    if not pairs:
        rows = data.columns.rows()
        roles = rows[rows.code_where("control_role", bool)]  # any role (a truthy one)
        if len(roles):
            failed = sorted({a.primary_layer or a.status for a in data.pick(roles) if a.status != "ok"})
            return PillarResult(INCONCLUSIVE, ["inconclusive, because no cold/warm control pair completed (every "
                                               f"pair had a failed request: {', '.join(failed)})"])
        return PillarResult(NOT_RUN, ["no cold/warm control pair was sent (the plan has no prefix_control stage, "
                                      "or it ran no pair)"])
    t0, t1 = pairs[0][0].send_ts, pairs[-1][1].end_ts
    window, gaps = _window(index, t0, t1)
    config = cache_config(data)
    # Each pair's fresh salt makes its bytes a distinct request (its warm twin repeats them on purpose): the
    # pair is the unit of every test here, and the count of distinct cold requests says so.
    distinct = len({attempt_key(c) for c, _ in pairs})
    numbers: dict[str, Any] = {"control": _table(pairs), "pairs": len(pairs), "distinct_requests": distinct,
                               "window": window,
                               "window_gaps": gaps,
                               "cache_config": {k: config.get(k) for k in (
                                   "block_size", "enable_prefix_caching", "mamba_block_size",
                                   "cache_hit_alignment_tokens", "num_gpu_blocks") if k in config}}
    metrics_seen = index.present(t0 - 60, t1 + 60) and any(
        VllmMetric.PREFIX_CACHE_QUERIES_TOTAL in s.series for s in index.scrapes if t0 - 60 <= s.ts <= t1 + 60)
    if config.get("enable_prefix_caching") == "False":
        return PillarResult(FAIL, ["prefix caching is off on the server (vllm:cache_config_info "
                                   "enable_prefix_caching=False)"], numbers)
    routing = route_pairs(data, index, pairs)
    if routing is not None:
        numbers["routing"] = routing.to_dict() | {"layer": GATEWAY, "reuse": reuse_by_meeting(pairs, routing)}
        numbers["replicas"] = per_replica(data, index, routing)
    reasons = _inconclusive(pairs, config, window, gaps, limits, metrics_seen)
    if reasons:
        return PillarResult(INCONCLUSIVE, [f"inconclusive, because {r}" for r in reasons], numbers)
    judged, scope = _judged(pairs, routing)
    latency = _latency_rule(judged, limits, scope)
    rules = [_hits_rule(pairs, window, config, limits, judged, scope),
             through_blocks(latency) if buffered else latency, _answers_rule(pairs)]
    if routing is not None:
        rules.insert(0, _routing_rule(pairs, routing))
    numbers["rules"] = [r.to_dict() for r in rules]
    failed = [r.reason for r in rules if r.status == FAIL]
    if failed:
        return PillarResult(FAIL, failed, numbers)
    open_rules = [r.reason for r in rules if r.status == INCONCLUSIVE]
    if open_rules:
        return PillarResult(INCONCLUSIVE, open_rules, numbers)
    return PillarResult(PASS, [f"{len(pairs)} cold/warm pairs: " + "; ".join(r.reason for r in rules)
                               + f" (pairs of {distinct} distinct requests)"], numbers)
