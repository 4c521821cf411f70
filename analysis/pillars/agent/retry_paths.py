"""How each attempt came to be sent (first try, retry, fallback) and how each path ended: the evidence of the
checklist's "Retry and API fallback behaviour" line and of the report's "Retries and fallbacks" section.

Usage: `path_counts(data)` -> `{"first_try": {"attempts", "valid", "drill"}, "retry": {...},
"fallback": {...}, "retried_unrecovered": N}`; `checklist_line(counts, drill)` -> (ticked, detail).

A record's `path` says its path (k3load.workload.retry_policy.AttemptPath; the judgment's lean records keep
it). Older records lack it, so where it is absent the path is read from the chain: attempt 1 is the first
try, a later attempt that sent the first try's bytes (the same `request_sha256`) a retry, one that sent other
bytes the fallback (its body is the first try's with the fallback's settings). A `model` fallback naming the
run's own model sends the same bytes and reads as a retry there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from k3load.analysis.run.rundata import RunData
from k3load.workload.retry_policy import AttemptPath

PATHS = tuple(p.value for p in AttemptPath)


def path_counts(data: RunData) -> dict[str, Any]:
    """Per path: its attempts, how many were valid, and how many were the timeout drill's (a deliberately short
    deadline: they fail on purpose). `retried_unrecovered`: requests retried whose last attempt (not cut by the
    run's end) was a failed retry, with no fallback after it.

    Read whole: every attempt not numbered 1 and the first tries of their chains (few); every other first try
    only counted, on the record columns (its `valid` counted where it is true)."""
    rows = data.columns.rows()
    first_try = rows.ints("attempt") == 1
    later_chains = rows[~first_try].keys("chain_id")
    read = ~first_try | rows.key_in("chain_id", later_chains)
    counts = _path_counts(data.pick(rows[read]))
    counted = rows[~read]  # first tries of chains never retried
    first_tries = counts[AttemptPath.FIRST_TRY.value]
    first_tries["attempts"] += len(counted)
    first_tries["valid"] += int(counted.flag("valid").sum())
    first_tries["drill"] += int(counted.flag("drill").sum())
    return counts


def _path_counts(attempts: Sequence[Any]) -> dict[str, Any]:
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


def said(counts: dict[str, Any]) -> str:
    """`first tries 120 (118 valid), retries 4 (2 valid), fallbacks 2 (2 valid)`."""
    names = {"first_try": "first tries", "retry": "retries", "fallback": "fallbacks"}
    return ", ".join(f"{names[p]} {counts[p]['attempts']} ({counts[p]['valid']} valid)" for p in PATHS)


def checklist_line(counts: dict[str, Any], drill: dict[str, Any]) -> tuple[bool, str]:
    """The seed's "Retry and API fallback behaviour": ticked only when a retry and a fallback were both
    exercised and each ended in a valid answer at least once; open otherwise, saying why. `drill`: the agent
    pillar's `timeout_drill` numbers, said beside."""
    retry, fallback = counts[AttemptPath.RETRY.value], counts[AttemptPath.FALLBACK.value]
    why: list[str] = []
    if not retry["attempts"]:
        why.append("inconclusive, because no request was retried" + (
            "" if fallback["attempts"] else ", so neither a retry nor a fallback was exercised"))
    elif not retry["valid"]:
        why.append(f"not proven, because none of the {retry['attempts']} retries ended in a valid answer")
    if retry["attempts"] and not fallback["attempts"]:
        unrecovered = counts.get("retried_unrecovered", 0)
        why.append(f"inconclusive, because no fallback was sent: {unrecovered} retried request(s) ended without a "
                   "valid answer and none fell back (a turn falls back only where it declares `fallback:`)"
                   if unrecovered else "inconclusive, because no turn exhausted its retries, so the fallback was "
                   "never exercised: a turn's `fallback:` with `retry.first_timeout_attempts` equal to its "
                   "`max_attempts` drills it, as scenarios/agent_timeout_retry.yaml does")
    elif fallback["attempts"] and not fallback["valid"]:
        why.append(f"not proven, because none of the {fallback['attempts']} fallbacks ended in a valid answer")
    detail = f"{said(counts)}; timeout drill: {drill.get('timed_out', 0)} timed out, {drill.get('recovered', 0)} " \
             "recovered"
    return not why, "; ".join([*why, detail])
