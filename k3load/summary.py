"""Validation rates per scenario, turn kind and stage, from `records.jsonl.gz` (or an older run's `records.jsonl`).

Why rates: one successful demo is not evidence. Every attempt counts (retries included); an attempt
is `valid` only when every check passed, and each failure is counted under the layer it points to.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from k3load.evidence import records_file
from k3load.outcomes import LAYERS
from k3load.records import Attempt, read_records


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
    return out


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    lines = [f"k3load: {summary['all']['attempts']} attempts recorded in {records_file(run_dir)}"]
    for name, group in summary["by_scenario"].items():
        rate = group["valid_rate"]
        failed = ", ".join(f"{k} {v}" for k, v in group["failed_by_layer"].items() if v) or "none failed"
        drills = f", {group['timeout_drills']} timeout drills" if group["timeout_drills"] else ""
        valid = f"valid {rate:6.1%}" if rate is not None else "valid    –  "
        lines.append(f"  {name:28s} {group['attempts']:5d} attempts, {valid}  ({failed}{drills})")
    return "\n".join(lines)
