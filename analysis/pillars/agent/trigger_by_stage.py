"""The tool-call trigger rate per stage, against the first load stage: does load change what the model does?

Why: `k3load diff` compares the trigger rate across runs (analysis/pillars/agent/agreement.py); within one run nothing
said
whether the model, or the parser in front of it, calls tools less often at 12 concurrent streams than at the
plan's first load. An agent that stops calling its tools under load breaks without a malformed byte.

What is counted, per stage: the tool-call turns answered (status ok, no drill, the scenario's designed body:
`agreement.answered`; a turn is a tool-call turn when its answer was checked against `expect.tool_call`, the
finding every `turn_kind: tool_call` answer carries), the share that called a tool (`agreement.triggered`: calls,
or finish_reason tool_calls) and the share that called an expected one (the `expect.tool_call` finding held:
a call, and only tools the turn allows). Each share's interval is over the distinct requests
(analysis/run/clusters.py). The base is the plan's first stage of kind `load` (without one, nothing is compared).

The comparison: each share's drop from the base with Newcombe's hybrid score interval (`agreement.drop`, the
reference comparison's own). A stage whose drop's interval lies above 0, both sides over at least
MIN_DISTINCT_REQUESTS distinct requests, is a stage where load changed what the model does (each stage is
compared on the (scenario, turn) pairs both it and the base answered: like for like): named, and the
pillar fails (`agent.trigger_by_stage`); a significant rise is named, never a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from k3load.analysis.pillars.agent.agreement import answered, drop, triggered
from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.clusters import cluster_codes, rate_by_codes
from k3load.analysis.run.lean import first_finding
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.stats import Rate, too_few_requests
from k3load.outcomes import FAIL, PASS, Pillar
from k3load.workload.plan import Plan
from k3load.workload.stage_kind import StageKind

PILLAR = Pillar.AGENT_API  # the pillar these rules judge

RULE = "agent.trigger_by_stage"
SHARES = ("called", "called_expected")
EVIDENCE = ("records.jsonl tool_calls, finish_reason, findings expect.tool_call",)


@dataclass(frozen=True)
class Change:
    """One share of one stage against the base: the drop (base - stage) and its interval."""

    stage: str
    share: str
    drop: float
    low: float
    high: float
    now: Rate  # the stage's share over the turns it has in common with the base
    then: Rate  # the base's share over the same turns


def _rates(turns: Rows) -> dict[str, Rate]:
    clusters = cluster_codes(turns)
    expected = turns.code_where("findings", lambda findings: bool(getattr(first_finding(findings, "expect.tool_call"),
                                                                          "ok", False)))
    called = triggered(turns)
    return {"called": rate_by_codes(clusters, called), "called_expected": rate_by_codes(clusters, expected)}


def _decided(rate: Rate) -> bool:
    return bool(rate.n) and too_few_requests(rate) is None


def trigger_by_stage(rows: Rows, plan: Plan | None) -> tuple[dict[str, Any], RuleResult | None]:
    """Per stage the two shares with their intervals and drops from the base; the rule (None: no tool-call turn,
    or no load stage to compare with). On the record columns; a (scenario, turn) pair is its scenario's code and
    its turn's number."""
    tool_turn = rows.code_where("findings", lambda findings: first_finding(findings, "expect.tool_call") is not None)
    turns = rows[answered(rows) & tool_turn]
    stages = list(plan.stages) if plan else []
    seen = turns.seen("stage")
    order = [s.name for s in stages] + sorted(set(seen) - {s.name for s in stages})
    users = {s.name: s.users for s in stages}
    kinds = {s.name: s.kind for s in stages}
    _, pair = np.unique(np.stack([turns.ints("scenario").astype(np.int64), turns.ints("turn")], axis=1), axis=0,
                        return_inverse=True) if len(turns) else (None, np.empty(0, dtype=np.intp))
    pair = pair.reshape(-1)
    per_stage = {name: turns.code_is("stage", name) for name in order}
    rates = {name: _rates(turns[mask]) for name, mask in per_stage.items() if mask.any()}
    base = next((s.name for s in stages if s.kind == StageKind.LOAD and s.name in rates), None)
    changes: list[Change] = []
    out: dict[str, dict[str, Any]] = {}
    for name, shares in rates.items():
        row: dict[str, Any] = {"kind": kinds.get(name), "users": users.get(name),
                               "tool_call_turns": int(per_stage[name].sum()),
                               **{share: rate.to_dict() for share, rate in shares.items()}}
        # like for like: only the (scenario, turn) pairs both the stage and the base answered, so a stage playing
        # other families or another mix of turns is not read as load changing the model
        compared = bool(base) and name != base
        common = np.intersect1d(pair[per_stage[name]], pair[per_stage[base]]) if compared and base else pair[:0]
        alike = np.isin(pair, common)
        mine = _rates(turns[per_stage[name] & alike]) if len(common) else {}
        theirs = _rates(turns[per_stage[base] & alike]) if len(common) and base else {}
        row["compared_turns"] = len(common) if compared else None
        for share in shares:
            value, interval = drop(theirs[share], mine[share]) if len(common) else (None, None)
            row[f"{share}_drop"] = {"drop": value, "ci95": list(interval) if interval else None}
            if interval and (interval[0] > 0 or interval[1] < 0) and _decided(mine[share]) \
                    and _decided(theirs[share]):
                changes.append(Change(name, share, value or 0.0, *interval, mine[share], theirs[share]))
        out[name] = row
    numbers = {"base_stage": base, "stages": out, "changed_stages": list(dict.fromkeys(c.stage for c in changes))}
    if not len(turns) or base is None:
        numbers["reason"] = ("no tool-call turn was answered" if not len(turns) else
                             "no stage of kind load answered a tool-call turn: nothing to compare the stages with")
        return numbers, None
    return numbers, _rule(changes, rates, base, users)


def _rule(changes: list[Change], rates: dict[str, dict[str, Rate]], base: str, users: dict[str, int]) -> RuleResult:
    drops = [c for c in changes if c.drop > 0]
    rises = [c for c in changes if c.drop < 0]
    if not changes:
        return RuleResult(RULE, PILLAR, PASS, f"tool-call trigger rate per stage: no stage differed from {base} "
                          "beyond chance (the drops' 95% intervals all include 0)", evidence=EVIDENCE)
    said = "; ".join(_change(c, base, users) for c in (*drops, *rises))
    if drops:
        text = (f"load changes what the model does: tool-call turns called tools less often than at {base} "
                f"({users.get(base)} users): {said}")
        worst = max(drops, key=lambda c: c.drop)
        return RuleResult(RULE, PILLAR, FAIL, text, worst.drop, 0.0, evidence=EVIDENCE,
                          interval=(worst.low, worst.high))
    return RuleResult(RULE, PILLAR, PASS, f"tool-call trigger rate rose under load against {base}: {said}",
                      evidence=EVIDENCE)


def _change(c: Change, base: str, users: dict[str, int]) -> str:
    what = "called a tool" if c.share == "called" else "called an expected tool"
    now, then = c.now, c.then
    return (f"{c.stage} ({users.get(c.stage)} users) {what} {now.value:.1%} against {then.value:.1%} at {base} on "
            f"the turns both played (drop {c.drop:.1%}, 95% CI {c.low:.1%} to {c.high:.1%}, {now.clusters} and "
            f"{then.clusters} distinct requests)")
