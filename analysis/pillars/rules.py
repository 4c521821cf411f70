"""A rule's outcome as typed data: what was measured, against which limit, on which evidence.

Why typed: the verdict, the ramp ("what ran out first") and the reports decide on a rule's `id` and
`signal`, never on its English wording, so rewording a reason cannot change a verdict. Every rule
names the evidence it read (file and selector); where that evidence is missing or broken, the rule is
`inconclusive` and its reason says why, never `pass` or `fail` (the one exception: the compat rules whose
missing record the seed names as a reason to rebuild, docs/verdict-rules.md "Missing evidence, rule by rule").

Signals (what kind of trouble a breach is evidence of) decide between `scale_up` and `limited`:
`resource` (KV at its limit, sustained waiting, preemptions, GPU memory, an OOM), `queue_latency`
(latency over its SLO while requests queued: it grows with the queue), `latency` (over the SLO with no
queue), `errors` (failed requests, attributed by layer), `stability` (the server went down without
memory evidence).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from k3load.analysis.pillars.limit_rules import RuleId
from k3load.outcomes import FAIL, Pillar, Signal

RESOURCE_SIGNALS = (Signal.RESOURCE, Signal.QUEUE_LATENCY)


@dataclass(frozen=True)
class RuleResult:
    """One rule applied once: `status` is pass / fail / inconclusive."""

    id: str
    pillar: str
    status: str
    reason: str
    measured: Any = None
    limit: Any = None
    signal: str | None = None
    evidence: tuple[str, ...] = field(default_factory=tuple)
    interval: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the vocabulary's members as the plain strings they equal (verdict.json byte for byte)."""
        out = asdict(self)
        for key in ("id", "pillar", "status", "signal"):
            out[key] = None if out[key] is None else str(out[key])
        out["evidence"] = list(self.evidence)
        out["interval"] = list(self.interval) if self.interval else None
        return out


@dataclass(frozen=True)
class Breach:
    """A stage limit exceeded (analysis/pillars/limit_rules.py declares each rule id): typed while the stage is
    judged and in its StageRow (analysis/pillars/headroom/stage_row.py), plain data (`to_dict`, a failed resources
    RuleResult) where the row is (`StageRow.to_dict`)."""

    id: RuleId
    signal: Signal
    measured: Any
    limit: Any
    reason: str
    evidence: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return RuleResult(self.id, Pillar.RESOURCES, FAIL, self.reason, self.measured, self.limit, self.signal,
                          self.evidence).to_dict()


def breach(rule_id: RuleId, signal: Signal, measured: Any, limit: Any, reason: str, *evidence: str) -> Breach:
    """A stage limit exceeded, typed (`.to_dict()` where the stage table carries it: it goes into verdict.json)."""
    return Breach(rule_id, signal, measured, limit, reason, evidence)
