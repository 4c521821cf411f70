"""Designed vs achieved prefix reuse, per family and for the run: numbers for pillar 3.

Why: a cache that "hits" proves little unless the hits are the ones the samples were built to get.
`reuse_design.json` (k3load.workload.reuse_design, measured at run start with the server's tokenizer) holds each
request variant's prompt length and the token prefix it shares with every other. Replayed over the
run's send order it gives each request's designed reuse: the longest prefix it shares with a request
whose prefill had finished (its first token arrived) before it was sent, capped at its prompt minus
one token and floored to whole cache blocks (and to the hybrid state-checkpoint grid, when the server
has one): what a perfect prefix cache without eviction must reuse. Achieved reuse is what the server
reports: each response's `usage.prompt_tokens_details.cached_tokens` per family (the /metrics
counters cannot be split by family on a mixed stage), and the /metrics hit/query delta for the run.

Salts decide which variants two requests are: every request of an unsalted or run-salted scenario
carries the same salt (variant A against A); a `request`-salted request shares its salt only with its
retries and its streaming-drill twin, a `pair` only with its twin; other pairs of requests compare
variant A against variant B. A server still warm from an earlier run may reuse more than designed for
unsalted scenarios (their prefixes do not change between runs).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3load.analysis.pillars.cache.reuse_replay import DEFAULT_BLOCK, Geometry, designed_tokens
from k3load.analysis.pillars.pillar import PillarResult
from k3load.analysis.run.clusters import cluster_codes, rate_by_codes
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.rundata import RunData
from k3load.analysis.run.stats import ratio_cis
from k3load.analysis.run.timeline import MetricIndex
from k3load.outcomes import FAIL, INCONCLUSIVE, NOT_RUN, PASS, SERVER
from k3load.sampler.vllm_metrics import VllmMetric

REACHED = 0.9  # an attempt "reached its design" when it reused at least this share of it
METRICS_SLACK_S = 2.5  # let the scrape after the last request land
# The reuse intervals resample windows of the run, not attempts: attempts sent close together met the same
# cache (what was resident, evicted, in flight), so one window's attempts are one draw of the server's state.
REUSE_WINDOW_S = 10.0
MIN_WINDOWS = 20  # a run shorter than MIN_WINDOWS windows of REUSE_WINDOW_S is cut into this many, narrower


@dataclass
class _Tokens:
    """A family's attempts with a design (`rows`) and, of those with usage, the token columns in attempt
    order: int64 arrays when every value is a whole number in range (what servers report), else object
    arrays, whose sums and comparisons are Python's own (a hand-made record's 12.5 tokens stay 12.5)."""

    rows: int
    prompt: np.ndarray
    designed: np.ndarray
    achieved: np.ndarray
    windows: np.ndarray  # each attempt's REUSE_WINDOW_S window of the run (int64), for the intervals
    kept: Rows  # the attempts with usage, whose distinct requests (analysis/run/clusters.py) the rates count


def _column(values: list[Any]) -> np.ndarray:
    column = np.array(values)
    return column if column.dtype.kind == "i" else np.array(values, dtype=object)


def _total(column: np.ndarray) -> Any:
    return int(column.sum()) if column.dtype.kind == "i" else sum(column.tolist())


def _as_recorded(rows: Rows, name: str) -> list[Any]:
    """A NUMBER field's values as recorded (an integer where a record held one), a zero as the integer 0 (what
    `value or 0` made of it); the rows' values are all known."""
    values = rows.recorded(name)
    listed = values.tolist() if isinstance(values, np.ndarray) else values
    return [v or 0 for v in listed]


def family_tokens(rows: Rows, names: list[str], design: list[Any]) -> list[_Tokens]:
    """The token columns of each named family's attempts, then of all of them; `design`: each row's designed
    tokens (None: none). The columns are picked once; each family's are then selected by mask, in row order
    (at an hour's soak a pass per family and column cost 0.4 s)."""
    prompt_tokens, cached_tokens = rows.number("prompt_tokens"), rows.number("cached_tokens")
    with_design = np.array([d is not None for d in design], dtype=bool)
    counted = with_design & ~np.isnan(prompt_tokens) & (prompt_tokens != 0)  # a design and a prompt
    used = counted & ~np.isnan(cached_tokens)
    kept_at = np.flatnonzero(used)
    kept = rows[used]
    prompt = _column(_as_recorded(kept, "prompt_tokens"))
    designed = _column([design[i] for i in kept_at.tolist()])
    achieved = _column(_as_recorded(kept, "cached_tokens"))
    sent = kept.number("send_ts")
    start, span = (float(sent.min()), float(sent.max() - sent.min())) if len(sent) else (0.0, 0.0)
    width = max(min(REUSE_WINDOW_S, span / MIN_WINDOWS), 1e-9)
    windows = np.floor((sent - start) / width).astype(np.int64)
    codes = {name: code for code, name in enumerate(names)}
    table = rows.table("family")
    # a table's values are hashable (an unhashable field is kept as its text: record_columns.Codes)
    family = np.array([codes.get(v, -1) for v in table], dtype=np.int64)[rows.ints("family")] \
        if len(rows) else np.zeros(0, dtype=np.int64)
    row_family, kept_family = family[counted], family[kept_at]
    out = []
    for code in range(len(names)):
        mine = kept_family == code
        out.append(_Tokens(int(np.count_nonzero(row_family == code)), prompt[mine], designed[mine], achieved[mine],
                           windows[mine], kept[mine]))
    return [*out, _Tokens(int(counted.sum()), prompt, designed, achieved, windows, kept)]


def by_window(tokens: _Tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The achieved, prompt and designed tokens summed per window (the bootstrap's unit: attempts of one
    window met the same cache, so they are resampled together), windows in time order."""
    if not len(tokens.windows):
        return np.zeros(0), np.zeros(0), np.zeros(0)
    _, codes = np.unique(tokens.windows, return_inverse=True)
    return tuple(np.bincount(codes, weights=np.asarray(c, dtype=float))  # type: ignore[return-value]
                 for c in (tokens.achieved, tokens.prompt, tokens.designed))


def family_rows(rows: Rows, names: list[str], design: list[Any]) -> list[dict[str, Any]]:
    """The figures of each named family, then of all the attempts. Their bootstrap intervals are drawn in
    threads, the largest first: numpy draws and sums with the GIL released. Each interval has its own
    seeded generator, so the threads change no number."""
    parts = family_tokens(rows, names, design)
    windows = [by_window(part) for part in parts]
    order = sorted(range(len(parts)), key=lambda i: -len(windows[i][0]))
    with ThreadPoolExecutor(max_workers=max(1, min(len(parts), os.cpu_count() or 1))) as pool:
        # ratio_cis reads arrays as they are (analysis/run/stats.py's hint says Sequence[int])
        drawn = dict(zip(order, pool.map(lambda i: ratio_cis(windows[i][0], [windows[i][1], windows[i][2]]),  # type: ignore[arg-type,list-item]
                                         order), strict=True))
    return [_row(part, drawn[i][0], drawn[i][1], len(windows[i][0])) for i, part in enumerate(parts)]


def _row(tokens: _Tokens, share_ci: tuple[float, float] | None, design_ci: tuple[float, float] | None,
         windows: int = 0) -> dict[str, Any]:
    prompt, designed, achieved = _total(tokens.prompt), _total(tokens.designed), _total(tokens.achieved)
    with_design = np.asarray(tokens.designed > 0, dtype=bool)
    hit = np.asarray(tokens.achieved >= REACHED * tokens.designed, dtype=bool)[with_design]
    reached = rate_by_codes(cluster_codes(tokens.kept[with_design]), hit)
    clusters = cluster_codes(tokens.kept)
    out: dict[str, Any] = {
        "attempts": tokens.rows, "attempts_with_usage": len(tokens.achieved),
        "distinct_requests": int(clusters.max()) + 1 if len(clusters) else 0, "windows": windows,
        "attempts_with_design": int(np.count_nonzero(with_design)),
        "prompt_tokens": prompt, "designed_tokens": designed, "achieved_tokens": achieved,
        "designed_share": designed / prompt if prompt else None,
        "achieved_share": achieved / prompt if prompt else None,
        "achieved_share_ci95": _list(share_ci),
        "achieved_of_design": achieved / designed if designed else None,
        "achieved_of_design_ci95": _list(design_ci) if designed else None,
        "reached_design": reached.to_dict()}
    return out


def _list(pair: tuple[float, float] | None) -> list[float] | None:
    return list(pair) if pair else None


def scenario_design(design: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per scenario, what its samples share by design: across requests (turn 0 against another request's
    turn 1, or the same turn under another salt) and along a conversation (turn n+1 against turn n)."""
    index = {key: i for i, key in enumerate(design.get("variants") or [])}
    matrix, lengths = design.get("shared_prefix_tokens") or [], design.get("prompt_tokens") or []
    out = {}
    for name, info in sorted((design.get("scenarios") or {}).items()):
        a0 = index.get(f"{name}/0/A")
        if a0 is None:
            continue
        other = index.get(f"{name}/0/B", index.get(f"{name}/1/A", a0))
        chain = [matrix[index[f"{name}/{t + 1}/A"]][index[f"{name}/{t}/A"]] for t in range(info.get("turns", 0) - 1)
                 if f"{name}/{t + 1}/A" in index] if info.get("mode") == "conversation" else []
        out[name] = {"family": info.get("family"), "prefix_salt": info.get("prefix_salt"),
                     "prompt_tokens_turn_0": lengths[a0], "shared_across_requests_tokens": matrix[a0][other],
                     "shared_along_chain_tokens": chain,
                     **{k: info[k] for k in ("salt_at_token", "tools_tokens", "tools_before_salt") if k in info}}
    return out


# -- judging -----------------------------------------------------------------------------------------

COLD_SHARE = 0.05  # a family designed to reuse at most this share of its prompt is cold
NOT_COLD_MARGIN = 0.10  # achieved share (95% lower bound) this far above the design: not cold
MIN_WITH_DESIGN = 10  # requests with a designed reuse before a shortfall can fail


@dataclass
class Finding:
    """One reuse finding: `layer` says whose it is (harness: the samples' design; server: the cache);
    `fails` only for a server finding with enough evidence."""

    family: str
    status: str  # pass | fail | inconclusive | finding
    layer: str | None
    reason: str
    fails: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "status": self.status, "layer": self.layer, "reason": self.reason}


def _cause(scenarios: dict[str, dict[str, Any]], family: str) -> str:
    """Why a cold family's requests share a prefix by design, from the design measurement."""
    for name, s in scenarios.items():
        if s.get("family") != family:
            continue
        if s.get("prefix_salt") not in ("request", "pair"):
            return f"{name} is not salted per request (prefix_salt: {s.get('prefix_salt')})"
        shared = s.get("salt_at_token") or 0
        if s.get("tools_before_salt"):
            return (f"salt after the tools in {name}: the first {shared:,} tokens (the tool declarations, which the "
                    "chat template renders before the system prompt) are identical across users")
        return f"the salt of {name} sits at token {shared:,}: the tokens before it are identical across requests"
    return "the family's samples share a prefix"


def judge_family(family: str, row: dict[str, Any], scenarios: dict[str, dict[str, Any]], limits: dict[str, float],
                 thin: list[str]) -> Finding:
    """Cold families must stay cold, shared ones must reach their design (see the module doc)."""
    designed, achieved = row["designed_share"], row["achieved_share"]
    if designed is None or not row["attempts_with_usage"]:
        return Finding(family, INCONCLUSIVE, None, f"inconclusive, because no {family} response carried "
                       "usage.prompt_tokens_details.cached_tokens (is --enable-prompt-tokens-details set?)")
    share_ci = row["achieved_share_ci95"] or [achieved, achieved]
    if family == "cold" and designed > COLD_SHARE:
        return Finding(family, "finding", "harness", f"cold family is not cold by design (the samples' design, the "
                       f"harness's finding, not the server's; pillar status unchanged): {designed:.0%} of its prompt "
                       f"tokens reusable by design, {achieved:.0%} reused; cause: {_cause(scenarios, family)}")
    if designed <= COLD_SHARE:
        if share_ci[0] > designed + NOT_COLD_MARGIN:
            return Finding(family, "finding", SERVER, f"{family} family is not cold on the server: it reused "
                           f"{achieved:.0%} of its prompt (95% CI {share_ci[0]:.0%}-{share_ci[1]:.0%}) although no "
                           f"earlier request of the run shared more than {designed:.0%} with it by the server's own "
                           "tokenizer: cached_tokens over-reported, or the chat path renders prompts differently "
                           "from /tokenize (pillar status unchanged)")
        return Finding(family, PASS, None, f"{family}: {achieved:.0%} reused, {designed:.0%} by design")
    ratio, ci = row["achieved_of_design"], row["achieved_of_design_ci95"] or [row["achieved_of_design"]] * 2
    bound = limits.get("min_reuse_of_design", 0.5)
    text = (f"{family} family reused {ratio:.0%} of its designed reuse (95% CI {ci[0]:.0%}-{ci[1]:.0%}; "
            f"{row['achieved_tokens']:,} of {row['designed_tokens']:,} tokens over {row['attempts_with_usage']} "
            f"requests; at least {bound:.0%} expected)")
    if ci[0] >= bound:
        return Finding(family, PASS, None, text)
    if row["attempts_with_design"] < MIN_WITH_DESIGN:
        return Finding(family, INCONCLUSIVE, None, f"inconclusive, because only {row['attempts_with_design']} "
                       f"{family} requests could reuse a prefix by design (at least {MIN_WITH_DESIGN} needed): {text}")
    if ci[1] < bound and not thin:
        return Finding(family, FAIL, SERVER, f"the prefix cache missed what the samples share: {text}", fails=True)
    if ci[1] < bound:
        return Finding(family, INCONCLUSIVE, SERVER, f"inconclusive, because {'; '.join(thin)}: {text}")
    return Finding(family, INCONCLUSIVE, None, f"inconclusive, because the interval straddles the bound: {text}")


def geometry_of(config: dict[str, str]) -> Geometry:
    """Block size and hybrid checkpoint grid from vllm:cache_config_info (as the cache pillar reads it)."""
    def number(key: str) -> int | None:
        try:
            value = config.get(key)
            return int(value) if value not in (None, "", "None") else None
        except ValueError:
            return None

    block = number("block_size")
    align = max(filter(None, [number("cache_hit_alignment_tokens"), number("mamba_block_size")]), default=None)
    return Geometry(block or DEFAULT_BLOCK, align, block is not None)


def _thin(index: MetricIndex, limits: dict[str, float], config: dict[str, str], t0: float, t1: float,
          rows: Rows) -> list[str]:
    """Why a shortfall may say nothing about the cache: eviction under capacity, an unknown geometry."""
    why = []
    kv = index.gauge(VllmMetric.KV_CACHE_USAGE, t0, t1)
    if kv and kv["max"] >= limits.get("max_kv_usage", 0.98):
        why.append(f"the KV cache was saturated (usage up to {kv['max']:.0%}): prefixes may have been evicted")
    geometry = geometry_of(config)
    blocks = config.get("num_gpu_blocks")
    running = index.gauge(VllmMetric.NUM_REQUESTS_RUNNING, t0, t1)
    prompt = rows.number("prompt_tokens")
    prompted = rows[~np.isnan(prompt) & (prompt != 0)]
    if blocks and blocks.isdigit() and running and len(prompted):
        capacity = int(blocks) * geometry.block
        mean = prompted.total("prompt_tokens") / len(prompted)
        demand = (running["max"] + 1) * prompted.total("prompt_tokens") / len(prompted)
        if demand > capacity:
            why.append(f"the KV cache holds {capacity:,} tokens, less than the requests in flight need (up to "
                       f"{running['max']:.0f} running, {mean:,.0f} prompt tokens each): "
                       "prefixes are evicted between requests")
    if not geometry.block_known:
        why.append(f"the block size is unknown (vllm:cache_config_info not scraped; {DEFAULT_BLOCK} assumed)")
    return why


def _no_design(design: dict[str, Any] | None, run_id: Any, unreadable: str | None = None) -> str | None:
    """Why the run has no design this pillar can hold it to, or None. Another run's design (a web UI test's
    measurement that ended after the next test began in the same directory, or a file copied in) is none: the
    salts it was measured with carry that run's id, so every salted request's designed reuse would be wrong."""
    if design is None and unreadable:
        return f"reuse_design.json is {unreadable}"
    if design is None:
        return "reuse_design.json is missing (the run predates it, or ended before the measurement)"
    if design.get("error"):
        return f"the server's tokenizer was not reachable ({design['error']})"
    measured_for = design.get("run_id")
    if measured_for is not None and run_id is not None and measured_for != run_id:
        return f"reuse_design.json was measured for run {str(measured_for)[:80]}, not this run ({run_id})"
    return None


def judge_reuse(data: RunData, index: MetricIndex, limits: dict[str, float], config: dict[str, str]
                ) -> tuple[dict[str, Any], list[Finding]]:
    """numbers.reuse of the prefix_cache pillar and the findings (see the module doc)."""
    design = data.reuse_design
    every = data.columns.rows()
    ok = every.code_is("status", "ok")
    if not ok.any():
        return {"status": NOT_RUN, "reason": "no request completed"}, []
    if why := _no_design(design, (data.run or {}).get("run_id"), data.unreadable.get("reuse_design.json")):
        return {"status": INCONCLUSIVE, "reason": f"inconclusive, because {why}"}, \
            [Finding("*", INCONCLUSIVE, None, f"inconclusive, because {why}")]
    assert design is not None
    geometry = geometry_of(config)
    # The streaming drill's twins are the same bytes sent at the same instant: which of them reuses the
    # other's blocks (or neither, prefilled in one step) is the scheduler's draw, so they have no design
    # to be held to. Left out of the rows (a real server gave one cold twin 1,408 cached tokens of 1,436),
    # they still count as prefixes later requests may reuse.
    paired = every.code_where("stream_pair", bool)
    twins = int(np.count_nonzero(ok & paired))
    chosen = ok & ~paired
    attempts = every[chosen]
    designed = designed_tokens(every, design, geometry)
    sent, ended = attempts.number("send_ts"), attempts.number("end_ts")
    t0 = data.stages[0].start_ts if data.stages else (float(sent.min()) if len(sent) else 0.0)
    t1 = data.stages[-1].end_ts if data.stages else (float(ended.max()) if len(ended) else 0.0)
    thin = _thin(index, limits, config, t0, t1, attempts)
    scenarios = scenario_design(design)
    families: dict[str, dict[str, Any]] = {}
    findings = []
    names = sorted(attempts.seen("family"))
    *rows, total = family_rows(attempts, names, [designed[i] for i in np.flatnonzero(chosen).tolist()])
    for family, row in zip(names, rows, strict=True):
        if not row["attempts"]:
            continue
        finding = judge_family(family, row, scenarios, limits, thin)
        families[family] = row | {"finding": finding.to_dict()}
        findings.append(finding)
    m0 = min(t0, float(sent.min())) if len(sent) else t0  # the counters cover every request, in flight at the edges
    m1 = (max(t1, float(ended.max())) if len(ended) else t1) + METRICS_SLACK_S
    hits = index.delta(VllmMetric.PREFIX_CACHE_HITS_TOTAL, m0, m1)
    queries = index.delta(VllmMetric.PREFIX_CACHE_QUERIES_TOTAL, m0, m1)
    answered = every[ok]  # what /metrics counted: the drill's twins too
    cached = answered[~np.isnan(answered.number("cached_tokens"))]
    total["metrics"] = {"prefix_cache_hits": hits, "prefix_cache_queries": queries,
                        "hit_share": hits / queries if hits is not None and queries else None,
                        "responses_cached_tokens": cached.total("cached_tokens", falsy_as_zero=True),
                        "responses": len(answered)}
    numbers = {"status": "measured", "block_size": geometry.block, "block_size_known": geometry.block_known,
               "checkpoint_tokens": geometry.align, "families": families, "run": total, "design": scenarios,
               "evidence_gaps": thin, "drill_twins_left_out": twins}
    return numbers, findings


def apply_reuse(pillar: PillarResult, data: RunData, index: MetricIndex, limits: dict[str, float],
                config: dict[str, str], judged: tuple[dict[str, Any], list[Finding]] | None = None) -> None:
    """Adds numbers.reuse to the prefix_cache pillar, its findings as reasons; a server finding with enough
    evidence fails the pillar (the samples' own design never does: that is the harness's to fix).
    `judged`: judge_reuse's result when already computed (analyze judges it after the other pillars)."""
    numbers, findings = judged if judged is not None else judge_reuse(data, index, limits, config)
    pillar.numbers["reuse"] = numbers
    if config.get("enable_prefix_caching") == "False":
        return  # the cache is off and the pillar says so: what it did not reuse adds nothing to that
    # A family too thin to judge says so in numbers.reuse and the report's table; only the measurement as a
    # whole being impossible (family "*") joins the pillar's reasons, beside the findings.
    said = [f for f in findings if f.status in (FAIL, "finding") or (f.status == INCONCLUSIVE and f.family == "*")]
    pillar.reasons += [f"reuse: {f.reason}" for f in said]
    if any(f.fails for f in findings) and pillar.status != FAIL:
        pillar.status = FAIL
        pillar.reasons = [f"reuse: {f.reason}" for f in findings if f.fails] + \
            [r for r in pillar.reasons if not any(r == f"reuse: {f.reason}" for f in findings if f.fails)]
