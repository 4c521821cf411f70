"""The writing ends of the run's logs: a plain line log and a gzip member, each appended through a `FileAppender`.

Why apart from `k3load.evidence` (the readers, the file names and `SeriesTable`, which re-exports these): a
writer's rules are about failure and loss (a full disk cuts the file back to its last whole append; deflate
output reaches the file only at a sync flush, at most every `FLUSH_EVERY_S`) and it is used by one caller,
`k3load.rundir.JsonlLog`; the readers are used by every consumer of a run. Why compressed and how often
flushed: `k3load.evidence`'s docstring.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

from k3load.private_files import open_private

FLUSH_EVERY_S = 0.5  # a kill loses at most this much (plus a busy process's scheduling delay)
LEVEL = 6  # zlib's default: 251 B per record at 22 µs of CPU; level 9 gives 244 B at 32 µs (scale-run records)


class FileAppender:
    """Bytes appended to a file through its own descriptor, unbuffered: every `append` is on disk (in the kernel)
    when it returns, or the file is cut back to where it stood before it and the OSError raised (`broken`).

    Why cut back: a write that fails part-way (a full disk, a quota, an I/O error) may leave some of its bytes;
    a plain log would keep half a line, a compressed one a stream whose later bytes would never be written. Cut
    back to the last whole append, what the file holds is a readable prefix of everything written, and nothing
    is written after it (a later append is refused): the lines up to the failure read back exactly."""

    def __init__(self, path: Path) -> None:
        self._file: IO[bytes] = open_private(path, "ab", buffering=0)  # 0600, as every file of a run directory
        self.size = os.fstat(self._file.fileno()).st_size  # where the file ends after the last whole append
        self.broken: OSError | None = None

    def append(self, data: bytes) -> None:
        if self.broken is not None:
            raise self.broken
        view, done = memoryview(data), 0
        try:
            while done < len(view):
                n = self._file.write(view[done:])  # a full disk may take part of it, then refuse the rest
                if not n:
                    raise OSError(errno.EIO, f"{self._file.name}: nothing written")
                done += n
        except OSError as exc:
            self.broken = exc
            with contextlib.suppress(OSError):
                os.ftruncate(self._file.fileno(), self.size)
            raise
        self.size += len(data)

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


class PlainSink:
    """The plain end of a `k3load.rundir.JsonlLog` (events.jsonl, gpu.jsonl, server.log): each line on disk as
    it is written. `lines`: handed to it; `kept_lines`: known to be in the file."""

    def __init__(self, path: Path) -> None:
        self._out = FileAppender(path)
        self.lines = self.kept_lines = 0

    def write(self, data: bytes) -> None:
        self.lines += 1
        self._out.append(data)
        self.kept_lines = self.lines

    def flush(self) -> None:
        """Nothing waits: every line is in the file once written."""

    flush_due = flush

    def fileno(self) -> int:
        return self._out.fileno()

    def close(self) -> None:
        self._out.close()


class GzipSink:
    """The compressed end of a `k3load.rundir.JsonlLog`: bytes deflated into one gzip member, flushed to the
    file when an append comes `every_s` after the last flush, by `flush_due` (the log's flusher), and on close.
    Not thread-safe: the log calls it under its lock.

    The deflated bytes wait in memory until a flush writes them with a sync point in one append
    (`FileAppender`): the file always ends at a sync point, so a write that fails (a full disk) leaves every
    line up to the last flush readable and no part of a later one. `lines`: handed to it (one per `write`);
    `kept_lines`: in the file as of the last flush that succeeded. After a failure nothing more is written
    (not even the member's end: the reader takes a stream cut at a sync point, as after a kill)."""

    def __init__(self, path: Path, every_s: float = FLUSH_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = FileAppender(path)
        self._z = zlib.compressobj(LEVEL, zlib.DEFLATED, 31)
        self.every_s, self._clock = every_s, clock
        self._flushed_at = clock()
        self._waiting: list[bytes] = []  # deflated bytes not yet in the file
        self._pending = False
        self.lines = self.kept_lines = 0

    def write(self, data: bytes) -> None:
        if self._out.broken is not None:
            raise self._out.broken
        if out := self._z.compress(data):
            self._waiting.append(out)
        self._pending = True
        self.lines += 1
        if self._clock() - self._flushed_at >= self.every_s:
            self.flush()

    def flush(self) -> None:
        """Everything written so far readable from the file (a deflate sync point)."""
        if self._pending:
            lines = self.lines
            self._append(self._z.flush(zlib.Z_SYNC_FLUSH))
            self._pending, self.kept_lines = False, lines
        self._flushed_at = self._clock()

    def flush_due(self) -> None:
        if self._pending:
            self.flush()

    def _append(self, tail: bytes) -> None:
        data, self._waiting = b"".join([*self._waiting, tail]), []
        self._out.append(data)

    def fileno(self) -> int:
        return self._out.fileno()

    def close(self) -> None:
        """The member's end (its CRC and length) written, then the file closed; after a failed write only
        closed (the file ends at its last sync point)."""
        try:
            if self._out.broken is None:
                lines = self.lines
                self._append(self._z.flush())
                self.kept_lines = lines
        finally:
            self._out.close()


def start_flusher(flush: Callable[[], None], every_s: float, closed: threading.Event) -> None:
    """Call `flush` every `every_s` until `closed` is set (a JsonlLog's: it takes its own lock and never
    raises an OSError). A daemon thread (a greenlet in a gevent-patched process: `threading` is looked up
    when called)."""
    def loop() -> None:
        while not closed.wait(every_s):
            flush()
    threading.Thread(target=loop, name="k3load-gzip-flush", daemon=True).start()
