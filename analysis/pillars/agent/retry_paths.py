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

from typing import Any

import numpy as np

from k3load.analysis.run.record_columns import group_of
from k3load.analysis.run.rundata import RunData
from k3load.workload.retry_policy import AttemptPath

PATHS = tuple(p.value for p in AttemptPath)


def path_counts(data: RunData) -> dict[str, Any]:
    """Per path: its attempts, how many were valid, and how many were the timeout drill's (a deliberately short
    deadline: they fail on purpose). `retried_unrecovered`: requests retried whose last attempt (not cut by the
    run's end) was a failed retry, with no fallback after it.

    On the record columns: every first try counted; each later attempt (numbered above 1, few) given its path,
    its chain's first try (the last numbered 1, in file order) named by its bytes' code."""
    rows = data.columns.rows()
    number, valid, drill = rows.ints("attempt"), rows.flag("valid"), rows.flag("drill")
    counts: dict[str, Any] = {p: {"attempts": 0, "valid": 0, "drill": 0} for p in PATHS}
    later = number > 1
    first_try, first_tries = number == 1, counts[AttemptPath.FIRST_TRY.value]
    first_tries["attempts"] = int(np.count_nonzero(~later))
    first_tries["valid"] = int(np.count_nonzero(valid & first_try))
    first_tries["drill"] = int(np.count_nonzero(drill & first_try))
    if not later.any():
        counts["retried_unrecovered"] = 0
        return counts
    chains, chain = group_of(rows.keys("chain_id"))  # rows without a chain id: one chain, as a dict keyed by it
    retried = np.zeros(chains, dtype=bool)
    retried[chain[later]] = True
    sha, shas = rows.ints("request_sha256"), rows.table("request_sha256")
    firsts = np.flatnonzero(first_try & retried[chain])
    first_of: dict[int, int] = dict(zip(chain[firsts].tolist(), sha[firsts].tolist(), strict=True))  # last wins
    recorded, recorded_paths = rows.ints("path"), rows.table("path")
    will_retry = rows.flag("will_retry")

    def path(i: int) -> str:  # path_of on the columns (the row numbered above 1)
        value = recorded_paths[recorded[i]]
        if value in PATHS:
            return str(value)
        first = first_of.get(int(chain[i]))
        same = first is None or shas[first] is None or sha[i] == first
        return AttemptPath.RETRY.value if same else AttemptPath.FALLBACK.value

    last: dict[int, int] = {}  # per chain its later attempt with the highest number (the first of equals)
    for i in np.flatnonzero(later).tolist():
        row = counts[path(i)]
        row["attempts"] += 1
        row["valid"] += bool(valid[i])
        row["drill"] += bool(drill[i])
        held = last.get(int(chain[i]))
        if held is None or number[i] > number[held]:
            last[int(chain[i])] = i
    counts["retried_unrecovered"] = sum(1 for i in last.values() if not valid[i] and not will_retry[i]
                                        and path(i) == AttemptPath.RETRY.value)
    return counts


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
