"""Validation rates per scenario, turn kind and stage, from `records.jsonl.gz` (or an older run's `records.jsonl`).

Why rates: one successful demo is not evidence. Every attempt counts (retries included); an attempt
is `valid` only when every check passed, and each failure is counted under the layer it points to.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from k3load.evidence import records_file
from k3load.outcomes import HARNESS_ERROR, LAYERS
from k3load.records import Attempt, iter_records
from k3load.workload.harness_error import kind_of

KINDS_SAID = 5  # harness-error kinds printed at the run's end; the rest summed in one line


class _Group:
    """One group's counts, fed an attempt at a time (the validation summary never holds a day's records)."""

    def __init__(self) -> None:
        self.attempts = self.valid = self.retries = self.drills = 0
        self.layers: Counter[str] = Counter()
        self.checks: Counter[str] = Counter()

    def add(self, attempt: Attempt) -> None:
        if attempt.drill:  # a drill's timeout is its purpose, not a failure
            self.drills += 1
            return
        self.attempts += 1
        self.valid += bool(attempt.valid)
        self.retries += attempt.attempt > 1
        if attempt.primary_layer:
            self.layers[attempt.primary_layer] += 1  # each failure counted once
        self.checks.update(f.check for f in attempt.findings if not f.ok)

    def to_dict(self) -> dict[str, Any]:
        return {"attempts": self.attempts, "valid": self.valid,
                "valid_rate": self.valid / self.attempts if self.attempts else None,
                "failed_by_layer": {layer: self.layers.get(layer, 0) for layer in LAYERS},
                "failed_by_check": dict(sorted(self.checks.items())),
                "retries": self.retries, "timeout_drills": self.drills}


class _Unjudged:
    """Answers the harness could not judge (a `harness.error` finding), counted by kind as they come."""

    def __init__(self) -> None:
        self.kinds: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    def add(self, attempt: Attempt) -> None:
        detail = next((f.detail for f in attempt.findings if f.check == HARNESS_ERROR), None)
        if detail is not None:
            self.kinds[kind_of(detail)] += 1
            self.first.setdefault(kind_of(detail), attempt.attempt_id)

    def to_dict(self) -> dict[str, Any]:
        ranked = dict(sorted(self.kinds.items(), key=lambda kv: (-kv[1], kv[0])))
        return {"answers": sum(self.kinds.values()), "by_kind": ranked,
                "first_attempt": {k: self.first[k] for k in ranked}}


GROUPED_BY = ("scenario", "turn_kind", "stage", "family")


def summarise(records_path: Path) -> dict[str, Any]:
    """Per group (all, and by scenario, turn kind, stage and family) the counts, read a record at a time."""
    everything, found = _Group(), _Unjudged()
    groups: dict[str, dict[str, _Group]] = {key: defaultdict(_Group) for key in GROUPED_BY}
    for attempt in iter_records(records_path) if records_path.exists() else ():
        everything.add(attempt)
        found.add(attempt)
        for key in GROUPED_BY:
            groups[key][str(getattr(attempt, key))].add(attempt)
    out: dict[str, Any] = {"all": everything.to_dict()}
    for key in GROUPED_BY:
        out[f"by_{key}"] = {name: group.to_dict() for name, group in sorted(groups[key].items())}
    out["unjudged"] = found.to_dict()
    return out


def unjudged(attempts: Iterable[Attempt]) -> dict[str, Any]:
    """Answers the harness could not judge (a `harness.error` finding): {answers, by_kind: {kind: n} most
    frequent first, first_attempt: {kind: attempt_id}}."""
    found = _Unjudged()
    for attempt in attempts:
        found.add(attempt)
    return found.to_dict()


def unjudged_lines(found: dict[str, Any], run_dir: Path) -> list[str]:
    """The run's-end count: one line per kind (at most KINDS_SAID, the rest summed), where the details are."""
    if not found or not found.get("answers"):
        return []
    n = found["answers"]
    lines = [f"k3load: the harness could not judge {n:,} answer{'s' if n != 1 else ''} (recorded as received with a "
             f"harness.error finding; the verdict stays inconclusive until none): see {run_dir / 'events.jsonl'}"]
    kinds = list(found["by_kind"].items())
    for kind, count in kinds[:KINDS_SAID]:
        lines.append(f"  {count:,} answer{'s' if count != 1 else ''}: {kind}; first at attempt "
                     f"{found['first_attempt'][kind][:8]}…")
    if len(kinds) > KINDS_SAID:
        rest = sum(count for _, count in kinds[KINDS_SAID:])
        lines.append(f"  {rest:,} more in {len(kinds) - KINDS_SAID} other kinds")
    return lines


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    everything = summary["all"]
    drills = everything.get("timeout_drills") or 0
    counted = f" (and {drills} timeout drills, counted apart: their timeout is their purpose)" if drills else ""
    lines = [f"k3load: {everything['attempts']} attempts recorded in {records_file(run_dir)}{counted}"]
    for name, group in summary["by_scenario"].items():
        rate = group["valid_rate"]
        failed = ", ".join(f"{k} {v}" for k, v in group["failed_by_layer"].items() if v) or "none failed"
        drills = f", {group['timeout_drills']} timeout drills" if group["timeout_drills"] else ""
        valid = f"valid {rate:6.1%}" if rate is not None else "valid    –  "
        lines.append(f"  {name:28s} {group['attempts']:5d} attempts, {valid}  ({failed}{drills})")
    return "\n".join(lines + unjudged_lines(summary.get("unjudged") or {}, run_dir))
