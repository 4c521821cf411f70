"""Pillar 4, agent API correctness: rates per check and layer over every attempt of the run.

Why rates and minimum counts: one successful demo is not evidence; the recipe itself warns that K3
sometimes emits a tool-call format its parser does not expect, so the judgment is how often, where
(which layer) and whether retries recovered. Timeout-drill attempts are judged on their own: their
timeout is the point of the drill, the retry after it must succeed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from k3load.analysis.pillars.agent.agreement import findings_schema_ok, reference_rules
from k3load.analysis.pillars.agent.reproducibility import holds_the_pillar, reproducibility
from k3load.analysis.pillars.agent.reproducibility import judge as judge_reproducibility
from k3load.analysis.pillars.agent.tool_calls import known_failures
from k3load.analysis.pillars.agent.trigger_by_stage import trigger_by_stage
from k3load.analysis.pillars.agent.unjudged import has_harness_error
from k3load.analysis.pillars.agent.unjudged import numbers as unjudged_numbers
from k3load.analysis.pillars.agent.unjudged import rule as unjudged_rule
from k3load.analysis.pillars.pillar import PillarResult
from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.clusters import cluster_codes, rate_by_codes
from k3load.analysis.run.lean import AnyAttempt
from k3load.analysis.run.record_columns import MISSING_INT, Rows, group_heads, group_of
from k3load.analysis.run.rundata import RunData
from k3load.analysis.run.stats import (
    MIN_DISTINCT_REQUESTS,
    Rate,
    decide_rate,
    more_requests_to_decide,
    too_few_requests,
)
from k3load.outcomes import FAIL, INCONCLUSIVE, LAYERS, NOT_RUN, PASS, Pillar
from k3load.workload.plan import Plan
from k3load.workload.validate import context_length

PILLAR = Pillar.AGENT_API  # the pillar these rules judge


def _rates(rows: Rows) -> tuple[dict[str, Any], Rate]:
    """Each failed attempt counted once, under its primary layer; a check failing only as the
    consequence of another layer's fault (a parser that lost the call fails `expect.tool_call`
    too) is counted apart, as secondary. Every rate's interval is over the distinct requests
    (analysis/run/clusters.py); the valid rate is returned with the numbers. On the record columns: each distinct
    list of findings read once, a record's `valid` counted where it is true."""
    layer_table = rows.table("primary_layer")
    layer, findings = rows.ints("primary_layer").astype(np.int64), rows.ints("findings").astype(np.int64)
    width = len(layer_table)
    pairs, per_pair = np.unique(findings * width + layer, return_counts=True)  # (findings, layer) -> attempts
    layers: Counter[Any] = Counter()
    for code, n in zip((pairs % width).tolist(), per_pair.tolist(), strict=True):
        if layer_table[code]:
            layers[layer_table[code]] += n
    primary: Counter[str] = Counter()
    secondary: Counter[str] = Counter()
    marked: dict[str, list[int]] = {}  # per primary check: the (findings, layer) pairs whose attempts failed it
    for pair, n in zip(pairs.tolist(), per_pair.tolist(), strict=True):
        failed = [f for f in rows.table("findings")[pair // width] if not f.ok]
        primary_layer = layer_table[pair % width]
        for f in failed:
            (primary if f.layer == primary_layer else secondary)[f.check] += n
            if f.layer == primary_layer:
                marked.setdefault(f.check, []).append(pair)
    tool_responses = rows.code_where("tool_calls", bool) | rows.code_is("finish_reason", "tool_calls")
    schema_ok = rows.code_where("findings", findings_schema_ok)
    clusters = cluster_codes(rows)
    valid = rate_by_codes(clusters, rows.flag("valid"))
    told = rows[tool_responses]
    schema = rate_by_codes(cluster_codes(told), schema_ok[tool_responses])
    pair_of_row = findings * width + layer
    n = len(rows)
    return {
        "attempts": n, "distinct_requests": valid.clusters, "valid": valid.k, "valid_rate": valid.value,
        "valid_rate_ci95": [valid.low, valid.high],
        "failed_by_layer": {name: layers.get(name, 0) for name in LAYERS},
        "failed_by_check": dict(sorted(primary.items())),
        "secondary_failures_by_check": dict(sorted(secondary.items())),
        "check_failure_rates": {check: rate_by_codes(clusters, np.isin(pair_of_row, marked[check])).to_dict()
                                for check in sorted(primary)},
        "tool_call_responses": len(told),
        "tool_call_schema_accuracy": schema.value, "tool_call_schema_accuracy_ci95":
            [schema.low, schema.high] if len(told) else None,
        "tool_call_schema_distinct_requests": schema.clusters,
    }, valid


def _chains(rows: Rows, pick: Callable[[Rows], list[AnyAttempt]]) -> dict[str, Any]:
    """Retries are duplicate work the server really did, drill retries included; the prompt tokens
    spent on abandoned attempts are read from a sibling of the same bytes that the server answered.

    On the record columns: each chain's last attempt is its highest number (the first of equals in file order), a
    request's prompt tokens the last known in file order, a record's `valid` counted where it is true. A run with an
    attempt number that is no integer is read whole (`_chains_whole`)."""
    number = rows.ints("attempt")
    if (number == MISSING_INT).any():
        return _chains_whole(pick(rows))
    chains, chain = group_of(rows.keys("chain_id"))
    sizes = np.bincount(chain, minlength=chains)
    final = group_heads(chain, -number)  # per chain: its highest number, then file order
    final_valid = rows.flag("valid")[final]
    retried = sizes > 1
    drilled = np.bincount(chain, weights=rows.flag("drill"), minlength=chains) > 0
    abandoned = rows.flag("will_retry")
    return {"requests": int(chains), "requests_valid": int(final_valid.sum()),
            "retried_requests": int(retried.sum()), "recovered_by_retry": int((retried & final_valid).sum()),
            "duplicate_attempts": int((sizes[retried] - 1).sum()),
            "duplicate_attempts_drill": int((sizes[retried & drilled] - 1).sum()),
            "abandoned_prompt_tokens": _abandoned_tokens(rows, abandoned),
            "abandoned_output_chunks": rows[abandoned].total("chunks")}


def _abandoned_tokens(rows: Rows, abandoned: np.ndarray) -> int | float:
    """The prompt tokens of the abandoned attempts, each read from the last record of its bytes (in file order)
    that knew them (none: 0)."""
    tokens = rows.number("prompt_tokens")
    request = rows.ints("request_sha256")
    known = np.flatnonzero(~np.isnan(tokens))
    last = np.full(int(request.max(initial=-1)) + 1, -1, dtype=np.intp)
    np.maximum.at(last, request[known], known)  # per request: its last record that knew them, in file order
    source = last[request[abandoned]]
    return rows.take(source[source >= 0]).total("prompt_tokens", falsy_as_zero=True)


def _attempt_rank(attempt: AnyAttempt) -> float:
    """An attempt's number as the columns read it (an integer or a boolean); one that is no integer (a hand-made
    "2", 1.0, none) ranks below every number, so a chain's final attempt is its highest numbered, ties in file
    order, and never a comparison of a string with an integer."""
    number = attempt.attempt
    return int(number) if type(number) is int or type(number) is bool else -math.inf


def _chains_whole(attempts: list[AnyAttempt]) -> dict[str, Any]:
    """`_chains` over every attempt read whole."""
    by_chain: dict[str, list[AnyAttempt]] = {}
    for attempt in attempts:
        by_chain.setdefault(attempt.chain_id, []).append(attempt)
    finals = [chain[0] if len(chain) == 1 else max(chain, key=_attempt_rank) for chain in by_chain.values()]
    retried = [c for c in by_chain.values() if len(c) > 1]
    recovered = [c for c in retried if max(c, key=_attempt_rank).valid == True]  # noqa: E712 (as `valid` is read)
    tokens = {a.request_sha256: a.prompt_tokens for a in attempts if a.prompt_tokens is not None}
    abandoned = [a for a in attempts if a.will_retry]
    return {"requests": len(finals), "requests_valid": sum(a.valid == True for a in finals),  # noqa: E712
            "retried_requests": len(retried), "recovered_by_retry": len(recovered),
            "duplicate_attempts": sum(len(c) - 1 for c in retried),
            "duplicate_attempts_drill": sum(len(c) - 1 for c in retried if any(a.drill for a in c)),
            "abandoned_prompt_tokens": sum(tokens.get(a.request_sha256) or 0 for a in abandoned),
            "abandoned_output_chunks": sum(a.chunks for a in abandoned)}


def context_refusals(rows: Rows, pick: Callable[[Rows], list[AnyAttempt]]) -> dict[str, Any]:
    """vLLM's context-length 400s per family: the prompts' tokens against the server's max_model_len.

    vLLM counts a refused prompt only up to max_model_len + 1 ("at least N"), so the size the operator
    needs (how much context to give) is estimated from the bytes each refused request sent, at the
    tokens per byte of the run's answered requests, and marked as an estimate. The 400s are read whole."""
    per_byte = _tokens_per_byte(rows)
    out: dict[str, Any] = {}
    for attempt in pick(rows[rows.number("http_status") == 400]):
        found = context_length(attempt.error_body)
        if not found:
            continue
        family = out.setdefault(attempt.family, {"refused": 0, "attempts": 0, "max_model_len": found.max_model_len,
                                                 "prompt_tokens_min": None, "prompt_tokens_max": None,
                                                 "counted_only_to_the_limit": False, "prompt_tokens_estimated": None,
                                                 "completion_tokens_max": None})
        family["refused"] += 1
        if found.prompt_tokens is not None:
            known = [t for t in (family["prompt_tokens_min"], family["prompt_tokens_max"]) if t is not None]
            family["prompt_tokens_min"] = min([*known, found.prompt_tokens])
            family["prompt_tokens_max"] = max([*known, found.prompt_tokens])
        family["counted_only_to_the_limit"] |= found.at_least
        if found.completion_tokens is not None:  # the prompt fit; with the output budget asked for it did not
            family["completion_tokens_max"] = max(family["completion_tokens_max"] or 0, found.completion_tokens)
        if per_byte and attempt.request_bytes:
            estimate = round(attempt.request_bytes * per_byte)
            family["prompt_tokens_estimated"] = max(family["prompt_tokens_estimated"] or 0, estimate)
    if out:
        for family_name, count in rows.counts("family").items():
            if family_name in out:
                out[family_name]["attempts"] += count
    for family in out.values():
        # The run's average tokens per byte can undercount one prompt (an agent's late turn, dense with tool
        # JSON, was estimated at 1,018 where vLLM counted at least 1,025); vLLM's floor is known, so an
        # estimate below it is known to be wrong and is raised to it.
        if family["prompt_tokens_estimated"] and family["counted_only_to_the_limit"] and family["prompt_tokens_max"]:
            family["prompt_tokens_estimated"] = max(family["prompt_tokens_estimated"], family["prompt_tokens_max"])
    return out


def _tokens_per_byte(rows: Rows) -> float | None:
    """Prompt tokens per body byte over the answered requests (None when none reports both)."""
    tokens, size = rows.number("prompt_tokens"), rows.number("request_bytes")
    both = rows.code_is("status", "ok") & (tokens != 0) & ~np.isnan(tokens) & (size != 0) & ~np.isnan(size)
    if not both.any():
        return None
    told = rows[both]
    per_byte: float = told.total("prompt_tokens") / told.total("request_bytes")
    return per_byte


def context_reason(refusals: dict[str, Any]) -> str | None:
    if not refusals:
        return None
    parts = [f"{family} {v['refused']} of {v['attempts']} ({_sizes(v)} > max_model_len {v['max_model_len']})"
             for family, v in sorted(refusals.items())]
    return "the server refused prompts longer than its context (vLLM's context-length 400): " + "; ".join(parts)


def _sizes(v: dict[str, Any]) -> str:
    """What is known of the refused prompts' size: vLLM's count (a floor when it stopped counting at the
    limit) and the estimate from the bytes sent."""
    low, high = v["prompt_tokens_min"], v["prompt_tokens_max"]
    if low is None:
        said = "prompts not counted"
    else:
        floor = "at least " if v["counted_only_to_the_limit"] else ""
        said = f"prompts {floor}{low}{'' if high == low else f'-{high}'} tokens"
    if v["prompt_tokens_estimated"]:
        said += f", ~{v['prompt_tokens_estimated']} estimated from the bytes sent"
    if v.get("completion_tokens_max"):
        said += f", + up to {v['completion_tokens_max']} asked for the completion"
    return said


def _drill(rows: Rows, pick: Callable[[Rows], list[AnyAttempt]]) -> tuple[dict[str, Any], list[str]]:
    """Chains whose deliberately short first deadline expired must be answered on retry. A drill
    answered within its deadline proves nothing either way (not a failure); a chain the run's end cut
    before its retry is left out. Read whole: the drills and the chains of those that timed out (few)."""
    drill = rows.flag("drill")
    timed_out = rows[drill & rows.code_is("status", "timeout")].keys("chain_id")
    return _drill_whole(pick(rows[drill | rows.key_in("chain_id", timed_out)]))


def _drill_whole(attempts: list[AnyAttempt]) -> tuple[dict[str, Any], list[str]]:
    """`_drill` over the drills and every attempt of their chains, read whole."""
    drills = [a for a in attempts if a.drill]
    timed_out = {a.chain_id for a in drills if a.status == "timeout"}
    finals: dict[str, AnyAttempt] = {}
    for attempt in attempts:
        if attempt.chain_id in timed_out and attempt.attempt > getattr(finals.get(attempt.chain_id), "attempt", 0):
            finals[attempt.chain_id] = attempt
    judged = [a for a in finals.values() if not a.will_retry]
    recovered = sum(1 for a in judged if a.attempt > 1 and a.status == "ok")
    numbers = {"drills": len(drills), "timed_out": len(timed_out), "judged": len(judged), "recovered": recovered}
    if recovered < len(judged):
        return numbers, [f"timeout drill: only {recovered} of {len(judged)} timed-out requests were answered on "
                         "retry"]
    return numbers, []


def _valid_rule(numbers: dict[str, Any], threshold: float, rate: Rate, carried: Rate | None = None) -> RuleResult:
    """The valid rate over the judged attempts, its interval over their distinct requests. A failing rate
    that the answers the harness could not judge (`carried`: the rate were they all valid) would carry out
    of failing is not a failure: inconclusive."""
    status = decide_rate(rate, threshold)
    evidence = ("records.jsonl (drill attempts excluded)",)
    few = too_few_requests(rate)
    if few:
        text = (f"inconclusive, because {few} were judged (at least {MIN_DISTINCT_REQUESTS} are needed: repeats of "
                f"the same request are not new trials): {rate.text()} valid against {threshold:.0%} required")
        return RuleResult("agent.valid_rate", PILLAR, INCONCLUSIVE, text, rate.value, threshold,
                          evidence=evidence, interval=(rate.low, rate.high))
    if status == FAIL and carried is not None and decide_rate(carried, threshold) != FAIL:
        unjudged = carried.n - rate.n
        text = (f"inconclusive, because {rate.text()} judged valid against {threshold:.0%} required, and the "
                f"{unjudged} answers the harness could not judge would carry the rate out of failing were they "
                "valid")
        return RuleResult("agent.valid_rate", PILLAR, INCONCLUSIVE, text, rate.value, threshold,
                          evidence=("records.jsonl (drill attempts and harness.error answers excluded)",),
                          interval=(rate.low, rate.high))
    layers = ", ".join(f"{k} {v}" for k, v in numbers["failed_by_layer"].items() if v) or "none"
    worst = sorted(((n, c) for c, n in numbers["failed_by_check"].items()), reverse=True)[:4]
    checks = ", ".join(f"{c} x{n}" for n, c in worst)
    text = f"{rate.text()} valid against {threshold:.0%} required"
    if status == FAIL:
        text += f" (failures counted once, by primary layer: {layers}; most frequent checks: {checks})"
    elif status == INCONCLUSIVE:
        more = more_requests_to_decide(rate, threshold)
        text = (f"inconclusive, because {text}: the interval straddles the threshold"
                + (f"; about {more} more distinct requests at this rate would decide" if more else
                   "; the rate sits on the threshold") + (f" (failures by layer: {layers})" if rate.k < rate.n else ""))
    return RuleResult("agent.valid_rate", PILLAR, status, text, rate.value, threshold,
                      evidence=evidence, interval=(rate.low, rate.high))


SURFACED = ("reproducibility",)  # at `pillars.agent_api.reproducibility` too: issue 33's path for it


def _repeats(judged_rows: Rows, limits: dict[str, float], plan: Plan | None
             ) -> tuple[dict[str, Any], dict[str, Any], list[RuleResult], str | None]:
    """Tool calls that must repeat (analysis/pillars/agent/reproducibility.py) and the trigger rate per stage
    (analysis/pillars/agent/trigger_by_stage.py): their numbers, the rules that decide the pillar, and the
    reproducibility's
    reason when it decides nothing (said beside the pillar's reasons: never a silent pass on no evidence)."""
    found = reproducibility(judged_rows, {s.name: s.users for s in plan.stages} if plan else None)
    rule = judge_reproducibility(found, limits["min_reproducible_share"])
    trigger, trigger_rule = trigger_by_stage(judged_rows, plan)
    holds = holds_the_pillar(rule, found)
    rules = [r for r in ((rule if holds else None), trigger_rule) if r is not None]
    return (found.to_dict() | {"status": rule.status, "reason": rule.reason}, trigger, rules,
            None if holds else rule.reason)


def tool_turns_reason(tool_turns: str) -> str | None:
    """What a plan that steered tool turns did not test (None for the scenarios as written)."""
    if tool_turns == "auto":
        return None
    how = "with the expected tool named" if tool_turns == "named" else 'with tool_choice "required"'
    return (f"tool-call turns were sent {how} (the plan's tool_turns: {tool_turns}): calls were checked, the "
            "model's own choice to call a tool (auto) was not tested")


def judge_agent_api(run: RunData | list[AnyAttempt], limits: dict[str, float], plan: Plan | None = None,
                    reference: dict[str, Any] | None = None) -> PillarResult:
    """The valid rate over every judged attempt, and beside it Kimi's known tool-calling failures
    (analysis/pillars/agent/tool_calls.py): a streaming path wrong where the whole body is right, tool calls held back
    for long silences, answers left in the reasoning. Any of those failing fails the pillar. With a
    reference run (reference.json, analysis/pillars/agent/agreement.py), agreement with it is judged too.
    `run`: the run's data, or attempts given whole (a library user's, a test's)."""
    data = run if isinstance(run, RunData) else RunData(path=Path("."), attempts=list(run))
    rows = data.columns.rows()
    if rows.empty:
        return PillarResult(NOT_RUN, ["no request was recorded"])
    tool_turns = plan.tool_turns if plan else "auto"
    # answers the harness could not judge (a harness.error finding): neither valid nor failed
    unjudged_rows = rows[rows.code_where("findings", has_harness_error)]
    unjudged = data.pick(unjudged_rows)
    judged_rows = rows[~rows.code_where("findings", has_harness_error) & ~rows.flag("drill")]
    rates, valid = _rates(judged_rows)
    numbers = rates | {"requests": _chains(rows, data.pick), "tool_turns": tool_turns}
    harness = []
    if unjudged:  # only then: a run without one is judged (and its verdict.json written) as before
        numbers["unjudged"] = unjudged_numbers(unjudged)
        harness = [unjudged_rule(numbers["unjudged"])]
    known, known_rules, known_reasons = known_failures(judged_rows, data.pick, limits, plan)
    numbers |= known
    if reference is not None:  # the tool-call choices and schema accuracy against a trusted run
        numbers["reference"], reference_found = reference_rules(reference, judged_rows, limits)
        known_rules += reference_found
        known_reasons += [r.reason for r in reference_found if r.status != PASS]
    repeated = _repeats(judged_rows, limits, plan)
    numbers["reproducibility"], numbers["trigger_rate_by_stage"], repeat_rules, repeat_note = repeated
    known_rules += repeat_rules
    known_reasons += [r.reason for r in repeat_rules if r.status != PASS]
    drill, drill_reasons = _drill(rows, data.pick)
    numbers["timeout_drill"] = drill
    numbers["context_length_refusals"] = refusals = context_refusals(judged_rows, data.pick)
    if len(judged_rows) < limits["min_attempts"]:
        numbers["rules"] = [r.to_dict() for r in harness]
        return PillarResult(INCONCLUSIVE, [r.reason for r in harness] + [
            f"inconclusive, because only {len(judged_rows)} attempts were judged (at least "
            f"{int(limits['min_attempts'])} are needed: one success is not evidence)"], numbers, SURFACED)
    carried = None
    if unjudged:  # the rate were every answer the harness could not judge valid
        both = rows.take(np.concatenate([judged_rows.file_positions(), unjudged_rows.file_positions()]))
        carried = rate_by_codes(cluster_codes(both), np.concatenate([judged_rows.flag("valid"),
                                                                     np.ones(len(unjudged_rows), dtype=bool)]))
    rule = _valid_rule(numbers, limits["min_valid_rate"], valid, carried)
    rules = [*harness, rule, *known_rules]
    numbers["rules"] = [r.to_dict() for r in rules]
    reasons = ([rule.reason] if rule.status != PASS else []) + known_reasons
    reasons += [r for r in [context_reason(refusals), tool_turns_reason(tool_turns), repeat_note] if r] + drill_reasons
    statuses = {r.status for r in rules}
    if FAIL in statuses or drill_reasons:  # what failed first; the answers the harness could not judge after it
        return PillarResult(FAIL, reasons + [r.reason for r in harness], numbers, SURFACED)
    if INCONCLUSIVE in statuses:
        return PillarResult(INCONCLUSIVE, [r.reason for r in harness] + reasons, numbers, SURFACED)
    passed = [r.reason for r in known_rules if r.status == PASS]
    return PillarResult(PASS, [f"{rule.reason} (tool calls, structured output, reasoning/content separation, "
                               "expectations)", *passed, *reasons], numbers, SURFACED)
