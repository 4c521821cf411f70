"""Locust's own per-run memory kept to a window on the master (or local) process, so a day-long soak stays flat.

Why: Locust keeps, for every stats entry, a count per second of the whole test (`StatsEntry.num_reqs_per_sec`
and `num_fail_per_sec`) and a 5-second snapshot of the totals for its charts (`RequestStats.history`, appended
by `locust.stats.stats_history`), none pruned until the next test: over a day about 100 MB on the master. What
reads them looks back a little: `current_rps` and `current_fail_per_sec` read the last 12 seconds, the web UI's
charts start from `history` when a page opens. A worker clears its own at every report (Locust's
`get_stripped_report`), so only the master and a local runner grow.

Kept: the last `PER_SECOND_KEPT_S` seconds of the per-second counts, the last `HISTORY_KEPT` snapshots (an
hour). The run's own evidence never came from these (records.jsonl.gz holds every attempt).
"""

from __future__ import annotations

import time
from typing import Any

import gevent

PER_SECOND_KEPT_S = 60  # more than `current_rps`'s 12 seconds, with the web UI's refresh to spare
HISTORY_KEPT = 720  # an hour of Locust's 5-second snapshots
TRIM_EVERY_S = 30.0


def trim(stats: Any, now: float) -> int:
    """Drop the per-second counts older than the window and the snapshots before the last HISTORY_KEPT, from
    Locust's `RequestStats`; the number of entries dropped."""
    oldest = int(now) - PER_SECOND_KEPT_S
    dropped = 0
    for entry in [*stats.entries.values(), stats.total]:
        for per_second in (entry.num_reqs_per_sec, entry.num_fail_per_sec):
            old = [second for second in per_second if second < oldest]
            for second in old:
                del per_second[second]
            dropped += len(old)
    excess = len(stats.history) - HISTORY_KEPT
    if excess > 0:
        del stats.history[:excess]
        dropped += excess
    return dropped


def keep_trimmed(environment: Any, every_s: float = TRIM_EVERY_S) -> gevent.Greenlet:
    """A greenlet trimming the runner's stats every `every_s` for the life of the process."""

    def loop() -> None:
        while True:
            gevent.sleep(every_s)
            runner = environment.runner
            if runner is not None:
                trim(runner.stats, time.time())

    return gevent.spawn(loop)
