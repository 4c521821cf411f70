"""The readings of every attempt whole, as the judgment made them before the record columns: the references the
column readings are held to (tests/unit/test_column_readers.py). Kept as they were, names prefixed `_whole_`."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3load.analysis.pillars.agent.agreement import (
    TOOL_CALL,
    _compared,
    _key,
    _label,
    _mix,
    _rate,
    drop,
    f1_interval,
    findings_schema_ok,
)
from k3load.analysis.pillars.agent.reproducibility import (
    FIRST_DIFFERENCES,
    Difference,
    Reproducibility,
    StageAgreement,
    must_repeat,
    signature_of,
    what_differs,
)
from k3load.analysis.pillars.agent.retry_paths import PATHS
from k3load.analysis.pillars.agent.trigger_by_stage import Change
from k3load.analysis.pillars.agent.trigger_by_stage import _rule as _trigger_rule
from k3load.analysis.pillars.headroom.buffering import (
    BLOCK_BYTES_PER_READ,
    BLOCK_EVENTS_PER_READ,
    BUFFERED_SHARE,
    FIX,
    LAYER,
    MIN_CHUNKS,
    MIN_READS,
    MIN_STREAMS,
    STRAIGHT_SHARE,
    Delivery,
    StreamDelivery,
)
from k3load.analysis.pillars.pillar import percentiles
from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.answer_signature import UNREAD
from k3load.analysis.run.clusters import attempt_key, rate_by_keys, rate_by_request
from k3load.analysis.run.lean import by_findings, call_name, designed_body, first_finding
from k3load.analysis.run.stats import Rate, too_few_requests, wilson
from k3load.analysis.run.timeline import MetricIndex
from k3load.outcomes import FAIL, INCONCLUSIVE, LAYERS, MODEL_OUTPUT, PARSER, PASS, Pillar
from k3load.sampler.vllm_metrics import VllmMetric
from k3load.workload.plan import Plan
from k3load.workload.retry_policy import AttemptPath
from k3load.workload.stage_kind import StageKind
from k3load.workload.stream_equivalence import BOTH_VALID, NOT_COMPARED, OUTCOMES
from k3load.workload.stream_equivalence import CHECK as EQUIVALENCE
from k3load.workload.validate import context_length

PILLAR = Pillar.AGENT_API
STREAM_PATH_WRONG = OUTCOMES[-1]


def _counted(attempt: Any) -> bool:
    """A streamed answer that ended well, long enough to show blocks, with its reads counted."""
    return bool(attempt.stream) and attempt.status == "ok" and attempt.chunks >= MIN_CHUNKS and \
        bool(attempt.stream_reads) and attempt.stream_bytes is not None


def in_blocks(attempt: Any) -> bool:
    """Many events and kilobytes per read: a buffer's blocks, not the server's pacing."""
    reads = attempt.stream_reads or 1
    return attempt.chunks / reads >= BLOCK_EVENTS_PER_READ and (attempt.stream_bytes or 0) / reads >= \
        BLOCK_BYTES_PER_READ


def _whole_stream_delivery(attempts: Sequence[Any], index: MetricIndex, saturated_stages: Sequence[str] = ()
                           ) -> StreamDelivery:
    """Straight, buffered or unknown, from the streams outside `saturated_stages` (a saturated load
    generator reads late and piles events up in its own socket)."""
    streamed = [a for a in attempts if a.stream and a.status == "ok" and a.chunks >= MIN_CHUNKS]
    if not streamed:
        return StreamDelivery(Delivery.UNKNOWN, "inconclusive, because no streamed answer of at least "
                              f"{MIN_CHUNKS} token chunks ended well")
    counted = [a for a in streamed if _counted(a)]
    if not counted:
        return StreamDelivery(Delivery.UNKNOWN, "inconclusive, because the records do not count the reads that "
                              "carried each stream (written before stream_reads existed)")
    hot = set(saturated_stages)
    cool = [a for a in counted if a.stage not in hot]
    telling = [a for a in cool if (a.stream_reads or 0) >= MIN_READS]
    whole = len(cool) - len(telling)
    if len(telling) < MIN_STREAMS:
        why = (f"the load generator was saturated in {', '.join(sorted(hot))} (its own socket piles events up)"
               if hot and len(counted) >= MIN_STREAMS else
               f"{whole} arrived whole, in one or two reads (written faster than read, or held whole)" if whole
               else "")
        return StreamDelivery(Delivery.UNKNOWN, f"inconclusive, because only {len(telling)} streamed answers of at "
                              f"least {MIN_CHUNKS} chunks came in {MIN_READS} reads or more (at least {MIN_STREAMS} "
                              "are needed)" + (f": {why}" if why else ""), len(telling))
    blocked = wilson(sum(1 for a in telling if in_blocks(a)), len(telling))
    events = statistics.median(a.chunks / (a.stream_reads or 1) for a in telling)
    size = statistics.median((a.stream_bytes or 0) / (a.stream_reads or 1) for a in telling)
    ttfts = [a.ttft_ms for a in telling if a.ttft_ms is not None]
    client = statistics.median(ttfts) if ttfts else None
    t0, t1 = min(a.send_ts for a in telling), max(a.end_ts for a in telling)
    server = index.histogram_bucket(VllmMetric.TIME_TO_FIRST_TOKEN, t0, t1, 0.5)
    numbers: dict[str, Any] = {"streams": len(telling), "blocked": blocked, "events_per_read_p50": round(events, 2),
               "bytes_per_read_p50": round(size), "client_ttft_p50_ms": round(client, 3) if client else None,
               "server_ttft": server}
    pattern = (f"{blocked.k} of {len(telling)} streamed answers of {MIN_READS} reads or more (95% CI {blocked.low:.1%}-"
               f"{blocked.high:.1%}) reached the client in blocks: a median {events:.1f} SSE events and {size:,.0f} "
               "bytes per socket read (a server's own pacing is about one event a read)")
    if blocked.low > BUFFERED_SHARE:
        timing = f"; the client's TTFT p50 {client:.0f} ms" if client is not None else ""
        if server is not None and timing:
            timing += f" against the server's own {server.text()} (vllm:time_to_first_token_seconds)"
        return StreamDelivery(Delivery.BUFFERED, f"{LAYER}: the stream is buffered between the server and the client: "
                              f"{pattern}{timing}. The client's TTFT and inter-token latency are the proxy's blocks, "
                              f"not the engine's: latency SLOs judged on the server's own histograms. Fix: {FIX}",
                              **numbers)
    arrived_whole = f"; {whole} more arrived whole, in one or two reads" if whole else ""
    if blocked.high < STRAIGHT_SHARE:
        return StreamDelivery(Delivery.STRAIGHT, f"no proxy's blocks: median {events:.1f} events and {size:,.0f} bytes "
                              f"per read over {len(telling)} streamed answers of {MIN_READS} reads or more "
                              f"({blocked.k} in blocks, 95% CI {blocked.low:.1%}-{blocked.high:.1%}){arrived_whole}",
                              **numbers)
    return StreamDelivery(Delivery.UNKNOWN, f"inconclusive, because {pattern}{arrived_whole}: a proxy buffers every "
                          "stream, a server or client running behind only some", **numbers)


def _whole_context_refusals(attempts: list[Any]) -> dict[str, Any]:
    """vLLM's context-length 400s per family: the prompts' tokens against the server's max_model_len.

    vLLM counts a refused prompt only up to max_model_len + 1 ("at least N"), so the size the operator
    needs (how much context to give) is estimated from the bytes each refused request sent, at the
    tokens per byte of the run's answered requests, and marked as an estimate."""
    per_byte = _whole_tokens_per_byte(attempts)
    out: dict[str, Any] = {}
    for attempt in attempts:
        found = context_length(attempt.error_body) if attempt.http_status == 400 else None
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
    for attempt in attempts:
        if attempt.family in out:
            out[attempt.family]["attempts"] += 1
    for family in out.values():
        # The run's average tokens per byte can undercount one prompt (an agent's late turn, dense with tool
        # JSON, was estimated at 1,018 where vLLM counted at least 1,025); vLLM's floor is known, so an
        # estimate below it is known to be wrong and is raised to it.
        if family["prompt_tokens_estimated"] and family["counted_only_to_the_limit"] and family["prompt_tokens_max"]:
            family["prompt_tokens_estimated"] = max(family["prompt_tokens_estimated"], family["prompt_tokens_max"])
    return out


def _whole_tokens_per_byte(attempts: list[Any]) -> float | None:
    """Prompt tokens per body byte over the answered requests (None when none reports both)."""
    pairs = [(a.prompt_tokens, a.request_bytes) for a in attempts
             if a.status == "ok" and a.prompt_tokens and a.request_bytes]
    return sum(t for t, _ in pairs) / sum(b for _, b in pairs) if pairs else None


def _whole_rates(attempts: list[Any]) -> tuple[dict[str, Any], Rate]:
    """Each failed attempt counted once, under its primary layer; a check failing only as the
    consequence of another layer's fault (a parser that lost the call fails `expect.tool_call`
    too) is counted apart, as secondary. Every rate's interval is over the distinct requests
    (analysis/run/clusters.py); the valid rate is returned with the numbers."""
    layers = Counter(a.primary_layer for a in attempts if a.primary_layer)
    primary: Counter[str] = Counter()
    secondary: Counter[str] = Counter()
    position = {id(a): i for i, a in enumerate(attempts)}
    failing: dict[str, np.ndarray] = {}  # per primary check: which attempts failed it
    for findings, group in by_findings(attempts):  # each distinct list of findings read once
        failed = [f for f in findings if not f.ok]
        if not failed:
            continue
        for layer, n in Counter(a.primary_layer for a in group).items():
            for f in failed:
                (primary if f.layer == layer else secondary)[f.check] += n
        for f in failed:
            marks = [position[id(a)] for a in group if a.primary_layer == f.layer]
            if marks:
                failing.setdefault(f.check, np.zeros(len(attempts), dtype=bool))[marks] = True
    tool_responses = [a for a in attempts if a.tool_calls or a.finish_reason == "tool_calls"]
    schema_ok = {id(a) for findings, group in by_findings(tool_responses) if findings_schema_ok(findings)
                 for a in group}
    keys = [attempt_key(a) for a in attempts]
    valid = rate_by_keys(keys, [a.valid for a in attempts])
    schema = rate_by_request(tool_responses, [id(a) in schema_ok for a in tool_responses])
    n = len(attempts)
    return {
        "attempts": n, "distinct_requests": valid.clusters, "valid": valid.k, "valid_rate": valid.value,
        "valid_rate_ci95": [valid.low, valid.high],
        "failed_by_layer": {layer: layers.get(layer, 0) for layer in LAYERS},
        "failed_by_check": dict(sorted(primary.items())),
        "secondary_failures_by_check": dict(sorted(secondary.items())),
        "check_failure_rates": {check: rate_by_keys(keys, failing[check]).to_dict() for check in sorted(primary)},
        "tool_call_responses": len(tool_responses),
        "tool_call_schema_accuracy": schema.value, "tool_call_schema_accuracy_ci95":
            [schema.low, schema.high] if tool_responses else None,
        "tool_call_schema_distinct_requests": schema.clusters,
    }, valid


def _whole_finding(attempt: Any, check: str) -> Any:
    return first_finding(attempt.findings, check)


def _whole_failing(attempts: list[Any], check: str) -> list[Any]:
    """The attempts whose first finding of `check` failed (grouped by findings: `lean.by_findings`)."""
    return [a for findings, group in by_findings(attempts)
            if (f := first_finding(findings, check)) is not None and not f.ok for a in group]


def _whole_outcome(attempt: Any) -> str | None:
    found = _whole_finding(attempt, EQUIVALENCE)
    if found is None:
        return None
    return found.detail if found.ok else STREAM_PATH_WRONG


def _whole_stream_equivalence(attempts: list[Any], limits: dict[str, float], plan: Plan | None
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
        row[_whole_outcome(attempt) or NOT_COMPARED] += 1
    outcomes = {id(a): _whole_outcome(a) or NOT_COMPARED for a in streamed}
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


def _whole_distribution(values: list[float]) -> dict[str, float | int | None]:
    p50, p95 = percentiles(values, (0.5, 0.95))
    return {"n": len(values), "p50": p50, "p95": p95, "max": max(values) if values else None}


def _whole_cadence(attempts: list[Any], limits: dict[str, float]) -> tuple[dict[str, Any], RuleResult | None]:
    """Streamed tool calls: the span from the first tool-call delta to the arguments' end, the longest
    silence inside the call, the deltas per call; silences past the plan's limit and stalls that our
    deadline cut (each a finding on its attempt) with their rate."""
    calls = [a for a in attempts if a.tool_call_max_gap_ms is not None]
    limit = limits["max_tool_call_gap_ms"]
    over, stalls = _whole_failing(calls, "tool_call.cadence"), _whole_failing(attempts, "stream.stall")
    gaps = [a.tool_call_max_gap_ms for a in calls if a.tool_call_max_gap_ms is not None]  # every call's
    numbers: dict[str, Any] = {"limit_ms": limit, "streamed_tool_calls": len(calls),
               "span_ms": _whole_distribution([a.tool_call_span_ms for a in calls if a.tool_call_span_ms is not None]),
               "max_gap_ms": _whole_distribution(gaps),
               "deltas": _whole_distribution([float(a.tool_call_deltas) for a in calls if a.tool_call_deltas]),
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


def _whole_parallel_calls(attempts: list[Any]) -> dict[str, Any]:
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


def _whole_no_transition(attempts: list[Any]) -> tuple[dict[str, Any], str | None]:
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


def _whole_known_failures(attempts: list[Any], limits: dict[str, float], plan: Plan | None
                   ) -> tuple[dict[str, Any], list[RuleResult], list[str]]:
    """Every section's numbers, its rules and the reasons to say beside the valid rate."""
    equivalence, equivalence_rule = _whole_stream_equivalence(attempts, limits, plan)
    timing, cadence_rule = _whole_cadence(attempts, limits)
    transition, transition_reason = _whole_no_transition(attempts)
    numbers = {"stream_equivalence": equivalence, "tool_call_cadence": timing,
               "parallel_calls": _whole_parallel_calls(attempts), "no_transition": transition}
    rules = [r for r in (equivalence_rule, cadence_rule) if r is not None]
    reasons = [r.reason for r in rules if r.status != PASS]
    return numbers, rules, reasons + ([transition_reason] if transition_reason else [])


def _whole_tbs_rates(turns: list[Any]) -> dict[str, Rate]:
    expected = [bool(f.ok) if (f := first_finding(a.findings, "expect.tool_call")) else False for a in turns]
    return {"called": rate_by_request(turns, [triggered(a) for a in turns]),
            "called_expected": rate_by_request(turns, expected)}


def _whole_tbs_turns(attempts: list[Any]) -> set[tuple[str, int]]:
    return {(a.scenario, a.turn) for a in attempts}


def _whole_tbs_decided(rate: Rate) -> bool:
    return bool(rate.n) and too_few_requests(rate) is None


def _whole_trigger_by_stage(attempts: list[Any], plan: Plan | None) -> tuple[dict[str, Any], RuleResult | None]:
    """Per stage the two shares with their intervals and drops from the base; the rule (None: no tool-call turn,
    or no load stage to compare with)."""
    turns = [a for a in attempts if answered(a) and first_finding(a.findings, "expect.tool_call") is not None]
    stages = list(plan.stages) if plan else []
    order = [s.name for s in stages] + sorted({a.stage for a in turns} - {s.name for s in stages})
    users = {s.name: s.users for s in stages}
    kinds = {s.name: s.kind for s in stages}
    per_stage = {name: [a for a in turns if a.stage == name] for name in order}
    rates = {name: _whole_tbs_rates(group) for name, group in per_stage.items() if group}
    base = next((s.name for s in stages if s.kind == StageKind.LOAD and s.name in rates), None)
    changes: list[Change] = []
    rows: dict[str, dict[str, Any]] = {}
    for name, shares in rates.items():
        row: dict[str, Any] = {"kind": kinds.get(name), "users": users.get(name),
                               "tool_call_turns": len(per_stage[name]),
                               **{share: rate.to_dict() for share, rate in shares.items()}}
        # like for like: only the (scenario, turn) pairs both the stage and the base answered, so a stage playing
        # other families or another mix of turns is not read as load changing the model
        common = _whole_tbs_turns(per_stage[name]) & _whole_tbs_turns(per_stage[base]) \
            if base and name != base else set()
        mine = _whole_tbs_rates([a for a in per_stage[name] if (a.scenario, a.turn) in common]) if common else {}
        theirs = _whole_tbs_rates([a for a in per_stage[base] if (a.scenario, a.turn) in common]) \
            if common and base else {}
        row["compared_turns"] = len(common) if base and name != base else None
        for share in shares:
            value, interval = drop(theirs[share], mine[share]) if common else (None, None)
            row[f"{share}_drop"] = {"drop": value, "ci95": list(interval) if interval else None}
            if interval and (interval[0] > 0 or interval[1] < 0) and _whole_tbs_decided(mine[share]) \
                    and _whole_tbs_decided(theirs[share]):
                changes.append(Change(name, share, value or 0.0, *interval, mine[share], theirs[share]))
        rows[name] = row
    numbers = {"base_stage": base, "stages": rows, "changed_stages": list(dict.fromkeys(c.stage for c in changes))}
    if not turns or base is None:
        numbers["reason"] = ("no tool-call turn was answered" if not turns else
                             "no stage of kind load answered a tool-call turn: nothing to compare the stages with")
        return numbers, None
    return numbers, _trigger_rule(changes, rates, base, users)


@dataclass(frozen=True)
class Answer:
    """One chain's answer to a request that must repeat (as the whole reading kept it)."""

    request_sha256: str
    attempt_id: str
    stage: str
    send_ts: float
    signature: str
    scenario: str
    turn: int


def _difference(other: Answer, reference: Answer) -> Difference:
    return Difference(reference.request_sha256, reference.scenario, reference.turn, (reference.stage, other.stage),
                      (reference.attempt_id, other.attempt_id), what_differs(reference.signature, other.signature))


def _whole_repro_answers(attempts: Sequence[Any]) -> tuple[dict[str, list[Answer]], int]:
    """Per request that must repeat, one answer per chain (its first that completed), in send order."""
    firsts: dict[str, Any] = {}
    unread = 0
    for attempt in attempts:
        if attempt.status != "ok" or attempt.drill or not must_repeat(attempt):
            continue
        known = firsts.get(attempt.chain_id)
        if known is None or attempt.attempt < known.attempt:
            firsts[attempt.chain_id] = attempt
    by_request: dict[str, list[Answer]] = {}
    for attempt in sorted(firsts.values(), key=lambda a: (a.send_ts, a.attempt_id)):
        signature = signature_of(attempt)
        if signature is UNREAD:
            unread += 1
            continue
        if signature is None:
            continue
        by_request.setdefault(attempt.request_sha256, []).append(Answer(
            attempt.request_sha256, attempt.attempt_id, attempt.stage, attempt.send_ts, signature, attempt.scenario,
            attempt.turn))
    return by_request, unread


def _whole_reproducibility(attempts: Sequence[Any], users_by_stage: Mapping[str, int] | None = None
                    ) -> Reproducibility:
    """Every request that must repeat and was answered in two chains or more, compared (module docstring).
    `users_by_stage`: each stage's concurrency (the plan's users, in plan order), which orders the stages.

    A request's reference is its first answer at the lowest concurrency it was answered at; per stage, a
    request counts where it has an answer other than its reference, and agrees there when all of them are
    the reference's. Batch-dependent: every differing answer came at a stage with more users than the base (the
    lowest concurrency any compared answer came from), and the base agrees throughout."""
    users = dict(users_by_stage or {})
    by_request, unread = _whole_repro_answers(attempts)
    repeated = {k: v for k, v in by_request.items() if len(v) > 1}
    by_stage: dict[str, StageAgreement] = {}
    keys, flags, found = [], [], []
    for request, answers in repeated.items():
        reference = min(answers, key=lambda a: (users.get(a.stage, math.inf), a.send_ts))
        keys.append(request)
        flags.append(all(a.signature == reference.signature for a in answers))
        _whole_tally_stages(by_stage, users, reference, answers)
        found += [(other, reference) for other in answers if other.signature != reference.signature]
    found.sort(key=lambda pair: (pair[0].send_ts, pair[0].attempt_id))
    order = {name: i for i, name in enumerate(users)}
    ordered = dict(sorted(by_stage.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    # the base: the lowest concurrency any compared answer came from, references included (a request answered once
    # alone and once under load has its alone answer only as the reference: that stage has no row of its own)
    answered = {a.stage for answers in repeated.values() for a in answers}
    base = min(answered, key=lambda s: (users.get(s, math.inf), order.get(s, len(order)), s), default=None)
    batch = None
    if found and users and base is not None:
        quiet = base not in ordered or ordered[base].agreeing == ordered[base].repeated_requests
        # differences only under load: every differing answer came at more users than the base (two answers at 12
        # users that differ are two different batches too: batch-dependent, not the model)
        batch = quiet and all(users.get(other.stage, -1) > users.get(base, math.inf) for other, _ in found)
    differing = {other.stage for other, _ in found}
    return Reproducibility(rate_by_keys(keys, flags), sum(len(v) for v in repeated.values()), unread, ordered,
                           [_difference(other, reference) for other, reference in found[:FIRST_DIFFERENCES]],
                           base, batch, [s for s in ordered if s in differing], users.get(base) if base else None)


def _whole_tally_stages(by_stage: dict[str, StageAgreement], users: Mapping[str, int], reference: Answer,
                  answers: list[Answer]) -> None:
    for stage in dict.fromkeys(a.stage for a in answers if a is not reference):
        same = all(a.signature == reference.signature for a in answers if a.stage == stage and a is not reference)
        row = by_stage.setdefault(stage, StageAgreement(users.get(stage)))
        row.repeated_requests += 1
        row.agreeing += same
        row.keys.append(reference.request_sha256)
        row.flags.append(same)


# -- the agreement with a reference (analysis/pillars/agent/agreement.py), every answer read whole ----------
def answered(attempt: Any) -> bool:
    return attempt.status == "ok" and not attempt.drill and designed_body(attempt)


def triggered(attempt: Any) -> bool:
    return bool(attempt.tool_calls) or attempt.finish_reason == "tool_calls"


def tool_names(attempt: Any) -> list[str]:
    """The called tools' names, sorted (a parallel answer's calls as a multiset)."""
    return sorted(call_name(c) for c in attempt.tool_calls)


def schema_ok(attempt: Any) -> bool:
    """As the agent pillar counts schema accuracy: no failed `tool_call.*` finding."""
    return findings_schema_ok(attempt.findings)


def json_valid(attempt: Any) -> bool | None:
    """Structured output (`expect.json`) held; None when the turn asked for none."""
    found = first_finding(attempt.findings, "expect.json")
    return None if found is None else found.ok


def _whole_profile(attempts: list[Any]) -> dict[str, Any]:
    """The behaviour of a run per scenario and turn, and its overall rates, as plain JSON data (what
    reference.json keeps, so a run judged against a reference needs only its own directory)."""
    answers = [a for a in attempts if answered(a)]
    turns: dict[str, dict[str, Any]] = {}
    names: dict[str, Counter[tuple[str, ...]]] = {}
    for a in sorted(answers, key=lambda a: (a.scenario, a.turn)):
        row = turns.setdefault(_key(a.scenario, a.turn), {"scenario": a.scenario, "turn": a.turn, "answers": 0,
                                                          "triggered": 0})
        row["answers"] += 1
        if triggered(a):
            row["triggered"] += 1
            names.setdefault(_key(a.scenario, a.turn), Counter())[tuple(tool_names(a))] += 1
    for key, row in turns.items():
        row["label"] = _label(row["answers"], row["triggered"])
        common = sorted((names.get(key) or Counter()).items(), key=lambda kv: (-kv[1], kv[0]))
        row["tool_names"] = list(common[0][0]) if common else None
    calls = [a for a in answers if triggered(a)]
    structured = [v for v in (json_valid(a) for a in answers) if v is not None]
    return {"answers": len(answers), "turns": [turns[k] for k in sorted(turns)],
            "schema": {"k": sum(schema_ok(a) for a in calls), "n": len(calls)},
            "structured_output": {"k": sum(structured), "n": len(structured)},
            "finish_reasons": dict(sorted(Counter(str(a.finish_reason) for a in answers).items()))}


def _whole_tally(turns: dict[str, dict[str, Any]], answers: list[Any], scored: list[tuple[Any, str]]
           ) -> tuple[dict[str, dict[str, Any]], Counter[str], Counter[str], Counter[str]]:
    """Each answer scored against its turn's label: rows per turn, totals (tp/fp/fn/tn, not_comparable),
    the primary layers of the disagreeing answers, and the tool-name checks of the agreeing calls."""
    rows: dict[str, dict[str, Any]] = {}
    totals = Counter[str]()
    layers = Counter[str]()
    names = Counter[str]()
    for a in sorted(answers, key=lambda a: (a.scenario, a.turn)):
        ref = turns.get(_key(a.scenario, a.turn))
        if ref is None or ref["label"] is None:
            totals["not_comparable"] += 1
            continue
        row = rows.setdefault(_key(a.scenario, a.turn), {
            "scenario": a.scenario, "turn": a.turn, "reference_label": ref["label"],
            "reference_triggered": ref["triggered"], "reference_answers": ref["answers"], "answers": 0,
            "triggered": 0, "tp": 0, "fp": 0, "fn": 0, "tn": 0, "names_same": 0, "names_compared": 0})
        hit, want = triggered(a), ref["label"] == TOOL_CALL
        outcome = ("tp" if want else "fp") if hit else ("fn" if want else "tn")
        row["answers"] += 1
        row["triggered"] += hit
        row[outcome] += 1
        totals[outcome] += 1
        scored.append((a, outcome))  # each comparable answer's outcome, for the intervals over distinct requests
        if outcome in ("fp", "fn"):
            layers[a.primary_layer or MODEL_OUTPUT] += 1
        if outcome == "tp" and ref.get("tool_names") is not None:
            same = tool_names(a) == list(ref["tool_names"])
            row["names_same"] += same
            row["names_compared"] += 1
            names["same"] += same
            names["compared"] += 1
    return rows, totals, layers, names


def _whole_agreement(reference: dict[str, Any], attempts: list[Any]) -> dict[str, Any]:
    """The judged run's answers against the reference profile (module docstring for the definitions)."""
    turns = {_key(t["scenario"], t["turn"]): t for t in reference.get("turns") or []}
    answers = [a for a in attempts if answered(a)]
    scored: list[tuple[Any, str]] = []
    rows, totals, layers, _names = _whole_tally(turns, answers, scored)  # names: counted per turn in rows
    tp, fp, fn, tn = (totals[k] for k in ("tp", "fp", "fn", "tn"))
    f1, f1_ci = f1_interval(tp, fp, fn, _whole_among(scored, ("tp", "fp", "fn")))

    def share(among: tuple[str, ...]) -> Rate:  # tp among the answers with these outcomes, by distinct request
        return _whole_among(scored, among) if any(o in among for _, o in scored) else wilson(0, 0)
    for row in rows.values():
        mine = [(a, o) for a, o in scored if a.scenario == row["scenario"] and a.turn == row["turn"]]
        row["recall"] = _whole_among(mine, ("tp", "fn")).to_dict() if row["tp"] + row["fn"] else None
    calls = [a for a in answers if triggered(a)]
    judged = [(a, v) for a, v in ((a, json_valid(a)) for a in answers) if v is not None]
    named = [(a, tool_names(a) == list(want)) for a, o in scored if o == "tp"
             and (want := turns[_key(a.scenario, a.turn)].get("tool_names")) is not None]
    return {
        "comparable": tp + fp + fn + tn, "not_comparable": totals["not_comparable"],
        "trigger": {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "precision": share(("tp", "fp")).to_dict(),
                    "recall": share(("tp", "fn")).to_dict(), "f1": f1, "f1_ci95": list(f1_ci) if f1_ci else None},
        "disagreeing_by_layer": dict(sorted(layers.items())),
        "tool_name_agreement": rate_by_request([a for a, _ in named], [same for _, same in named]).to_dict(),
        "schema_accuracy": _compared(_rate(reference.get("schema")),
                                     rate_by_request(calls, [schema_ok(a) for a in calls])),
        "structured_output_validity": _compared(_rate(reference.get("structured_output")),
                                                rate_by_request([a for a, _ in judged], [v for _, v in judged])),
        "finish_reasons": {"reference": _mix(reference.get("finish_reasons") or {}),
                           "run": _mix(dict(Counter(str(a.finish_reason) for a in answers)))},
        "by_turn": [rows[k] for k in sorted(rows)],
    }


def _whole_among(scored: list[tuple[Any, str]], among: tuple[str, ...]) -> Rate:
    """The share of true positives among the answers scored one of `among`, by distinct request."""
    picked = [(a, o) for a, o in scored if o in among]
    return rate_by_request([a for a, _ in picked], [o == "tp" for _, o in picked])


# -- the retry paths (analysis/pillars/agent/retry_paths.py), every attempt read whole ------------------------
def _whole_path_counts(attempts: Sequence[Any]) -> dict[str, Any]:
    """`path_counts` over these attempts, every one read whole."""
    counts: dict[str, Any] = {p: {"attempts": 0, "valid": 0, "drill": 0} for p in PATHS}
    later = [a for a in attempts if a.attempt > 1]
    first_tries = counts[AttemptPath.FIRST_TRY.value]
    first_tries["attempts"] = len(attempts) - len(later)
    first_tries["valid"] = sum(1 for a in attempts if a.valid and a.attempt == 1)
    first_tries["drill"] = sum(1 for a in attempts if a.drill and a.attempt == 1)
    chains = {a.chain_id for a in later}
    first = {a.chain_id: a.request_sha256 for a in attempts if a.attempt == 1 and a.chain_id in chains} \
        if later else {}
    last: dict[str, Any] = {}
    for attempt in later:
        path = path_of(attempt, first.get(attempt.chain_id))
        _tally(counts[path], (attempt,))
        if attempt.attempt > getattr(last.get(attempt.chain_id), "attempt", 0):
            last[attempt.chain_id] = attempt
    counts["retried_unrecovered"] = sum(
        1 for a in last.values()
        if not a.valid and not a.will_retry and path_of(a, first.get(a.chain_id)) == AttemptPath.RETRY.value)
    return counts


def path_of(attempt: Any, first_sha256: str | None) -> str:
    """The attempt's path: its record's `path`, else read from its number and bytes (module docstring)."""
    recorded = getattr(attempt, "path", None)
    if recorded in PATHS:
        return str(recorded)
    if attempt.attempt == 1:
        return AttemptPath.FIRST_TRY.value
    same = first_sha256 is None or attempt.request_sha256 == first_sha256
    return AttemptPath.RETRY.value if same else AttemptPath.FALLBACK.value


def _tally(row: dict[str, int], attempts: Iterable[Any]) -> None:
    for attempt in attempts:
        row["attempts"] += 1
        row["valid"] += bool(attempt.valid)
        row["drill"] += bool(attempt.drill)
