"""One live run per directory: an exclusive `flock` on `DIR/.k3load.lock`, held for the run's life.

    lock = RunDirLock.take(run_dir, run_id)  # raises RunDirBusy: "runs/r1 is in use by run ID (pid N on HOST) ..."
    lock.stamp(run_id)                   # a new holder's id (the web UI: each test is a new run)
    lock.moved([(path, identity), ...])  # None while DIR is still the directory taken; else what changed
    lock.write_file(name, data)          # a file written beside the load: into the opened directory, by its fd
    lock.release()

Why a lock file and flock (as Prometheus's TSDB locks its data directory): a second run given the same
`--k3-out` used to move the live run's files aside and start writing its own there, and the first run then
judged the second's records. The kernel drops a flock when its holder exits however it exits (a kill -9
too), so a dead run never leaves a directory locked: its lock is free and the next run moves it aside as
before. The file stays in the directory (a dotfile: no manifest lists it, no set-aside moves it), holding
the holder's run id, pid and host as JSON, so a refused run can say whose run is live.

Why the end of a run checks identities rather than writing through a directory descriptor: once the lock
is held, no other k3load run touches the directory. What remains is an operator's `mv`, `rm -r` or an older
k3load that does not know the lock; each leaves DIR naming another directory (or the run's own files moved
out of it). Threading a directory descriptor through every reader and writer of the judgment (analysis/,
the reports, the manifest) would be a large change for that case, and `k3load analyze DIR` must stay a plain
path. So the run holds DIR open (O_DIRECTORY) and, before anything it writes at its end and again before it
gives a verdict, compares DIR's identity (st_dev, st_ino), the lock file's and its open logs' with what it
opened: a run whose directory is no longer at DIR judges nothing there and says where its files went.
The window left is an `mv` during the judgment itself; the check after judging catches it (exit 2).
A file written while the load runs (the design measurement, in a greenlet of its own, may finish after
an `mv`) is the exception: it has no end-of-run check before it, so it is written through the descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from k3load.errors import InputError
from k3load.private_files import FILE_MODE, make_run_dir, write_bytes_atomic_at

LOCK_NAME = ".k3load.lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class RunDirBusy(InputError, RuntimeError):
    """Another process holds the directory's lock (a live run); the message names its run id and pid. An input
    error (the user named a directory in use), and still the RuntimeError callers caught before."""



def holder(run_dir: Path) -> dict[str, object]:
    """What the lock file says about its holder ({} when missing or not written yet)."""
    try:
        data = json.loads((Path(run_dir) / LOCK_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def busy_message(run_dir: Path, who: dict[str, object]) -> str:
    run_id = who.get("run_id") or "(its id not written yet)"
    pid = who.get("pid", "?")
    host = f" on {who['host']}" if who.get("host") else ""
    return (f"{run_dir} is in use by run {run_id} (pid {pid}{host}): one run per directory; give another --k3-out, "
            "or wait for that run to end")


class RunDirLock:
    """The lock on one run directory, taken by this process (see the module doc)."""

    def __init__(self, run_dir: Path, dir_fd: int, lock_fd: int) -> None:
        self.path, self._dir_fd, self._lock_fd = run_dir, dir_fd, lock_fd

    @classmethod
    def take(cls, run_dir: Path, run_id: str = "") -> RunDirLock:
        """DIR created (0700) if missing, opened, and its lock file locked and stamped with `run_id`;
        RunDirBusy when a live process holds it (the directory is left as it is)."""
        run_dir = Path(os.path.abspath(run_dir))
        make_run_dir(run_dir)
        dir_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, FILE_MODE, dir_fd=dir_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            os.close(dir_fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirBusy(busy_message(run_dir, holder(run_dir))) from None
            raise
        lock = cls(run_dir, dir_fd, lock_fd)
        lock.stamp(run_id)  # at once: the file may still name a dead run
        return lock

    @property
    def held(self) -> bool:
        return self._lock_fd >= 0

    def stamp(self, run_id: str) -> None:
        """The lock file says who holds it: run id, pid, host (rewritten in place: the lock is on this file)."""
        data = json.dumps({"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname()}) + "\n"
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, data.encode(), 0)

    def moved(self, files: Iterable[tuple[Path, tuple[int, int] | None]] = ()) -> str | None:
        """None while DIR is the directory this lock opened and holds its lock file and `files` (each a path
        and the identity of the file this run writes there); else one line saying what changed."""
        opened = os.fstat(self._dir_fd)
        try:
            now = os.stat(self.path)
        except OSError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
            return (f"{self.path} is no longer the directory this run opened (moved, removed or replaced while "
                    f"the run was live){self._now_at()}")
        mine = os.fstat(self._lock_fd)
        expected = [(self.path / LOCK_NAME, (mine.st_dev, mine.st_ino)), *files]
        for path, identity in expected:
            if identity is None:
                continue
            try:
                here = os.stat(path, follow_symlinks=False)
            except OSError:
                here = None
            if here is None or (here.st_dev, here.st_ino) != identity:
                return f"{path} is no longer the file this run wrote (moved out of {self.path} while the run was live)"
        return None

    def write_file(self, name: str, data: bytes) -> None:
        """`name` written atomically into the directory this lock opened, wherever it is now: a writer that
        runs beside the load (reuse_design.json) never lands in a directory that replaced DIR."""
        write_bytes_atomic_at(self._dir_fd, name, data)

    def _now_at(self) -> str:
        """Where the opened directory is now, when the system says (Linux: /proc/self/fd)."""
        with contextlib.suppress(OSError):
            where = os.readlink(f"/proc/self/fd/{self._dir_fd}")
            if where.startswith("/") and not where.endswith(" (deleted)"):
                return f"; its files are now at {where}"
        return "; where its files went is not known"

    def release(self) -> None:
        for fd in (self._lock_fd, self._dir_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)  # closing the only descriptor of the lock file drops the flock
        self._lock_fd = self._dir_fd = -1


def in_use(run_dir: Path) -> str | None:
    """The busy message when a live process holds DIR's lock; None when it is free or DIR has none. Takes
    and drops the lock at once (an early check: the run itself takes it for good)."""
    if not (Path(run_dir) / LOCK_NAME).exists():
        return None
    try:
        RunDirLock.take(Path(run_dir)).release()
    except RunDirBusy as exc:
        return str(exc)
    except OSError:
        return None
    return None
