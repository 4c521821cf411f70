"""Master/local: the run directory held for the run's life, and a write that fails turned into one stop.

    hold = RunHold(on_failure)           # one per HarnessSession (the web UI's tests share it)
    hold.open(run_dir, run_id)           # the directory's lock (k3load.rundir_lock), a new WriteGuard
    JsonlLog(path, guard=hold.guard)     # records, events, metrics, GPU samples, the server log
    hold.write_json(name, data)          # a document written beside the load, into the run's own directory
    hold.moved(logs)                     # before the end's writes and the verdict: None, or what changed
    hold.release()                       # at quitting

Why the lock lives here and not per run: the web UI runs one test after another in one process, each a
new run in the same directory, the last one set aside; the process keeps the lock across them (a new id
stamped each time), so nothing else can slip in between two tests.

Why one stop for every writer: a full disk shows first in whichever greenlet or thread writes next (a
user recording an answer, a sampler loop, the events writer, the flusher). Each writer's guard sends its
first OSError here, and only here: the files are frozen where they are (k3load.rundir.WriteGuard), and
`on_failure` (the session's) marks the run fatal with one line (HarnessSession.fail) and stops the load.
No exception reaches Locust's task runner: a user whose record could not be kept goes on to find the run
fatal at its next task and sends nothing more; its record is counted as lost (said at the end).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gevent

from k3load.rundir import JsonlLog, WriteGuard, file_bytes, json_document, write_json_atomic
from k3load.rundir_lock import RunDirLock

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
    """The session's run directory: its lock and its writers' guard (see the module doc). `on_failure(path, exc,
    stopped_at)`: the first write of the run that failed (every log frozen already), when it was said."""

    def __init__(self, on_failure: Callable[[Path, OSError, float], None]) -> None:
        self.on_failure = on_failure
        self.run_dir: Path | None = None
        self.lock: RunDirLock | None = None
        self.guard: WriteGuard | None = None
        self.stopped_at: float | None = None

    def open(self, run_dir: Path, run_id: str) -> WriteGuard:
        """The lock on `run_dir` (kept from the last test when it is the same directory) stamped with this
        run's id; a fresh guard, returned. Raises k3load.rundir_lock.RunDirBusy when a live run holds it."""
        if self.lock is not None and self.lock.path != run_dir:
            self.release()
        if self.lock is None:
            self.lock = RunDirLock.take(run_dir, run_id)
        else:
            self.lock.stamp(run_id)
        guard = self.guard = WriteGuard(self._failed)
        self.run_dir, self.stopped_at = run_dir, None
        return guard

    def _failed(self, path: Path, exc: OSError) -> None:
        """The first write of the run that failed; every log is frozen already (WriteGuard)."""
        self.stopped_at = time.time()
        self.on_failure(path, exc, self.stopped_at)

    def guarded(self, write: Callable[..., None], *args: Any) -> None:
        """`write(*args)` (in a greenlet of its own: reuse_design.json), an OSError to the run's guard rather
        than a traceback from the greenlet."""
        try:
            write(*args)
        except OSError as exc:
            if self.guard is None:
                raise
            self.guard.failed(self.run_dir or Path("."), exc)

    def write_json(self, name: str, data: Any) -> None:
        """`name` in the directory this run opened (through the lock's descriptor: moved away while the load
        ran, it still gets the file and the directory now at its path does not); by path before `open`."""
        if self.lock is None:
            if self.run_dir is None:
                raise RuntimeError("no run directory is open")
            write_json_atomic(self.run_dir / name, data)
            return
        self.lock.write_file(name, file_bytes(json_document(data)))

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
