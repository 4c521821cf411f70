"""The restart check's same conditions: once the server is back after a crash, the crash stage's load again.

Why: the seed asks that after an OOM the server recover *under the same conditions*. One answered request
after a restart proves it is up, not that it holds: a server killed four times by one stage's load, restarted
three times in between, read as "recovered". So when a crashed server answers again (restarted by
--k3-restart-cmd or by its own supervisor) the shape plays a `recovery` stage, `CRASH-recovery-N`: the crash
stage's users and family mix (so its families' input lengths) for `resources.recovery_hold_s` (unset: that
stage's duration, at most analysis.pillar.RECOVERY_HOLD_CAP_S). The plan's clock stands still during it, and
the stage the hold interrupted ends there (it ran against a dead server); the plan goes on after it. A crash
during the hold (the port closed, or an OOM or engine-dead line) is the same load killing the server again: the
hold ends, said `recurred`, and no second hold follows (the restart may still bring it back for the plan's next
stage).

A down spell arms a hold only when it was a crash: the port closed (the poll refused or reset; behind a gateway,
its 502 or 504), an OOM or engine-dead line in the log, or our restart command ran for it. A `/health` that
flapped while requests were answered arms nothing (analysis/run/down_spells.py tells the two apart on the records
afterwards).

Events: `stage_start` (kind recovery) when the hold begins, `recovery_hold` when it ends (ended: held,
crashed_again, run_ended). Judged in analysis/pillars/headroom/recovery.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from k3load.events import Event
from k3load.rundir import JsonlLog
from k3load.workload.plan import Stage
from k3load.workload.stage_kind import StageKind

RECOVERY = StageKind.RECOVERY  # the stage kind of a hold (never in a plan: the harness inserts it)
PORT_CLOSED = ("connection refused", "connection reset")  # the sampler's server_down reasons of a process gone
# a gateway's own answer that its upstream is unreachable (nginx: 502 on a refused connection, 504 on none): behind
# a proxy, the process gone shows as these, never as a closed port (tests/sim/test_replicas_nginx.py's topology)
UPSTREAM_GONE = (502, 504)
CRASH_LOG_EVENTS = (Event.LOG_OOM, Event.LOG_ENGINE_DEAD)
# The log is tailed every 0.2 s and /health polled less often: an engine's death line is read before its down
# (analysis/run/down_spells.py LOG_NEAR_S reads the same window around a down).
LOG_BEFORE_S = 30.0


class HoldEnd(StrEnum):
    HELD = "held"  # the load held for the whole hold
    CRASHED_AGAIN = "crashed_again"  # the server went down again under it: the crash recurred
    RUN_ENDED = "run_ended"  # the run ended first (stopped, or the web UI's test): cut short


@dataclass
class _Down:
    """A down spell being watched: what to re-apply if it proves a crash and the server comes back."""

    conditions: Stage
    down_ts: float
    reason: str
    restarts_before: int
    log_lines: int = 0  # OOM / engine-dead lines read during the spell or in the LOG_BEFORE_S before it
    http_status: int | None = None  # what /health answered, where it answered

    def was_crash(self, restarts_now: int) -> bool:
        return (self.reason in PORT_CLOSED or self.http_status in UPSTREAM_GONE or self.log_lines > 0
                or restarts_now > self.restarts_before)


class RecoveryHold:
    """An events listener (the sampler's server_down/server_up and log lines) and the shape's hold.

    `stage`: the stage running now; `restarts`: our restart command's starts so far; `drilling`: the restart
    drill has the server down on purpose (its restart is no crash); `hold_s`: the plan's recovery_hold_s or
    None; `cap_s`: the most an unset hold lasts; `max_holds`: the most holds a run arms (--k3-max-restarts: each
    stands the plan's clock still, so a server that dies and comes back for good must not keep the run alive)."""

    def __init__(self, events: JsonlLog, stage: Callable[[], Stage | None], restarts: Callable[[], int],
                 drilling: Callable[[], bool], hold_s: float | None, cap_s: float,
                 clock: Callable[[], float] = time.monotonic, max_holds: int = 3) -> None:
        self.events, self.stage, self.restarts, self.drilling = events, stage, restarts, drilling
        self.hold_s, self.cap_s, self.clock, self.max_holds = hold_s, cap_s, clock, max_holds
        self.watching: _Down | None = None
        self.armed: tuple[Stage, _Down] | None = None  # the hold to enter at the shape's next tick
        self.running: tuple[Stage, _Down] | None = None
        self.entered_at = 0.0
        self.interrupted: Stage | None = None  # the stage a finished hold cut short (the shape ends it)
        self.held_total_s = 0.0
        self.count = 0
        self.last_log_ts: float | None = None  # the last OOM / engine-dead line read, whether or not a down was seen

    @property
    def paused_s(self) -> float:
        """How long the plan's clock stood still for holds (the running one included)."""
        return self.held_total_s + (self.clock() - self.entered_at if self.running else 0.0)

    def __call__(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == Event.SERVER_DOWN and not record.get("first_poll") and not self.drilling():
            self._down(record)
        elif event in CRASH_LOG_EVENTS:
            self.last_log_ts = float(record.get("ts") or time.time())
            if self.watching is not None:
                self.watching.log_lines += 1
        elif event == Event.SERVER_UP and self.watching is not None:
            down, self.watching = self.watching, None
            if down.was_crash(self.restarts()) and self.running is None and self.count < self.max_holds:
                self.count += 1
                self.armed = (self._hold_stage(down), down)

    def _down(self, record: dict[str, Any]) -> None:
        down_ts = float(record.get("ts") or time.time())
        logged = self.last_log_ts is not None and down_ts - LOG_BEFORE_S <= self.last_log_ts
        if self.running is not None:
            # the same load killed it again: the crash recurred, no second hold. Only on a crash's evidence: a /health
            # that flapped under the hold is no death (the judgment still finds a crash whose log line comes later)
            if str(record.get("reason") or "") in PORT_CLOSED or record.get("http_status") in UPSTREAM_GONE or logged:
                self._end(HoldEnd.CRASHED_AGAIN)
            return
        current = self.stage()
        if self.watching is None and current is not None and current.kind != RECOVERY:
            self.armed = None  # a hold not begun yet: its server is gone again; the next up arms afresh
            # the restarter listens before this hold, so a command it starts for this down counts as after it
            status = record.get("http_status")
            self.watching = _Down(current, down_ts, str(record.get("reason") or ""), self.restarts(), int(logged),
                                  status if isinstance(status, int) else None)

    def _hold_stage(self, down: _Down) -> Stage:
        crashed = down.conditions
        hold_s = self.hold_s if self.hold_s is not None else min(crashed.duration_s, self.cap_s)
        # the same load: its users, mix, open-loop arrivals or trace (schedules are kept by stage name, so the hold's
        # start afresh from its entry); not a search's state, nor the per-user budget of a control stage
        return dataclasses.replace(crashed, name=f"{crashed.name}-recovery-{self.count}", kind=RECOVERY,
                                   start_s=0.0, duration_s=hold_s, iterations_per_user=None, search=None, step=None)

    def hold_now(self) -> Stage | None:
        """The hold to play now (armed, or running and not over), else None."""
        if self.running is not None:
            if self.clock() - self.entered_at < self.running[0].duration_s:
                return self.running[0]
            self._end(HoldEnd.HELD)
        return self.armed[0] if self.armed is not None else None

    def begin(self, before: Stage | None) -> None:
        """The shape entered the armed hold; `before`: the stage it interrupts."""
        if self.armed is None:
            return
        self.running, self.armed = self.armed, None
        self.entered_at, self.interrupted = self.clock(), before

    def take_interrupted(self) -> Stage | None:
        """Once, after a hold ended: the stage it cut short (the shape moves the plan past it)."""
        if self.running is not None:
            return None
        stage, self.interrupted = self.interrupted, None
        return stage

    def close(self) -> None:
        """The run's end: a hold still running was cut short."""
        if self.running is not None:
            self._end(HoldEnd.RUN_ENDED)

    def _end(self, ended: HoldEnd) -> None:
        assert self.running is not None
        (stage, down), self.running = self.running, None
        held = self.clock() - self.entered_at
        self.held_total_s += held
        self.events.event(Event.RECOVERY_HOLD, stage=stage.name, crash_stage=down.conditions.name,
                          down_ts=down.down_ts, down_reason=down.reason, users=stage.users, mix=stage.mix,
                          hold_s=stage.duration_s, held_s=round(held, 3), ended=ended.value)
