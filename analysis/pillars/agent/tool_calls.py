"""Kimi's known tool-calling failures, judged over a run: streaming equivalence, tool-call cadence,
parallel calls and answers that never left the reasoning.

Why apart from the valid rate: each of these breaks in a specific, recurring way under load (vllm#54701,
#50604, #53246, #24478), and an operator needs the diagnosis, not only a lower rate: "the streaming
parser loses calls above 8 concurrent streams" says what to change; "94% valid" does not. Every rule
reads the findings the runner wrote (k3load/workload/validate.py, k3load/workload/stream_equivalence.py) by check name
and outcome, never by their wording, and says what evidence it lacked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from k3load.analysis.pillars.pillar import percentiles
from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.clusters import cluster_codes, rate_by_codes
from k3load.analysis.run.lean import AnyAttempt, first_finding
from k3load.analysis.run.record_columns import Rows
from k3load.outcomes import FAIL, INCONCLUSIVE, PARSER, PASS, Pillar
from k3load.records import Finding
from k3load.workload.plan import Plan
from k3load.workload.stream_equivalence import BOTH_VALID, NOT_COMPARED, OUTCOMES
from k3load.workload.stream_equivalence import CHECK as EQUIVALENCE

PILLAR = Pillar.AGENT_API
STREAM_PATH_WRONG = OUTCOMES[-1]


def _finding(attempt: AnyAttempt, check: str) -> Any:
    return first_finding(attempt.findings, check)


def _failing(rows: Rows, check: str) -> np.ndarray:
    """Whether each row's first finding of `check` failed (each distinct list of findings read once)."""
    return rows.code_where("findings", lambda findings: (f := first_finding(findings, check)) is not None
                           and not f.ok)


def _by_findings(rows: Rows) -> Rows:
    """These rows grouped by their list of findings, the groups in order of first appearance, each in row order:
    the order `lean.by_findings` gave the rules, which a rate's interval follows (its clusters are summed in the
    order they first appear)."""
    groups, _ = pd.factorize(rows.ints("findings"), sort=False)
    return rows.take(np.argsort(groups, kind="stable"))


def _outcome(findings: Sequence[Finding]) -> str | None:
    found = first_finding(findings, EQUIVALENCE)
    if found is None:
        return None
    return found.detail if found.ok else STREAM_PATH_WRONG


def stream_equivalence(rows: Rows, limits: dict[str, float], plan: Plan | None
                       ) -> tuple[dict[str, Any], RuleResult | None]:
    """Per stage (a concurrency level) and in all: the pairs compared and how many times the streamed
    answer was wrong where its whole twin was right, with an interval. On the record columns: the drill's streamed
    twins, each one's outcome read from its findings (each distinct list once)."""
    streamed = rows[rows.code_is("stream_role", "stream")]
    drill = plan.stream_equivalence if plan else None
    if not len(streamed):
        numbers: dict[str, Any] = {"drill": drill, "pairs": 0}
        if not drill:
            return numbers, None  # not asked for: said once, in the report
        return numbers, RuleResult("agent.stream_equivalence", PILLAR, INCONCLUSIVE,
                                   "streaming equivalence inconclusive, because the drill compared no pair (no "
                                   "eligible turn was played)", evidence=("records.jsonl stream_role",))
    users = {s.name: s.users for s in plan.stages} if plan else {}
    outcome_of = [_outcome(findings) or NOT_COMPARED for findings in streamed.table("findings")]
    outcome = np.array([outcome_of[c] for c in streamed.ints("findings").tolist()], dtype=object)
    stages = streamed.values("stage")
    per_stage: dict[str, dict[str, Any]] = {}
    for stage, said in zip(stages, outcome.tolist(), strict=True):
        row = per_stage.setdefault(stage, {"users": users.get(stage), **dict.fromkeys(OUTCOMES, 0)})
        row[said] += 1
    compared_rows = outcome != NOT_COMPARED
    wrong = outcome == STREAM_PATH_WRONG
    for name, row in per_stage.items():
        compared = sum(row[o] for o in OUTCOMES if o != NOT_COMPARED)
        row["compared"] = compared
        mine = compared_rows & np.array([stage == name for stage in stages], dtype=bool)  # as the dict keyed them
        row["stream_path_failure_rate"] = rate_by_codes(cluster_codes(streamed[mine]), wrong[mine]).to_dict()
    totals = Counter({o: sum(r[o] for r in per_stage.values()) for o in OUTCOMES})
    compared = sum(totals[o] for o in OUTCOMES if o != NOT_COMPARED)
    judged = streamed[compared_rows]  # the interval: over distinct requests
    rate = rate_by_codes(cluster_codes(judged), wrong[compared_rows])
    numbers = {"drill": drill, "pairs": len(streamed), "compared": compared, "outcomes": dict(totals),
               "stream_path_failure_rate": rate.to_dict(), "by_stage": per_stage}
    evidence = ("records.jsonl stream_pair/stream_role, findings stream.equivalence",)
    if rate.k:
        levels = "; ".join(f"{name} ({row['users']} users) {row[STREAM_PATH_WRONG]} of {row['compared']}"
                           for name, row in per_stage.items() if row["compared"])
        text = (f"parser (streaming path): {rate.k} of {compared} streamed answers were wrong where the "
                f"non-streamed answer to the same request was right ({rate.text()}; by stage: {levels}); the "
                "streaming tool/reasoning parser loses or changes what the whole-body path gets right (vllm#54701)")
        return numbers, RuleResult("agent.stream_equivalence", PILLAR, FAIL, text, rate.value, 0.0, None, evidence,
                                   (rate.low, rate.high))
    need = int(limits["min_stream_pairs"])
    if compared < need:
        return numbers, RuleResult("agent.stream_equivalence", PILLAR, INCONCLUSIVE,
                                   f"streaming equivalence inconclusive, because only {compared} streamed/whole "
                                   f"pairs were compared (at least {need} are needed)", compared, need, None, evidence)
    return numbers, RuleResult("agent.stream_equivalence", PILLAR, PASS,
                               f"streamed and non-streamed answers agreed where the non-streamed was right in all "
                               f"{compared} pairs of {rate.clusters} distinct requests ({totals[BOTH_VALID]} differed "
                               "with both valid)", rate.value, 0.0,
                               None, evidence, (rate.low, rate.high))


def _distribution(values: list[float] | np.ndarray) -> dict[str, float | int | None]:
    """n, p50, p95 and max of values as recorded (a float array, or a list keeping a recorded integer's type)."""
    p50, p95 = percentiles(values, (0.5, 0.95))
    if isinstance(values, np.ndarray):
        return {"n": len(values), "p50": p50, "p95": p95, "max": float(values.max()) if len(values) else None}
    return {"n": len(values), "p50": p50, "p95": p95, "max": max(values) if values else None}


def cadence(rows: Rows, pick: Callable[[Rows], list[AnyAttempt]], limits: dict[str, float]
            ) -> tuple[dict[str, Any], RuleResult | None]:
    """Streamed tool calls: the span from the first tool-call delta to the arguments' end, the longest
    silence inside the call, the deltas per call; silences past the plan's limit and stalls that our
    deadline cut (each a finding on its attempt) with their rate. On the record columns; the failures read whole."""
    gap = rows.number("tool_call_max_gap_ms")
    called = ~np.isnan(gap)
    calls = rows[called]
    limit = limits["max_tool_call_gap_ms"]
    over_mask, stalled = _failing(calls, "tool_call.cadence"), _failing(rows, "stream.stall")  # counted, maxed
    stall_rows = _by_findings(rows[stalled])
    over, stalls = pick(_by_findings(calls[over_mask])), pick(stall_rows)
    span, deltas = calls.number("tool_call_span_ms"), calls.number("tool_call_deltas")
    numbers: dict[str, Any] = {"limit_ms": limit, "streamed_tool_calls": len(calls),
               "span_ms": _distribution(calls[~np.isnan(span)].recorded("tool_call_span_ms")),
               "max_gap_ms": _distribution(calls.recorded("tool_call_max_gap_ms")),  # every call's
               "deltas": _distribution(deltas[(deltas != 0) & ~np.isnan(deltas)]),
               "over_limit": len(over), "stalls": len(stalls)}
    evidence = ("records.jsonl tool_call_max_gap_ms, findings tool_call.cadence and stream.stall",)
    both = np.concatenate([calls.file_positions(), stall_rows.file_positions()])  # the calls, then the stalls
    rate = rate_by_codes(cluster_codes(calls.columns.rows().take(both)),
                         np.concatenate([over_mask, np.ones(len(stalls), dtype=bool)]))
    numbers["over_limit_rate"] = rate.to_dict()
    if over or stalls:
        worst = max([a.tool_call_max_gap_ms or 0.0 for a in over] + [a.last_silence_ms or 0.0 for a in stalls])
        text = (f"tool-call cadence: {len(over)} streamed tool calls went silent past {limit / 1000:g} s inside the "
                f"call and {len(stalls)} answers stalled until our deadline ({rate.text()}; longest "
                f"{worst / 1000:.1f} s): the arguments were held back until the call was whole, not decoded slowly "
                "(vllm#50604); clients show nothing or time out")
        return numbers, RuleResult("agent.tool_call_cadence", PILLAR, FAIL, text, worst, limit, None, evidence,
                                   (rate.low, rate.high))
    if not len(calls):
        return numbers, None  # no streamed tool call: nothing to say about cadence
    longest = numbers["max_gap_ms"]["max"] or 0.0
    return numbers, RuleResult("agent.tool_call_cadence", PILLAR, PASS,
                               f"{len(calls)} streamed tool calls ({rate.clusters} distinct requests), the longest "
                               f"silence inside one {longest:.0f} ms "
                               f"(limit {limit:.0f} ms)", longest, limit, None, evidence, (rate.low, rate.high))


def parallel_calls(rows: Rows) -> dict[str, Any]:
    """Turns that expect several calls in one answer (`expect.calls`): how many answers carried exactly
    the calls asked for, and how the others went wrong (short, merged arguments, a call emitted twice)."""
    asked_mask = rows.code_where("findings", lambda findings: first_finding(findings, "expect.calls") is not None)
    asked = _by_findings(rows[asked_mask])
    exact = asked.code_where("findings", lambda findings: getattr(first_finding(findings, "expect.calls"), "ok",
                                                                  False))
    failed_checks: Counter[str] = Counter()
    for findings, n in _per_findings(asked):
        for f in findings:
            if not f.ok:
                failed_checks[f.check] += n
    lengths = np.fromiter((len(calls) for calls in asked.table("tool_calls")), dtype=np.int64)
    per_length = Counter(dict(zip(*(a.tolist() for a in np.unique(lengths[asked.ints("tool_calls")],
                                                                   return_counts=True)), strict=True)))
    layers: Counter[Any] = Counter()
    for layer, n in asked.counts("primary_layer").items():
        if layer:
            layers[layer] += n
    numbers: dict[str, Any] = {"answers": len(asked), "exact": int(exact.sum()),
                               "exact_rate": rate_by_codes(cluster_codes(asked), exact).to_dict(),
                               "calls_per_answer": dict(sorted(per_length.items())),
                               "failed_checks": dict(sorted(failed_checks.items())),
                               "by_primary_layer": dict(sorted(layers.items()))}
    return numbers


def _per_findings(rows: Rows) -> list[tuple[Any, int]]:
    """Each distinct list of findings among these rows with how many rows hold it, in order of first appearance."""
    codes, counts = np.unique(rows.ints("findings"), return_counts=True)
    table = rows.table("findings")
    return [(table[c], n) for c, n in zip(codes.tolist(), counts.tolist(), strict=True)]


def no_transition(rows: Rows) -> tuple[dict[str, Any], str | None]:
    """Answers that never left the reasoning (reasoning present, content and calls empty), split by
    the evidence: tool-call markup inside the reasoning (the parser's, vllm#53246) or none (the model's)."""
    by_layer: Counter[Any] = Counter()
    for findings, n in _per_findings(rows):
        for f in findings:
            if f.check == "reasoning.no_transition" and not f.ok:
                by_layer[f.layer] += n
    numbers = {"answers": by_layer.total(), "by_layer": dict(sorted(by_layer.items()))}
    if not by_layer.get(PARSER):
        return numbers, None
    return numbers, (f"parser: {by_layer[PARSER]} answers never left the reasoning (reasoning present, content and "
                     "calls empty, the tool call's markup inside the reasoning): the model omitted the "
                     "think-to-answer transition and the reasoning parser kept everything (vllm#53246)")


def known_failures(rows: Rows, pick: Callable[[Rows], list[AnyAttempt]], limits: dict[str, float],
                   plan: Plan | None) -> tuple[dict[str, Any], list[RuleResult], list[str]]:
    """Every section's numbers, its rules and the reasons to say beside the valid rate (`rows`: the judged)."""
    equivalence, equivalence_rule = stream_equivalence(rows, limits, plan)
    timing, cadence_rule = cadence(rows, pick, limits)
    transition, transition_reason = no_transition(rows)
    numbers = {"stream_equivalence": equivalence, "tool_call_cadence": timing,
               "parallel_calls": parallel_calls(rows), "no_transition": transition}
    rules = [r for r in (equivalence_rule, cadence_rule) if r is not None]
    reasons = [r.reason for r in rules if r.status != PASS]
    return numbers, rules, reasons + ([transition_reason] if transition_reason else [])

