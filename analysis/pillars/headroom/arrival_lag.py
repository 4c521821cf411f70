"""Open-loop stages: how late the generator sent what the schedule meant to send.

Why: an open-loop stage offers sessions at the plan's rate whatever the server does; a turn is late when
every session slot (the stage's `users`) was busy when its time came, or the generator's CPU could not keep
up. Each such turn's record keeps its intended time (`intended_send_ts`, k3load.loadgen.arrivals), so the
lateness is measured, never hidden: the load offered was less than the plan's while it lasted, and a
latency measured from the actual send leaves out the wait the agent saw (coordinated omission).

A replay stage (k3load.loadgen.replay) schedules a trace's rows the same way: each row's record keeps its
intended time, so the same figures count its late rows, and its `replay_end` events (one per load-generator
process) add what records cannot say: rows not reached by the stage's end, rows cut to the context, the
tokenizer that sized the blocks, and which generator fell behind (`replay_figures`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from k3load.analysis.pillars.pillar import percentiles
from k3load.analysis.run.record_columns import Rows, distinct_keys
from k3load.analysis.run.stats import wilson

LATE_S = 1.0  # a turn sent this much after its intended time was held back by the generator
LATE_SHARE = 0.1  # more late turns than this: the step did not offer its rate (a search's step is not held)
MIN_SCHEDULED = 10  # fewer scheduled turns: too few to say


def offered_short(offered: float, arrived: int) -> bool:
    """An open-loop step whose sessions did not even start: fewer began than its rate offered over its time, by
    more than two standard deviations of a Poisson count (every slot busy, so the schedule's tickets waited
    untaken: too few to show as late turns; an honest Poisson step falls that short about 2% of the time, and
    is then read as past capacity: the conservative side). `offered`: the rate times the step's seconds."""
    return offered >= 5 and arrived < offered - 2 * offered ** 0.5


def offered_late(scheduled: int, late: int) -> bool:
    """An open-loop step that could not offer its rate: more than LATE_SHARE of its scheduled turns went out
    late (every session slot busy: sessions lasting longer as the server slows, or too few slots). Its
    latencies are measured from the late sends, so the wait its agents saw is not in them: not held."""
    return scheduled >= MIN_SCHEDULED and late / scheduled > LATE_SHARE


REPLAY_SUMS = ("rows_due", "rows_sent", "rows_late", "rows_not_played", "rows_in_flight_at_end", "rows_cut",
               "rows_short")


def replay_figures(ends: list[dict[str, Any]], stage: str) -> dict[str, Any]:
    """A replay stage's `replay_end` events summed over its processes (an empty dict for other stages)."""
    mine = [e for e in ends if e.get("stage") == stage]
    if not mine:
        return {}
    out: dict[str, Any] = {key: sum(int(e.get(key) or 0) for e in mine) for key in REPLAY_SUMS}
    out |= {"trace": mine[0].get("trace"), "speed": mine[0].get("speed"), "block_tokens": mine[0].get("block_tokens"),
            "processes": len(mine), "worst_lag_s": max(float(e.get("worst_lag_s") or 0.0) for e in mine),
            "in_flight_max": sum(int(e.get("in_flight_max") or 0) for e in mine),
            "tokenizer": sorted({str(e.get("tokenizer")) for e in mine}),
            "fell_behind": [e["fell_behind"] for e in mine if e.get("fell_behind")]}
    return {"replay": out}


def sessions_started(stage_rows: Rows, until: float) -> int:
    """Open-loop sessions a stage started by `until` (its end; a search step's decision), from every record that
    names it: its first turns sent by then (first attempts, a drill's included, a stream pair's whole twin not),
    whenever they ended. What the live search counts at a step's
    decision (k3load.loadgen.arrivals.ArrivalSchedule.started_by: the step's tickets taken whose time had come), so
    the two agree on a step's arrivals: a session still answering at the decision is the step's, and one that began
    in an earlier step and goes on in this one is not (each record names the stage it was sent in)."""
    first = ((stage_rows.ints("turn") == 0) & (stage_rows.ints("attempt") == 1)
             & ~np.isnan(stage_rows.number("intended_send_ts"))
             & (stage_rows.number("send_ts") <= until))  # a step's users go on a moment after its decision
    first &= ~stage_rows.code_is("stream_role", "whole")
    return int(first.sum())


def arrival_lag(rows: Rows, started: int | None = None) -> dict[str, Any]:
    """The stage's scheduled turns (first attempts with an intended time), their lateness and the late share;
    `started`: the stage's sessions started (`sessions_started`, an open-loop stage's), else the sessions its
    scheduled turns belong to (a replay stage's rows)."""
    scheduled = rows[~np.isnan(rows.number("intended_send_ts"))]
    if scheduled.empty:  # no scheduled turn ended in it: its sessions started are still said (an open-loop step)
        return {} if started is None else {
            "scheduled_turns": 0, "late_turns": 0, "late_share": None, "late_share_ci95": [None, None],
            "send_lag_p50_ms": None, "send_lag_p95_ms": None, "send_lag_max_ms": None, "sessions_arrived": started}
    lag_s = np.clip(scheduled.number("send_ts") - scheduled.number("intended_send_ts"), 0.0, None)
    p50, p95, top = percentiles(lag_s * 1000.0, (0.5, 0.95, 1.0))
    late = int((lag_s > LATE_S).sum())
    share = wilson(late, len(scheduled))
    return {"scheduled_turns": len(scheduled), "late_turns": late, "late_share": share.value,
            "late_share_ci95": [share.low, share.high], "send_lag_p50_ms": p50, "send_lag_p95_ms": p95,
            "send_lag_max_ms": top,
            "sessions_arrived": started if started is not None else distinct_keys(scheduled.keys("session_id"))}
