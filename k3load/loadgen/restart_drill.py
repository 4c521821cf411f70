"""The restart drill: at the `restart` stage, with --k3-restart-cmd, the server is restarted on purpose
and then has to hold the load that ran before it.

Why on purpose: "it came back once after a crash" proves little, and a run without a crash proved
nothing about restarts at all. The spec's restart check is that after a restart the server recovers
under the same load; so the drill drains (the stage before it ends with its drain window and every
user stopped), runs the restart command while the server is up, watches /health and /v1/models until
both answer again (bounded by `resources.max_restart_s`), and only then starts the users again: the
stage before's users and family mix, for the stage's own duration_s (the plan's clock stands still
during the restart). The analysis (k3load.analysis.pillars.headroom.restart_audit) judges the hold with the stage's
SLO and error checks and reads the time to the first good answer from the records.

The restart command must restart a RUNNING server (`systemctl restart vllm`, `docker restart NAME`,
a script that stops the pidfile's process then starts it again) and start a stopped one (the crash
path, k3load.loadgen.observe.Restarter, runs the same command after a crash). It may return at once
or keep running in the foreground (an `exec`ed server); its output goes to DIR/restart-drill.log,
redacted. While the drill runs, a `server_down` does not start the crash path's restart.

Events (events.jsonl): restart_drill_start {stage, held_from, users, mix, up_before, log, pid},
restart_drill_down {down_s} (when /health first failed), restart_drill_ready {time_to_ready_s,
down_seen, command_rc} or restart_drill_failed {why, waited_s, command_rc}.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import gevent

from k3load.events import Event
from k3load.loadgen.redact_lines import copy_redacted
from k3load.loadgen.target import TargetApi
from k3load.rundir import JsonlLog
from k3load.workload.plan import Stage
from k3load.workload.stage_kind import StageKind

log = logging.getLogger("k3load")
POLL_S = 0.25
PROBE_TIMEOUT_S = 2.0
EXIT_GRACE_S = 10.0  # a command that signals the server and returns: the server may take this long to stop


class RestartDrill:
    """Master/local, one per run: said into `events`, the command's output into `run_dir`. `probe()` says whether
    the server answers (by default `target`'s /health and /v1/models; tests inject one)."""

    def __init__(self, events: JsonlLog, run_dir: Path, target: TargetApi, command: str, bound_s: float,
                 probe: Callable[[], bool] | None = None, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.time, crash_restarts: Callable[[], int] = lambda: 0) -> None:
        self.events, self.run_dir, self.command, self.bound_s = events, run_dir, command, bound_s
        self.poll_s, self.clock, self.crash_restarts = poll_s, clock, crash_restarts
        self.probe = probe or partial(target.answers, PROBE_TIMEOUT_S)
        self.active = False  # the crash path stays out while this is set
        self.paused_s = 0.0
        self.ran: set[str] = set()
        self.process: subprocess.Popen[bytes] | None = None

    def held(self, stage: Stage, before: Stage | None) -> Stage:
        """The restart stage as it is held: the users, spawn rate and mix of the stage before it."""
        if before is None:
            return stage
        return dataclasses.replace(stage, users=before.users, spawn_rate=before.spawn_rate, mix=dict(before.mix))

    def due(self, stage: Stage) -> bool:
        """A restart stage not drilled yet. Not after the crash path already restarted the server in this
        run: that restart is the stage's check (the crash's `restart`), and restarting a server that just
        came back proves nothing more; said once (`restart_drill_skipped`)."""
        if stage.kind != StageKind.RESTART or stage.name in self.ran:
            return False
        if self.crash_restarts():
            self.ran.add(stage.name)
            self.events.event(Event.RESTART_DRILL_SKIPPED, stage=stage.name, crash_restarts=self.crash_restarts(),
                              why="the server was already restarted after a crash in this run")
            return False
        return True

    def run(self, stage: Stage, before: Stage | None) -> bool:
        """Restart now (every user has stopped); True when the server answered again within the bound."""
        self.ran.add(stage.name)
        self.active = True
        start = self.clock()
        try:
            return self._drill(stage, before, start)
        finally:
            self.paused_s += self.clock() - start
            self.active = False

    def _drill(self, stage: Stage, before: Stage | None, start: float) -> bool:
        events = self.events
        up_before = self.probe()
        log_path = self.run_dir / "restart-drill.log"
        self.process = subprocess.Popen(["bash", "-c", self.command], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        copy_redacted(self.process, log_path)
        events.event(Event.RESTART_DRILL_START, stage=stage.name, held_from=before.name if before else None,
                     users=stage.users, mix=stage.mix, up_before=up_before, log=log_path.name, pid=self.process.pid)
        log.warning("k3load: restart drill: restart command started (stage %s)", stage.name)
        down_ts: float | None = None
        exited_ts: float | None = None
        while self.clock() - start < self.bound_s:
            up = self.probe()
            if not up and down_ts is None:
                down_ts = self.clock()
                events.event(Event.RESTART_DRILL_DOWN, down_s=round(down_ts - start, 3))
            rc = self.process.poll()
            if up and (down_ts is not None or not up_before):
                events.event(Event.RESTART_DRILL_READY, time_to_ready_s=round(self.clock() - start, 3),
                             down_seen=down_ts is not None, command_rc=rc)
                return True
            if up and rc is not None and rc != 0:
                return self._failed(start, f"the restart command exited {rc} and the server never went down: "
                                    "it was not restarted (see restart-drill.log)", rc)
            exited_ts = exited_ts or (self.clock() if rc is not None else None)
            if up and exited_ts is not None and self.clock() - exited_ts > EXIT_GRACE_S:
                return self._failed(start, f"the restart command finished {EXIT_GRACE_S:.0f} s ago and the server "
                                    "never went down: it was not restarted (the command must restart a running "
                                    "server)", rc)
            gevent.sleep(self.poll_s)
        why = ("the server never went down" if down_ts is None
               else f"the server did not answer /health and /v1/models again within {self.bound_s:g} s")
        return self._failed(start, why + f" (resources.max_restart_s {self.bound_s:g})", self.process.poll())

    def _failed(self, start: float, why: str, rc: int | None) -> bool:
        self.events.event(Event.RESTART_DRILL_FAILED, why=why, waited_s=round(self.clock() - start, 3), command_rc=rc)
        log.error("k3load: restart drill failed: %s", why)
        return False
