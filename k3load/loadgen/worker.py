"""A worker's side of a run: its records to the master by message, counted, and its CPU.

    k3_run (from the master) -> `join`: this run's id; a spool under the master's run directory only where
                                this worker reaches that directory (a shared disk) and --k3-worker-spool is
                                not off; `k3_join` to the master
    each attempt             -> `send`: `k3_record` to the master (and a spool line); counted as sent or unsent
    test_start / test_stop   -> the CPU reporter (k3load.loadgen.cpu) runs while the users run
    test_stop                -> `seal`: the spool's FINAL line; `k3_done` {run_id, sent, unsent, spool} and a log
                                line with the same counts (the worker's own accounting)

Why the spool is decided here and checked against run.json: the master sends its run directory's path, and a
worker on another machine may find a directory of that name that is not the master's (or none at all). It
spools only where run.json there names this run. --k3-worker-spool is read from the worker's own command
line or environment at `init` (the master's options replace a worker's custom options at each test start).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from locust.exception import RPCError, RPCSendError
from locust.runners import WorkerRunner

from k3load.events import Message
from k3load.loadgen import spools
from k3load.loadgen.cpu import CpuReporter
from k3load.rundir import JsonlLog, WriteGuard

log = logging.getLogger("k3load")
SPOOL_MODES = ("auto", "off")


def tell_master(environment: Any, why: str) -> None:
    """A worker that cannot take part says so to its master (`k3_refused`: its host, pid and why), which stops
    the run with one line naming it and exits 2: a worker's lost load must never pass for the whole plan's."""
    runner = getattr(environment, "runner", None)
    if not isinstance(runner, WorkerRunner):
        return
    try:
        runner.send_message(Message.REFUSED, {"host": socket.gethostname(), "pid": os.getpid(), "why": why})
    except (RPCError, RPCSendError) as exc:
        log.error("k3load: worker could not tell the master: %s", exc)


class WorkerLink:
    """One per worker process; the session delegates its worker-only parts here."""

    def __init__(self, runner: WorkerRunner, spool_mode: str = "auto") -> None:
        self.runner = runner
        self.spool_mode = spool_mode if spool_mode in SPOOL_MODES else "auto"
        self.run_id = ""
        self.spool: JsonlLog | None = None
        self.sent = 0
        self.unsent = 0
        self.joined = False
        self.cpu = CpuReporter(runner, lambda: self.run_id)

    def join(self, run_id: str, run_dir: Path) -> None:
        """A run begins (a new test from the web UI is a new run: the counts start again)."""
        if self.spool is not None:  # the last run's spool was sealed at its stop
            self.spool.close()
            self.spool = None
        self.run_id, self.sent, self.unsent, self.joined = run_id, 0, 0, True
        if self.spool_mode != "off" and _is_this_run(run_dir, run_id):
            self.spool = JsonlLog(run_dir / "spool" / f"worker-{os.getpid()}.jsonl.gz", guard=WriteGuard(_spool_failed))
        else:
            why = "--k3-worker-spool off" if self.spool_mode == "off" else f"{run_dir} is not reachable here"
            log.info("k3load: worker: no spool (%s): records reach the master by message only", why)
        self._send(Message.JOIN, {"run_id": run_id, "spool": self.spool_name, "host": socket.gethostname(),
                               "pid": os.getpid()})

    @property
    def spool_name(self) -> str | None:
        return self.spool.path.name if self.spool is not None else None

    def send(self, line: str) -> None:
        """One record, as it ends: the spool first (it survives a master that stopped listening)."""
        if self.spool is not None:
            self.spool.append_line(line)
        if self._send(Message.RECORD, line):
            self.sent += 1
        else:
            self.unsent += 1

    def seal(self) -> None:
        """The users stopped (test_stop): no record follows until they start again."""
        self.cpu.stop()
        if not self.joined:
            return  # never joined a run: nothing to account for
        if self.spool is not None:
            self.spool.append(spools.final_line())
            self.spool.flush()  # the master sees the seal now, not at the next flush
        node = getattr(self.runner, "client_id", "?")
        log.warning("k3load: worker done: run %s, worker %s, pid %d: %d records sent to the master, %d could not "
                    "be sent, spool %s", self.run_id, node, os.getpid(), self.sent, self.unsent,
                    self.spool_name or "none")
        self._send(Message.DONE, {"run_id": self.run_id, "sent": self.sent, "unsent": self.unsent,
                               "spool": self.spool_name})

    def _send(self, kind: Message, data: Any) -> bool:
        try:
            self.runner.send_message(kind, data)
            return True
        except (RPCError, RPCSendError) as exc:  # Locust retried for 9 s; the spool (if any) still has it
            log.error("k3load: worker could not send %s to the master: %s", kind, exc)
            return False


def _spool_failed(path: Path, exc: OSError) -> None:
    """A spool that cannot be written (the master's disk full) is only a copy: said once, the records go on by
    message (the master, writing to the same disk, stops the run)."""
    log.warning("k3load: worker: %s cannot be written (%s): records reach the master by message only", path,
                exc.strerror or exc)


def _is_this_run(run_dir: Path, run_id: str) -> bool:
    """The master's run directory, reachable from here: its run.json (written before `k3_run` is sent) names
    this run."""
    try:
        return json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("run_id") == run_id
    except (OSError, ValueError, AttributeError):
        return False
