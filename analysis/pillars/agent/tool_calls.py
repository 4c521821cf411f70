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
from typing import Any

from k3load.analysis.pillars.pillar import percentiles
from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.clusters import rate_by_request
from k3load.analysis.run.lean import AnyAttempt, by_findings, first_finding
from k3load.outcomes import FAIL, INCONCLUSIVE, PARSER, PASS, Pillar
from k3load.workload.plan import Plan
from k3load.workload.stream_equivalence import BOTH_VALID, NOT_COMPARED, OUTCOMES
from k3load.workload.stream_equivalence import CHECK as EQUIVALENCE

PILLAR = Pillar.AGENT_API
STREAM_PATH_WRONG = OUTCOMES[-1]


def _finding(attempt: AnyAttempt, check: str) -> Any:
    return first_finding(attempt.findings, check)


def _failing(attempts: list[AnyAttempt], check: str) -> list[AnyAttempt]:
    """The attempts whose first finding of `check` failed (grouped by findings: `lean.by_findings`)."""
    return [a for findings, group in by_findings(attempts)
            if (f := first_finding(findings, check)) is not None and not f.ok for a in group]


def _outcome(attempt: AnyAttempt) -> str | None:
    found = _finding(attempt, EQUIVALENCE)
    if found is None:
        return None
    return found.detail if found.ok else STREAM_PATH_WRONG


def stream_equivalence(attempts: list[AnyAttempt], limits: dict[str, float], plan: Plan | None
                       ) -> tuple[dict[str, Any], RuleResult | None]:
    """Per stage (a concurrency level) and in all: the pairs compared and how many times the streamed
    answer was wrong where its whole twin was right, with an interval."""
    streamed = [a for a in attempts if a.stream_role == "stream"]
    drill = plan.stream_equivalence if plan else None
    if not streamed:
        numbers: dict[str, Any] = {"drill": drill, "pairs": 0}
        if not drill:
            return numbers, None  # not asked for: said once, in the report
        return numbers, RuleResult("agent.stream_equivalence", PILLAR, INCONCLUSIVE,
                                   "streaming equivalence inconclusive, because the drill compared no pair (no "
                                   "eligible turn was played)", evidence=("records.jsonl stream_role",))
    users = {s.name: s.users for s in plan.stages} if plan else {}
    per_stage: dict[str, dict[str, Any]] = {}
    for attempt in streamed:
        row = per_stage.setdefault(attempt.stage, {"users": users.get(attempt.stage), **dict.fromkeys(OUTCOMES, 0)})
        row[_outcome(attempt) or NOT_COMPARED] += 1
    outcomes = {id(a): _outcome(a) or NOT_COMPARED for a in streamed}
    for name, row in per_stage.items():
        compared = sum(row[o] for o in OUTCOMES if o != NOT_COMPARED)
        row["compared"] = compared
        mine = [a for a in streamed if a.stage == name and outcomes[id(a)] != NOT_COMPARED]
        row["stream_path_failure_rate"] = rate_by_request(
            mine, [outcomes[id(a)] == STREAM_PATH_WRONG for a in mine]).to_dict()
    totals = Counter({o: sum(r[o] for r in per_stage.values()) for o in OUTCOMES})
    compared = sum(totals[o] for o in OUTCOMES if o != NOT_COMPARED)
    judged = [a for a in streamed if outcomes[id(a)] != NOT_COMPARED]  # the interval: over distinct requests
    rate = rate_by_request(judged, [outcomes[id(a)] == STREAM_PATH_WRONG for a in judged])
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


def _distribution(values: list[float]) -> dict[str, float | int | None]:
    p50, p95 = percentiles(values, (0.5, 0.95))
    return {"n": len(values), "p50": p50, "p95": p95, "max": max(values) if values else None}


def cadence(attempts: list[AnyAttempt], limits: dict[str, float]) -> tuple[dict[str, Any], RuleResult | None]:
    """Streamed tool calls: the span from the first tool-call delta to the arguments' end, the longest
    silence inside the call, the deltas per call; silences past the plan's limit and stalls that our
    deadline cut (each a finding on its attempt) with their rate."""
    calls = [a for a in attempts if a.tool_call_max_gap_ms is not None]
    limit = limits["max_tool_call_gap_ms"]
    over, stalls = _failing(calls, "tool_call.cadence"), _failing(attempts, "stream.stall")  # counted, maxed
    gaps = [a.tool_call_max_gap_ms for a in calls if a.tool_call_max_gap_ms is not None]  # every call's
    numbers: dict[str, Any] = {"limit_ms": limit, "streamed_tool_calls": len(calls),
               "span_ms": _distribution([a.tool_call_span_ms for a in calls if a.tool_call_span_ms is not None]),
               "max_gap_ms": _distribution(gaps),
               "deltas": _distribution([float(a.tool_call_deltas) for a in calls if a.tool_call_deltas]),
               "over_limit": len(over), "stalls": len(stalls)}
    evidence = ("records.jsonl tool_call_max_gap_ms, findings tool_call.cadence and stream.stall",)
    failed = {id(a) for a in over}
    rate = rate_by_request([*calls, *stalls], [*(id(a) in failed for a in calls), *([True] * len(stalls))])
    numbers["over_limit_rate"] = rate.to_dict()
    if over or stalls:
        worst = max([a.tool_call_max_gap_ms or 0.0 for a in over] + [a.last_silence_ms or 0.0 for a in stalls])
        text = (f"tool-call cadence: {len(over)} streamed tool calls went silent past {limit / 1000:g} s inside the "
                f"call and {len(stalls)} answers stalled until our deadline ({rate.text()}; longest "
                f"{worst / 1000:.1f} s): the arguments were held back until the call was whole, not decoded slowly "
                "(vllm#50604); clients show nothing or time out")
        return numbers, RuleResult("agent.tool_call_cadence", PILLAR, FAIL, text, worst, limit, None, evidence,
                                   (rate.low, rate.high))
    if not calls:
        return numbers, None  # no streamed tool call: nothing to say about cadence
    longest = numbers["max_gap_ms"]["max"] or 0.0
    return numbers, RuleResult("agent.tool_call_cadence", PILLAR, PASS,
                               f"{len(calls)} streamed tool calls ({rate.clusters} distinct requests), the longest "
                               f"silence inside one {longest:.0f} ms "
                               f"(limit {limit:.0f} ms)", longest, limit, None, evidence, (rate.low, rate.high))


def parallel_calls(attempts: list[AnyAttempt]) -> dict[str, Any]:
    """Turns that expect several calls in one answer (`expect.calls`): how many answers carried exactly
    the calls asked for, and how the others went wrong (short, merged arguments, a call emitted twice)."""
    groups = [(findings, group, found) for findings, group in by_findings(attempts)
              if (found := first_finding(findings, "expect.calls")) is not None]
    asked = [a for _findings, group, _found in groups for a in group]
    exact = [found.ok for _findings, group, found in groups for _a in group]
    right = sum(exact)
    failed_checks: Counter[str] = Counter()
    for findings, group, _found in groups:
        for f in findings:
            if not f.ok:
                failed_checks[f.check] += len(group)
    numbers: dict[str, Any] = {"answers": len(asked), "exact": right,
                               "exact_rate": rate_by_request(asked, exact).to_dict(),
                               "calls_per_answer": dict(sorted(Counter(len(a.tool_calls) for a in asked).items())),
                               "failed_checks": dict(sorted(failed_checks.items())),
                               "by_primary_layer": dict(sorted(Counter(a.primary_layer for a in asked
                                                                       if a.primary_layer).items()))}
    return numbers


def no_transition(attempts: list[AnyAttempt]) -> tuple[dict[str, Any], str | None]:
    """Answers that never left the reasoning (reasoning present, content and calls empty), split by
    the evidence: tool-call markup inside the reasoning (the parser's, vllm#53246) or none (the model's)."""
    by_layer: Counter[Any] = Counter()
    for findings, group in by_findings(attempts):
        for f in findings:
            if f.check == "reasoning.no_transition" and not f.ok:
                by_layer[f.layer] += len(group)
    numbers = {"answers": by_layer.total(), "by_layer": dict(sorted(by_layer.items()))}
    if not by_layer.get(PARSER):
        return numbers, None
    return numbers, (f"parser: {by_layer[PARSER]} answers never left the reasoning (reasoning present, content and "
                     "calls empty, the tool call's markup inside the reasoning): the model omitted the "
                     "think-to-answer transition and the reasoning parser kept everything (vllm#53246)")


def known_failures(attempts: list[AnyAttempt], limits: dict[str, float], plan: Plan | None
                   ) -> tuple[dict[str, Any], list[RuleResult], list[str]]:
    """Every section's numbers, its rules and the reasons to say beside the valid rate."""
    equivalence, equivalence_rule = stream_equivalence(attempts, limits, plan)
    timing, cadence_rule = cadence(attempts, limits)
    transition, transition_reason = no_transition(attempts)
    numbers = {"stream_equivalence": equivalence, "tool_call_cadence": timing,
               "parallel_calls": parallel_calls(attempts), "no_transition": transition}
    rules = [r for r in (equivalence_rule, cadence_rule) if r is not None]
    reasons = [r.reason for r in rules if r.status != PASS]
    return numbers, rules, reasons + ([transition_reason] if transition_reason else [])

