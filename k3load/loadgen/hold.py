"""Master/local: the run directory held for the run's life, and a write that fails turned into one stop.

    hold = RunHold(session)              # one per HarnessSession (the web UI's tests share it)
    hold.open(run_dir, run_id)           # the directory's lock (k3load.rundir_lock), a new WriteGuard
    JsonlLog(path, guard=hold.guard)     # records, events, metrics, GPU samples, the server log
    hold.moved(logs)                     # before the end's writes and the verdict: None, or what changed
    hold.release()                       # at quitting

Why the lock lives here and not per run: the web UI runs one test after another in one process, each a
new run in the same directory, the last one set aside; the process keeps the lock across them (a new id
stamped each time), so nothing else can slip in between two tests.

Why one stop for every writer: a full disk shows first in whichever greenlet or thread writes next (a
user recording an answer, a sampler loop, the events writer, the flusher). Each writer's guard sends its
first OSError here, and only here: the files are frozen where they are (k3load.rundir.WriteGuard), the run
is marked fatal with one line (HarnessSession.fail), and the load stops. No exception reaches Locust's task
runner: a user whose record could not be kept goes on to find the run fatal at its next task and sends
nothing more; its record is counted as lost (said at the end).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gevent

from k3load.disk_full import stopped_line
from k3load.rundir import JsonlLog, WriteGuard
from k3load.rundir_lock import RunDirLock

if TYPE_CHECKING:  # the session owns its hold: imported for the annotations only
    from k3load.loadgen.session import HarnessSession

log = logging.getLogger("k3load")


def stop_load(environment: Any) -> None:
    """Users stop now. A plan shape ends a fatal run at its next tick (k3load.loadgen.shape), within a
    second; a second stop beside it would race Locust's own (two stops of one user raise). Without a shape
    (the web UI's user count, -u/-t): a headless run quits (its `quitting` says the exit code), the web UI's
    test stops."""
    runner = environment.runner
    if runner is None or environment.shape_class is not None:
        return
    gevent.spawn(runner.quit if getattr(environment.parsed_options, "headless", False) else runner.stop)


class RunHold:
    """The session's run directory: its lock and its writers' guard (see the module doc)."""

    def __init__(self, session: HarnessSession) -> None:
        self.session = session
        self.lock: RunDirLock | None = None
        self.guard: WriteGuard | None = None
        self.stopped_at: float | None = None

    def open(self, run_dir: Path, run_id: str) -> None:
        """The lock on `run_dir` (kept from the last test when it is the same directory) stamped with this
        run's id; a fresh guard. Raises k3load.rundir_lock.RunDirBusy when a live run holds it."""
        if self.lock is not None and self.lock.path != run_dir:
            self.release()
        if self.lock is None:
            self.lock = RunDirLock.take(run_dir, run_id)
        else:
            self.lock.stamp(run_id)
        self.guard, self.stopped_at = WriteGuard(self._failed), None

    def _failed(self, path: Path, exc: OSError) -> None:
        """The first write of the run that failed; every log is frozen already (WriteGuard)."""
        session = self.session
        self.stopped_at = time.time()
        shown = Path(getattr(session.env.parsed_options, "k3_out", "") or session.run_dir or ".")
        session.fail(stopped_line(shown, path, exc, session.records_kept(), self.stopped_at))
        if not session.finished:  # at the run's end (its verdict's files) the load has stopped already
            stop_load(session.env)

    def guarded(self, write: Callable[..., None], *args: Any) -> None:
        """`write(*args)` (in a greenlet of its own: reuse_design.json), an OSError to the run's guard rather
        than a traceback from the greenlet."""
        try:
            write(*args)
        except OSError as exc:
            if self.guard is None:
                raise
            self.guard.failed(self.session.run_dir or Path("."), exc)

    def moved(self, logs: Iterable[JsonlLog | None] = ()) -> str | None:
        """None while the run directory is the one this run opened, its lock file and `logs` in it; else
        what changed, in one line."""
        if self.lock is None:
            return None
        return self.lock.moved((x.path, x.identity()) for x in logs if x is not None)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
