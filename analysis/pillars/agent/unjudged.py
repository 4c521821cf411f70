"""Answers the harness could not judge: counted apart, named by kind, and the agent pillar held inconclusive.

Why: an exception of ours while an answer was read, validated or recorded leaves its record as received with a
`harness.error` finding (k3load.workload.harness_error). Such an answer says nothing about the server: read as
invalid it would blame the server for our bug, read as valid it would pass what nobody checked. So the agent
pillar judges the others only, and the rule `agent.harness_errors` says "inconclusive, because the harness
could not judge N answers (...)" until there are none. A failure measured on the answers that were judged
still fails the pillar, except a valid rate that those N answers, were they all valid, would carry over its
threshold (analysis/pillars/agent/pillar_agent.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.lean import AnyAttempt
from k3load.outcomes import HARNESS_ERROR, INCONCLUSIVE, Pillar
from k3load.records import Finding
from k3load.workload.harness_error import kind_of

PILLAR = Pillar.AGENT_API  # the pillar these rules judge

KINDS_KEPT = 10  # in verdict.json; the rest summed as "other kinds"
KINDS_SAID = 3  # in the reason


def has_harness_error(findings: Sequence[Finding]) -> bool:
    """Whether a record's findings hold the harness's own `harness.error`: an answer it could not judge."""
    return any(f.check == HARNESS_ERROR for f in findings)


def numbers(unjudged: list[AnyAttempt]) -> dict[str, Any]:
    """{answers, by_kind: {kind: n} most frequent first (KINDS_KEPT kept, the rest as `other kinds`),
    first_attempt: {kind: attempt_id}}."""
    kinds: Counter[str] = Counter()
    first: dict[str, str] = {}
    for attempt in sorted(unjudged, key=lambda a: a.send_ts):
        kind = next((kind_of(f.detail) for f in attempt.findings if f.check == HARNESS_ERROR), "unknown")
        kinds[kind] += 1
        first.setdefault(kind, attempt.attempt_id)
    ranked = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = dict(ranked[:KINDS_KEPT])
    rest = sum(n for _, n in ranked[KINDS_KEPT:])
    if rest:
        kept["other kinds"] = rest
    return {"answers": len(unjudged), "by_kind": kept, "first_attempt": {k: first[k] for k in kept if k in first}}


def rule(counts: dict[str, Any]) -> RuleResult:
    """`agent.harness_errors`: inconclusive while the harness could not judge some answers."""
    n = counts["answers"]
    kinds = list(counts["by_kind"].items())
    said = "; ".join(f"{kind} x{count:,}" for kind, count in kinds[:KINDS_SAID])
    more = len(kinds) - KINDS_SAID
    said += f"; and {more} more kind{'s' if more > 1 else ''}" if more > 0 else ""
    first = next(iter(counts["first_attempt"].values()), None)
    where = f", the first in attempt {first}" if first else ""
    answers = f"{n:,} answer{'s' if n != 1 else ''}"
    return RuleResult("agent.harness_errors", PILLAR, INCONCLUSIVE,
                      f"inconclusive, because the harness could not judge {answers} ({said}): they count neither as "
                      "valid nor as the server's failures; each is recorded as received with a harness.error "
                      f"finding{where}", n, 0, evidence=("records.jsonl (harness.error findings)",))
