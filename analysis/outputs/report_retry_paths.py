"""The report's "Retries and fallbacks" section (report.md; report.html renders the same): each attempt's path,
first try, retry or fallback, with how many of each were valid and how many were the timeout drill's.

Usage: `markdown(data)` -> the section's Markdown. Columns: `path`, `attempts`, `valid`, `drill`
(sent with the drill's deliberately short deadline: failed on purpose). The counts are
analysis/pillars/agent/retry_paths.py's,
the ones the checklist's "Retry and API fallback behaviour" line is ticked on.
"""

from __future__ import annotations

from k3load.analysis.outputs.markdown import table
from k3load.analysis.pillars.agent.retry_paths import PATHS, path_counts
from k3load.analysis.run.rundata import RunData

COLUMNS = ("path", "attempts", "valid", "drill")


def markdown(data: RunData) -> str:
    counts = path_counts(data)
    rows = [{"path": p, **counts[p]} for p in PATHS]
    unrecovered = counts["retried_unrecovered"]
    note = (f"\n{unrecovered} retried request(s) ended without a valid answer and with no fallback.\n"
            if unrecovered else "")
    return ("## Retries and fallbacks\n\nEvery attempt by how it was sent: a request's first try, a retry of the "
            "same bytes (`retry.when`), or the one fallback sent with the turn's `fallback:` settings once its "
            "retries were exhausted (judged by the turn's expectation minus what the fallback took away).\n\n"
            + table(rows, COLUMNS) + note + "\n")
