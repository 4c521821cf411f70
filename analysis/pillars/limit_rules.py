"""Every rule a stage is judged by, declared once: its id, the signal a breach is evidence of, what ran out when it
breaks, and for a simple limit its figure, threshold and reason.

Why one table: a limit rule used to be written in five places (the check, the defaults, the plan schema, the
ramp's "what ran out first", the docs); from these rows the defaults and the schema's `thresholds`
(analysis/pillars/thresholds_table.py), the ramp's `ran_out_first` (analysis/decision/ramp.py) and the rules
table in docs/verdict-rules.md (analysis/pillars/rule_docs.py, drift-tested) are derived. Adding a simple limit
is one `RuleId` member and one `LimitRule` row (and its test); a rule whose check is code (errors with their
interval, GPU memory, the offered load, the server's downs) is one `RuleId` member and one `StageRule` row, its
check in analysis/pillars/headroom/stages.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from k3load.analysis.pillars.threshold import Bound, Threshold
from k3load.outcomes import Signal


class RuleId(StrEnum):
    """The id of a rule a stage is judged by (a breach's `id` in verdict.json). Declared in the order "what ran
    out first" is read (analysis/decision/ramp.py, capacity.py): of a step's breaches, the first here names it;
    their `RanOut` follow the same order."""

    KV_USAGE = "resources.kv_usage"
    PREEMPTIONS = "resources.preemptions"
    WAITING_SUSTAINED = "resources.waiting_sustained"
    FULL_BATCH_QUEUE = "resources.full_batch_queue"
    OFFERED_LATE = "load.offered_late"
    OFFERED_SHORT = "load.offered_short"
    GPU_GROWTH = "resources.gpu_growth"
    GPU_JUMP = "resources.gpu_jump"
    GPU_HEADROOM = "resources.gpu_headroom"
    SERVER_DOWN = "stability.server_down"
    SLO_ERROR_RATE = "slo.error_rate"
    HEALTH_FLAP = "stability.health_flap"
    SLO_TTFT_P95 = "slo.ttft_p95"
    SLO_TTFA_P95 = "slo.ttfa_p95"
    SLO_ITL_P95 = "slo.itl_p95"
    SLO_E2E_P95 = "slo.e2e_p95"


class RanOut(StrEnum):
    """What a breach says ran out, in the order "what ran out first" is read: a step that breached KV and latency
    ran out of KV (the latency followed from it)."""

    KV_CACHE = "KV cache"
    SCHEDULER_QUEUE = "scheduler queue"
    SESSION_SLOTS = "session slots (the offered rate)"
    GPU_MEMORY = "GPU memory"
    SERVER_STABILITY = "server stability"
    ERROR_RATE = "error rate"
    HEALTH_CHECK = "health check"
    LATENCY_SLO = "latency SLO"


@dataclass(frozen=True)
class StageRule:
    """A rule whose check is code (analysis/pillars/headroom/stages.py): what the docs and the ramp need of it.
    `evidence` and `breaks` are the docs' columns (what it reads; when it breaches); `threshold`: the plan's key
    it reads, if any."""

    id: RuleId
    signal: Signal
    ran_out: RanOut
    evidence: str
    breaks: str
    threshold: str | None = None


@dataclass(frozen=True)
class LimitRule:
    """A simple limit: the stage's figure `stats_key` above `threshold` breaches it; `reason` is the breach's text
    (`{v}` the figure, `{lim}` the limit). A latency limit's signal becomes `queue_latency` where requests queued
    in the same stage (stages.QUEUED_S)."""

    stats_key: str
    threshold: Threshold
    id: RuleId
    signal: Signal
    ran_out: RanOut
    reason: str
    evidence: str
    breaks: str

    @property
    def section(self) -> str:
        return self.threshold.section

    @property
    def key(self) -> str:
        return self.threshold.key


_RECORDS = "records (client-side timings)"

# In the order a stage is checked (the order of its breaches in verdict.json).
LIMIT_RULES: tuple[LimitRule, ...] = (
    LimitRule("ttft_p95_ms", Threshold("slo", "ttft_p95_ms", 3000.0, Bound.POSITIVE, "ms"), RuleId.SLO_TTFT_P95,
              Signal.LATENCY, RanOut.LATENCY_SLO, "TTFT p95 {v:.0f} ms > {lim:.0f} ms", _RECORDS,
              "p95 above the SLO"),
    LimitRule("ttfa_p95_ms", Threshold(
        "slo", "ttfa_p95_ms", 30000.0, Bound.POSITIVE, "ms",
        "Time to the first answer token (content or a tool-call part, after any reasoning), p95 per stage, ms; "
        "streamed answers only (default 30000)."), RuleId.SLO_TTFA_P95, Signal.LATENCY, RanOut.LATENCY_SLO,
        "TTFA p95 {v:.0f} ms > {lim:.0f} ms (first answer token, after the reasoning)", "records (`ttfa_ms`)",
        "the stage's p95 time to the first answer token (the first content or tool-call token, after any "
        "reasoning: what a user of a thinking model waits for, which TTFT hides) above the SLO; a stage with no "
        "`ttfa_ms` (answers not streamed, none answered, records older than the field) is unknown, never a breach"),
    LimitRule("itl_p95_ms", Threshold("slo", "itl_p95_ms", 250.0, Bound.POSITIVE, "ms"), RuleId.SLO_ITL_P95,
              Signal.LATENCY, RanOut.LATENCY_SLO, "ITL p95 {v:.0f} ms > {lim:.0f} ms", _RECORDS, "p95 above the SLO"),
    LimitRule("e2e_p95_ms", Threshold("slo", "e2e_p95_ms", 60000.0, Bound.POSITIVE, "ms"), RuleId.SLO_E2E_P95,
              Signal.LATENCY, RanOut.LATENCY_SLO, "e2e p95 {v:.0f} ms > {lim:.0f} ms", _RECORDS, "p95 above the SLO"),
    LimitRule("waiting_sustained_s", Threshold("resources", "max_waiting_sustained_s", 10.0, Bound.NON_NEGATIVE, "s",
                                               "Longest stretch with requests waiting."),
              RuleId.WAITING_SUSTAINED, Signal.RESOURCE, RanOut.SCHEDULER_QUEUE,
              "requests waited for {v:.0f} s on end > {lim:.0f} s", "`vllm:num_requests_waiting`, worst source",
              "longest stretch above zero over the limit"),
    LimitRule("preemptions_per_min", Threshold("resources", "max_preemptions_per_min", 5.0, Bound.NON_NEGATIVE,
                                               "per min"),
              RuleId.PREEMPTIONS, Signal.RESOURCE, RanOut.KV_CACHE, "{v:.1f} preemptions/min > {lim:.1f}",
              "`vllm:num_preemptions_total` deltas, summed over sources", "per minute over the limit"),
    LimitRule("kv_usage_max", Threshold("resources", "max_kv_usage", 0.98, Bound.SHARE, "share"),
              RuleId.KV_USAGE, Signal.RESOURCE, RanOut.KV_CACHE, "KV cache usage reached {v:.0%} > {lim:.0%}",
              "`vllm:kv_cache_usage_perc`, worst source", "max above the limit"),
)

# The rules whose check is code, in the order a stage is checked after the limits.
STAGE_RULES: tuple[StageRule, ...] = (
    StageRule(RuleId.SLO_ERROR_RATE, Signal.ERRORS, RanOut.ERROR_RATE, "records of the stage",
              "load errors (5xx, 408, 429, timeouts, cut streams, resets; a 4xx refusal is the request's fault, not "
              "load's): the Wilson lower bound above the limit; the reason names the errors by primary layer and kind",
              "slo.max_error_rate"),
    StageRule(RuleId.GPU_GROWTH, Signal.RESOURCE, RanOut.GPU_MEMORY, "`gpu.jsonl`",
              "a GPU's use over its start-up baseline, as a share of what was free then, above the limit; the reason "
              "names the GPU and the MiB", "resources.max_gpu_growth_pct"),
    StageRule(RuleId.GPU_HEADROOM, Signal.RESOURCE, RanOut.GPU_MEMORY, "`gpu.jsonl`",
              "free memory below the limit's share of the card, only where the load took it there: a card already "
              "under the floor after start-up is vLLM's reservation, said with the pass, never judged",
              "resources.min_gpu_headroom_pct"),
    StageRule(RuleId.GPU_JUMP, Signal.RESOURCE, RanOut.GPU_MEMORY, "`gpu.jsonl`",
              "the least free memory in the stage is less than the largest jump seen so far (the largest rise "
              "between two successive readings of one GPU): another as large would not fit"),
    StageRule(RuleId.FULL_BATCH_QUEUE, Signal.RESOURCE, RanOut.SCHEDULER_QUEUE,
              "`vllm:num_requests_waiting` and `vllm:num_requests_running` in the same scrape, worst source; "
              "concurrency and search steps only (`analysis/pillars/headroom/full_batch.py`)",
              "requests waited while the engine ran at its cap in more than half of the step's scrapes (at least 3): "
              "the server queued the step's load, however short the step. The cap is `max_num_seqs` from the "
              "start-up log's non-default args; without it, the most the engine ran at once in the step where that "
              "stayed below the step's users; with neither, nothing is marked (`past_capacity` null)"),
    StageRule(RuleId.OFFERED_SHORT, Signal.RESOURCE, RanOut.SESSION_SLOTS,
              "records' first turns of each session against the step's `sessions_per_s` times its seconds; "
              "open-loop search steps only",
              "fewer sessions started than the rate offered by more than two Poisson standard deviations (at least 5 "
              "offered): every slot was busy and the schedule's tickets waited untaken (a single slot at 8 "
              "sessions/s was held before this rule, seen on the sim); the live search holds its steps to the same, "
              "counting a step's sessions from its schedule (tickets taken whose time had come) where its process runs "
              "the users, so a session whose first answer is still on its way at the decision counts, as its record "
              "later shows (`sessions_arrived`: the step's first turns, whenever they ended); a master with workers "
              "counts the first answers recorded so far"),
    StageRule(RuleId.OFFERED_LATE, Signal.RESOURCE, RanOut.SESSION_SLOTS,
              "records' `intended_send_ts` against `send_ts` (`analysis/pillars/headroom/arrival_lag.py`); "
              "open-loop search steps and replay stages only",
              "more than 10% of the step's scheduled turns (at least 10) went out over 1 s late: every session slot "
              "was busy, the step did not offer its rate (the live search holds its steps to the same); a replay "
              "stage's trace rows likewise (the load generator fell behind the trace)"),
    StageRule(RuleId.SERVER_DOWN, Signal.STABILITY, RanOut.SERVER_STABILITY, "`events.jsonl` `server_down`",
              "the server went away (not a flap)"),
    StageRule(RuleId.HEALTH_FLAP, Signal.HEALTH_FLAP, RanOut.HEALTH_CHECK, "`events.jsonl` and records",
              "`/health` said down while requests were answered in full, none was cut and no OOM line came: a "
              "flapping health check, not a crash"),
)

RULES: tuple[LimitRule | StageRule, ...] = (*LIMIT_RULES, *STAGE_RULES)
RULE: dict[RuleId, LimitRule | StageRule] = {rule.id: rule for rule in RULES}


# (rule id, what ran out) in the order "what ran out first" is read, as plain strings (they go into verdict.json
# and capacity.json as they are).
EXHAUSTED_BY_RULE: tuple[tuple[str, str], ...] = tuple((str(rule_id), str(RULE[rule_id].ran_out)) for rule_id in RuleId)


def ran_out_first(rule_ids: set[str]) -> str:
    """What ran out, read from a step's breaches by rule id (never by a reason's wording): the first rule, in
    `RuleId`'s order, that one of them is; "unknown" for none (or an id declared nowhere)."""
    return next((name for rule_id, name in EXHAUSTED_BY_RULE if rule_id in rule_ids), "unknown")
