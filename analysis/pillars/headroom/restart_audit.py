"""The restart drill, judged: did the server come back from a restart on purpose and hold the load?

Why: the spec's restart check is "after a restart the server recovers under the same load". The
drill (k3load.loadgen.restart_drill) restarts the server at the `restart` stage and then holds the
users and family mix of the stage before it for the stage's duration. Recovered means: /health and
/v1/models answered again within `resources.max_restart_s` (time to ready), a request was answered
in full after that (time to the first good answer, from the records), and the held load stayed within
the stage's SLO and error limits (the restart stage's row of the stage table). A drill that was not
run (no --k3-restart-cmd) is said as such: never a pass.

The drill takes the server down on purpose: its down spell (from the command to ready) is not a
crash, and `planned_down` lets the crash and stage rules leave it out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.run.rundata import RunData
from k3load.events import Event
from k3load.outcomes import FAIL, INCONCLUSIVE, NOT_RUN, PASS
from k3load.workload.stage_kind import StageKind

PLANNED_MARGIN_S = 1.0  # a down the sampler saw began before ready; a second for clocks and log lines


def planned_windows(data: RunData) -> list[tuple[float, float]]:
    """(from, to) of each drill: its start to its ready (or its failure: still down then is the drill's)."""
    ends = sorted(e["ts"] for e in data.events_named(Event.RESTART_DRILL_READY, Event.RESTART_DRILL_FAILED))
    windows = []
    for start in sorted(e["ts"] for e in data.events_named(Event.RESTART_DRILL_START)):
        end = next((ts for ts in ends if ts >= start), float("inf"))
        windows.append((start - 1.0, end + PLANNED_MARGIN_S))  # the command starts a moment before its event
    return windows


def planned_down(ts: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= ts <= b for a, b in windows)


def _after(events: list[dict[str, Any]], name: Event, ts: float) -> dict[str, Any] | None:
    return next((e for e in events if e.get("event") == name and e["ts"] >= ts), None)


def restart_drill(data: RunData, stage_table: list[StageRow]) -> dict[str, Any]:
    """The drill's numbers and status (pass / fail / not_run / inconclusive), with `why`."""
    restart = next((s for s in stage_table if s.kind == StageKind.RESTART), None)
    start = next(iter(data.events_named(Event.RESTART_DRILL_START)), None)
    skipped = next(iter(data.events_named(Event.RESTART_DRILL_SKIPPED)), None)
    if start is None and skipped is not None:
        return {"status": NOT_RUN, "why": f"not run, because {skipped['why']} (the crash path's restart command): "
                "recovery is judged on that restart (crashes[].restart)"}
    if restart is None and start is None:
        return {"status": NOT_RUN, "why": "not run, because the plan has no restart stage"}
    if start is None:
        return {"status": NOT_RUN, "why": "not run, because no --k3-restart-cmd was given: the restart stage only "
                "held load on a server that was never restarted, so recovery after a restart is unproven"}
    numbers: dict[str, Any] = {"stage": start["stage"], "held_from": start.get("held_from"), "users": start["users"],
                               "mix": start.get("mix"), "up_before": start.get("up_before"), "log": start.get("log")}
    failed = _after(data.events, Event.RESTART_DRILL_FAILED, start["ts"])
    ready = _after(data.events, Event.RESTART_DRILL_READY, start["ts"])
    down = _after(data.events, Event.RESTART_DRILL_DOWN, start["ts"])
    numbers["down_after_s"] = down["down_s"] if down else None
    if ready is None:
        why = failed["why"] if failed else "the run ended before the server answered again"
        return numbers | {"status": FAIL, "recovered": False, "time_to_ready_s": None,
                          "command_rc": (failed or {}).get("command_rc"), "why": f"not recovered: {why}"}
    numbers |= {"time_to_ready_s": ready["time_to_ready_s"], "down_seen": ready.get("down_seen"),
                "command_rc": ready.get("command_rc")}
    return numbers | _hold(data, start, ready, restart)


def _hold(data: RunData, start: dict[str, Any], ready: dict[str, Any], row: StageRow | None) -> dict[str, Any]:
    mine = data.columns.rows(str(start["stage"]))
    after = mine[mine.number("send_ts") >= ready["ts"]]
    ended = after[after.code_is("status", "ok")].number("end_ts")
    first = _earliest(ended) if len(ended) else None
    out: dict[str, Any] = {"time_to_first_good_answer_s": first - start["ts"] if first is not None else None,
                           "first_good_answer_after_ready_s": first - ready["ts"] if first is not None else None}
    if row is None:
        return out | {"status": INCONCLUSIVE, "recovered": None,
                      "why": "inconclusive, because the restart stage has no row in the stage table"}
    problems = row.problems
    out |= {"held_attempts": row.attempts, "held_error_rate": row.error_rate,
            "held_error_rate_ci95": list(row.error_rate_ci95), "held_ttft_p95_ms": row.ttft_p95_ms,
            "held_e2e_p95_ms": row.e2e_p95_ms, "held_problems": [str(p.id) for p in problems]}
    if first is None:
        return out | {"status": FAIL, "recovered": False, "why": "not recovered: the server answered /health and "
                      "/v1/models again but no request was answered in full after it"}
    if problems:
        return out | {"status": FAIL, "recovered": False, "why": "not recovered: the held load broke the stage's "
                      "limits after the restart: " + "; ".join(p.reason for p in problems)}
    return out | {"status": PASS, "recovered": True,
                  "why": f"recovered: ready {ready['time_to_ready_s']:.1f} s after the restart command, first good "
                         f"answer after {out['time_to_first_good_answer_s']:.1f} s, then {row.attempts} attempts "
                         f"of {start['users']} users within the stage's limits"}


def _earliest(values: np.ndarray) -> float:
    """The smallest value, NaN left out (pandas' `min`; NaN when every value is)."""
    known = values[~np.isnan(values)]
    return float(known.min()) if len(known) else float("nan")


def drill_reason(drill: dict[str, Any]) -> str | None:
    """The pillar's line: a failure (server layer), or what the pass or the missing drill proved."""
    if drill["status"] == FAIL:
        return f"restart drill (server layer): {drill['why']}"
    if drill["status"] == NOT_RUN and "no restart stage" in drill["why"]:
        return None
    return f"restart drill: {drill['why']}"
