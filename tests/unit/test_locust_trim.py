"""Locust's per-second counts and chart history kept to a window on the master (issue 31), on Locust's own
`RequestStats` filled the way a run fills it."""

from __future__ import annotations

from locust.stats import RequestStats

from k3load.loadgen.locust_trim import HISTORY_KEPT, PER_SECOND_KEPT_S, trim


def test_a_days_per_second_counts_and_history_are_cut_to_the_window_and_current_rps_is_unchanged():
    stats = RequestStats()
    start = 1_800_000_000
    stats.total.start_time = start
    entry = stats.get("agent: e2e", "POST")
    for second in range(0, 86_400, 60):  # a request a minute over a day, one failure an hour
        entry._log_time_of_request(start + second)
        if second % 3600 == 0:
            entry.num_fail_per_sec[start + second] += 1
    for second in range(86_300, 86_400):  # the last 100 seconds busy
        entry._log_time_of_request(start + second)
        stats.total._log_time_of_request(start + second)
    stats.history.extend({"time": str(i)} for i in range(17_280))  # a day of 5-second snapshots
    rps_before = entry.current_rps
    now = start + 86_400
    dropped = trim(stats, now)
    assert min(entry.num_reqs_per_sec) >= now - PER_SECOND_KEPT_S and min(stats.total.num_reqs_per_sec) >= \
        now - PER_SECOND_KEPT_S
    assert not entry.num_fail_per_sec  # the last failure was an hour ago
    assert len(stats.history) == HISTORY_KEPT and stats.history[-1] == {"time": "17279"}
    assert entry.current_rps == rps_before > 0  # what reads the counts looks back 12 seconds: the same
    assert dropped > 17_280 - HISTORY_KEPT
    assert trim(stats, now) == 0  # nothing older is left
