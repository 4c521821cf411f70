"""The restart check under the same conditions: did the load that crashed the server hold once it was back?

Why: one answer after a restart proves the server is up, not that it recovered. The seed asks for the same
conditions, and it is what tells a continuing OOM (buy or re-size: `scale_up`) from a one-off (a crash the
lead must know of: `limited`). k3load.loadgen.recovery re-applies the crash stage's users and mix once the
server is back (a `recovery` stage, `recovery_hold` when it ends); this module reads what happened.

Statuses (`restart.same_conditions.status`):
- `held`: the crash stage's load ran for the whole hold and the server stayed up: a one-off.
- `recurred`: the server crashed again under it: a continuing crash (with memory evidence, a continuing OOM).
- `cut_short`: the run ended during the hold, no crash in it: inconclusive.
- `not_run`: no hold followed (the server never came back, the plan ended first, or this crash is itself the
  recurrence of an earlier one under its hold); `why` says which.

"Ended properly" (`crash.ended`): the port closed (the health poll refused or reset: the process is gone) or
not (a live API server over a dead engine answers /health with an error: the process did not end), the
server log's lines nearest the crash, and, where GPU telemetry was read between the crash and the server's
return, whether every card's memory fell back near empty: memory still held with the server gone is a
worker process that outlived its server (its next start may find the card full).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from k3load.analysis.pillars.headroom.gpu_growth import gpu_label
from k3load.analysis.run.rundata import RunData
from k3load.events import Event
from k3load.outcomes import NOT_RUN
from k3load.workload.stage_kind import StageKind

RECOVERY = StageKind.RECOVERY  # the stage kind of a hold (k3load.loadgen.recovery inserts it)
PORT_CLOSED = ("connection refused", "connection reset")
HELD_SHARE = 0.9  # a hold that ran this share of its length without a crash held (a tick's lateness is no cut)
# A card with no process on it: NVML "used" is the driver's own few hundred MiB. Within this of empty
# (or RELEASED_SHARE of the card, whichever is larger) the crashed server's memory is back.
RELEASED_MIB = 1024.0
RELEASED_SHARE = 0.03


@dataclass(frozen=True)
class Hold:
    """One hold as the run recorded it: its stage_start and, unless the run was cut, its recovery_hold."""

    stage: str
    start_ts: float
    end_ts: float | None
    users: int | None
    mix: dict[str, Any]
    hold_s: float | None
    held_s: float | None
    ended: str | None
    crash_stage: str | None
    down_ts: float | None
    answered: int = 0  # its requests answered in full
    users_sending: int = 0  # the distinct users that sent in it
    open_loop: bool = False  # its sessions arrived at a rate: `users` is a ceiling, not a count to reach


def holds(data: RunData) -> list[Hold]:
    ends = {e.get("stage"): e for e in data.events_named(Event.RECOVERY_HOLD)}
    out = []
    for start in data.events_named(Event.STAGE_START):
        if start.get("kind") != RECOVERY:
            continue
        end = ends.get(start.get("stage"), {})
        held = end.get("held_s")
        mine = data.columns.rows(str(start.get("stage")))
        out.append(Hold(str(start.get("stage")), float(start["ts"]),
                        float(start["ts"]) + float(held) if held is not None else None, start.get("users"),
                        dict(start.get("mix") or {}), end.get("hold_s"), held, end.get("ended"),
                        end.get("crash_stage"), end.get("down_ts"),
                        int(mine.code_is("status", "ok").sum()), mine.distinct("user_id"),
                        start.get("sessions_per_s") is not None))
    return out


def same_conditions(crash_ts: float, next_crash_ts: float | None, in_hold: Hold | None, all_holds: list[Hold],
                    up_ts: float | None) -> dict[str, Any]:
    """`restart.same_conditions` of the crash at `crash_ts` (the next crash's ts, or None; `in_hold`: the hold
    this crash happened in, if any; `up_ts`: when the server was back, None if never)."""
    if in_hold is not None:
        return _result(in_hold, False, NOT_RUN, f"this crash is the recurrence under the hold {in_hold.stage} "
                       f"(the load of stage {in_hold.crash_stage} re-applied): no second hold follows")
    hold = next((h for h in all_holds if h.start_ts > crash_ts and (next_crash_ts is None
                                                                     or h.start_ts < next_crash_ts)), None)
    if hold is None:
        why = "the server did not come back within the run" if up_ts is None else \
            "the server died again before the hold began" if next_crash_ts is not None else \
            "no hold was armed or begun: the plan ended first, or nothing showed its down was a crash (the port " \
            "stayed open, no OOM or engine-dead line, no restart command of ours)"
        return {"users": None, "mix": None, "held_s": None, "recurred": None, "status": NOT_RUN,
                "why": f"not re-applied, because {why}"}
    # a down is seen a few polls late: a crash just after the hold's end is its own when the hold ended otherwise
    late_s = 0.0 if hold.ended == "held" else 5.0
    if next_crash_ts is not None and (hold.end_ts is None or next_crash_ts <= hold.end_ts + late_s):
        held_s = max(next_crash_ts - hold.start_ts, 0.0)
        return _result(hold, True, "recurred", f"the load of stage {hold.crash_stage or '?'} ({_load(hold)}) "
                       f"re-applied after the restart crashed the server again after {held_s:.0f} s", held_s)
    ran = hold.ended == "held" or bool(hold.held_s is not None and hold.hold_s
                                       and hold.held_s >= HELD_SHARE * hold.hold_s)
    short = _unproven(hold)
    if ran and not short:
        return _result(hold, False, "held", f"the load of stage {hold.crash_stage or '?'} ({_load(hold)}) re-applied "
                       f"after the restart held for {hold.held_s or 0:.0f} s ({hold.answered} requests answered): "
                       "a one-off")
    why = short if ran and short else f"the hold ended {hold.held_s or 0:.0f} s into its {hold.hold_s or 0:.0f} s " \
        f"({hold.ended or 'the run was cut'}), without a crash"
    return _result(hold, False, "cut_short", f"inconclusive, because {why}")


def _unproven(hold: Hold) -> str | None:
    """Why a hold that lasted did not show the crash stage's load held, or None: no answer in it, or fewer users
    sent than the stage ran (closed-loop; an open-loop stage's users are a ceiling)."""
    if hold.answered == 0:
        return f"the hold of stage {hold.crash_stage or '?'}'s load answered no request"
    if not hold.open_loop and hold.users and hold.users_sending < hold.users:
        return (f"only {hold.users_sending} of the {hold.users} users of stage {hold.crash_stage or '?'} sent in "
                "its hold: not the same load")
    return None


def _load(hold: Hold) -> str:
    mix = ", ".join(f"{k} {v}" for k, v in sorted(hold.mix.items()))
    return f"{hold.users} users, mix {mix}"


def _result(hold: Hold, recurred: bool, status: str, why: str, held_s: float | None = None) -> dict[str, Any]:
    return {"users": hold.users, "mix": hold.mix, "held_s": held_s if held_s is not None else hold.held_s,
            "recurred": recurred, "status": status, "why": why}


def hold_at(all_holds: list[Hold], ts: float) -> Hold | None:
    """The hold running at `ts` (a crash during it is the recurrence)."""
    return next((h for h in all_holds if h.start_ts <= ts and (h.end_ts is None or ts <= h.end_ts + 5)), None)


def ended(data: RunData, crash_ts: float, up_ts: float | None, down_reason: str | None) -> dict[str, Any]:
    """Did the crashed server end properly: its port closed, its last log lines, its cards' memory let go."""
    port_closed = None if down_reason is None else down_reason in PORT_CLOSED
    how = ("the port closed (the health poll was refused or reset: the process is gone)" if port_closed else
           f"the port stayed open ({down_reason}): an API server alive over a dead engine" if port_closed is False
           else "unknown: no health poll saw it go")
    return {"port_closed": port_closed, "how": how, "log_tail": _log_tail(data, crash_ts),
            "gpu_memory": _released(data.gpu, crash_ts, up_ts)}


def _log_tail(data: RunData, ts: float, lines: int = 5) -> list[str]:
    """The flagged server-log lines (OOM, engine dead, CUDA, NCCL, warnings) read in the 30 s before the crash
    was seen and just after it: the log's own last words (server.log has no timestamps to cut it by)."""
    near = [e for e in data.events if str(e.get("event", "")).startswith("log_") and ts - 30 <= e["ts"] <= ts + 5]
    return [str(e.get("line", ""))[:300] for e in near[-lines:]]


def _released(gpu: pd.DataFrame, crash_ts: float, up_ts: float | None) -> dict[str, Any]:
    """Each card's lowest reading between the crash and the server's return: near empty, or still held."""
    if gpu.empty or "memory_used_mib" not in gpu or up_ts is None:
        return {"judged": False, "why": "not judged, because no GPU reading was taken between the crash and the "
                                        "server's return" if up_ts is not None else
                                        "not judged, because the server did not come back within the run"}
    rows = gpu[(gpu["ts"] > crash_ts) & (gpu["ts"] < up_ts)]
    if rows.empty:
        return {"judged": False, "why": "not judged, because no GPU reading was taken between the crash and the "
                                        "server's return"}
    held = {}
    for name, card in rows.groupby(gpu_label(rows)):
        low = float(card["memory_used_mib"].min())
        total = float(card["memory_total_mib"].max()) if "memory_total_mib" in card else 0.0
        if low > max(RELEASED_MIB, RELEASED_SHARE * total):
            held[str(name)] = low
    if held:
        named = ", ".join(f"{gpu} {mib:,.0f} MiB" for gpu, mib in sorted(held.items()))
        return {"judged": True, "released": False, "held_mib": held,
                "why": f"memory still held with the server gone ({named}): a worker process outlived its server"}
    return {"judged": True, "released": True, "why": "every card's memory fell back near empty before the restart"}
