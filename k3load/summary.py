"""Validation rates per scenario, turn kind and stage, from `records.jsonl.gz` (or an older run's `records.jsonl`).

Why rates: one successful demo is not evidence. Every attempt counts (retries included); an attempt
is `valid` only when every check passed, and each failure is counted under the layer it points to.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from k3load.evidence import records_file
from k3load.outcomes import HARNESS_ERROR, LAYERS
from k3load.records import Attempt, read_records
from k3load.workload.harness_error import kind_of

KINDS_SAID = 5  # harness-error kinds printed at the run's end; the rest summed in one line


def _group(all_attempts: list[Attempt]) -> dict[str, Any]:
    attempts = [a for a in all_attempts if not a.drill]  # a drill's timeout is its purpose, not a failure
    layers = Counter(a.primary_layer for a in attempts if a.primary_layer)  # each failure counted once
    checks = Counter(f.check for a in attempts for f in a.findings if not f.ok)
    valid = sum(a.valid for a in attempts)
    return {"attempts": len(attempts), "valid": valid, "valid_rate": valid / len(attempts) if attempts else None,
            "failed_by_layer": {layer: layers.get(layer, 0) for layer in LAYERS},
            "failed_by_check": dict(sorted(checks.items())),
            "retries": sum(a.attempt > 1 for a in attempts),
            "timeout_drills": len(all_attempts) - len(attempts)}


def summarise(records_path: Path) -> dict[str, Any]:
    attempts = read_records(records_path) if records_path.exists() else []
    out: dict[str, Any] = {"all": _group(attempts)}
    for key in ("scenario", "turn_kind", "stage", "family"):
        groups: dict[str, list[Attempt]] = defaultdict(list)
        for attempt in attempts:
            groups[str(getattr(attempt, key))].append(attempt)
        out[f"by_{key}"] = {name: _group(group) for name, group in sorted(groups.items())}
    out["unjudged"] = unjudged(attempts)
    return out


def unjudged(attempts: list[Attempt]) -> dict[str, Any]:
    """Answers the harness could not judge (a `harness.error` finding): {answers, by_kind: {kind: n} most
    frequent first, first_attempt: {kind: attempt_id}}."""
    kinds: Counter[str] = Counter()
    first: dict[str, str] = {}
    for attempt in attempts:
        detail = next((f.detail for f in attempt.findings if f.check == HARNESS_ERROR), None)
        if detail is not None:
            kinds[kind_of(detail)] += 1
            first.setdefault(kind_of(detail), attempt.attempt_id)
    ranked = dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    return {"answers": sum(kinds.values()), "by_kind": ranked, "first_attempt": {k: first[k] for k in ranked}}


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
