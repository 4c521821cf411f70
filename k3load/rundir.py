"""The run directory, the one hand-off between running and judging: atomic files and JSONL logs.

Why these two ways of writing: a reader (or a crash) must never see half a file. Whole documents
(`run.json`, `plan.yaml`) are written to a temp file and renamed; timelines (`events.jsonl`) are
appended a line at a time and flushed as they happen. A directory that already holds a run is first
emptied into a sibling (`set_aside_previous_run`), so one directory never mixes two runs.

Why the writers redact: a run's secrets (the API key, gateway header values) must never reach a file,
whatever a server echoes and whichever module writes (records, events, the sampler's lines, the server
log tail, run.json, reports). Each source redacts what it receives; `redact_in_files(secrets)` is the
net under all of them: once a process knows a secret, every line and document written here has it
replaced. Secrets are only ever added (a value once secret stays redacted for the process's life).

Why private: every file written here is created 0600 and every folder 0700 (k3load.private_files), as
a file an operator copies in (`copy_file_redacted`: redacted while it is copied, never in clear on disk).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from k3load.client.access import Secrets
from k3load.client.secret_forms import REDACTED, Redactor, redactor
from k3load.clock import now
from k3load.events import Event
from k3load.evidence_sinks import GzipSink, PlainSink, start_flusher
from k3load.private_files import make_dirs, temp_beside, write_bytes_atomic
from k3load.rundir_previous import RUN_MARKERS as RUN_MARKERS  # the previous run's move, re-exported
from k3load.rundir_previous import previous_run_id as previous_run_id
from k3load.rundir_previous import read_manifest as read_manifest
from k3load.rundir_previous import set_aside_previous_run as set_aside_previous_run

# How text files are written: a lone surrogate (a server's `"\\ud83d"`, or a byte that was not UTF-8,
# kept by the client as U+DC80..U+DCFF) cannot be encoded as UTF-8; strict writing raised and lost
# the line. backslashreplace writes it as `\\udcff`, which inside a JSON string is the very escape
# that reads back to the same character (json.dumps only puts such characters inside strings).
ENCODING_ERRORS = "backslashreplace"
REDACTED_BYTES = REDACTED.encode()


_values: list[str] = []
_redactor: list[Redactor] = []  # the one Redactor of every secret known so far (none: nothing to redact)


def redact_in_files(secrets: Secrets) -> None:
    """From now on, every file written through this module has these secrets redacted."""
    new = [v for v in secrets.values if v not in _values]
    if new:
        _values.extend(new)
        _redactor[:] = [redactor(tuple(_values))]


def secret_values() -> tuple[str, ...]:
    """Every secret value this process redacts, as configured (for a helper process that must too: it
    builds its own k3load.client.secret_forms.Redactor of them)."""
    return tuple(_values)


def scrub(text: str) -> str:
    """`text` with every secret this process knows replaced, in every form (unchanged, and free, when none)."""
    return _redactor[0].redact(text) if _redactor else text


def scrub_bytes(data: bytes) -> bytes:
    return _redactor[0].redact_bytes(data) if _redactor else data


def file_bytes(text: str) -> bytes:
    """What a text file of the run holds: `text` with every known secret replaced, as UTF-8."""
    return scrub(text).encode("utf-8", errors=ENCODING_ERRORS)


def json_document(data: Any) -> str:
    """A JSON document as every run file writes it (indented, keys sorted, a final newline)."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """`text`, secrets replaced, in a 0600 temporary file beside `path`, renamed onto it."""
    write_bytes_atomic(path, file_bytes(text))


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json_document(data))


class WriteGuard:
    """Where the failed writes of a run's files go: the first OSError of any (a full disk, a quota, an I/O
    error, a filesystem gone read-only) freezes every log it guards (each keeps what is in its file, a
    readable prefix, and drops what follows: `JsonlLog.lost`) and calls `on_failure(path, exc)` once,
    outside every log's lock. Later failures are not reported again. A writer of whole documents reports
    its own failure with `failed(path, exc)` (`write_guarded`).

    Why freeze them all: the run's evidence is one cut in time. A run that went on writing events while its
    records could not be kept would hold a timeline the records never match; frozen at the first failure,
    every file ends at about the same moment."""

    def __init__(self, on_failure: Callable[[Path, OSError], None]) -> None:
        self._on_failure = on_failure
        self._logs: list[JsonlLog] = []
        self._lock = threading.Lock()
        self.failure: tuple[Path, OSError] | None = None

    def add(self, log: JsonlLog) -> None:
        with self._lock:
            self._logs.append(log)
            frozen = self.failure is not None
        if frozen:
            log.freeze()  # opened after the failure (a sampler started late): nothing of it is written

    def failed(self, path: Path, exc: OSError) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = (path, exc)
            logs = list(self._logs)
        for each in logs:
            each.freeze()
        self._on_failure(path, exc)


def write_guarded(path: Path, text: str, guard: WriteGuard | None) -> bool:
    """`write_atomic`, its OSError to `guard` (raised without one); False when it failed or `guard` has
    stopped the writing already (nothing is written after a failure)."""
    if guard is not None and guard.failure is not None:
        return False
    try:
        write_atomic(path, text)
    except OSError as exc:
        if guard is None:
            raise
        guard.failed(path, exc)
        return False
    return True


class JsonlLog:
    """A thread-safe JSONL appender. A plain file's lines are in the file as written; a `.gz` path is compact
    evidence (k3load.evidence): deflated, and in the file within half a second (an append flushes when the
    last flush is that old, a flusher flushes an idle log).
    `encode` (under the lock, in file order) turns a record into the line written (the metrics'
    `SeriesTable.encode`). `listeners` see each record appended, as given (e.g. the restarter reacts to
    the sampler's `server_down`). `clock`: when a compressed log last flushed (tests replay a run's own).

    A write that fails (OSError: a full disk) leaves the file a readable prefix of what was written, up to
    the last line (plain) or flush (compressed) that succeeded (k3load.evidence_sinks.FileAppender), and nothing
    is written to it afterwards. With a `guard` (k3load.rundir.WriteGuard) the failure goes there once and
    never reaches the caller: that line and every later one are dropped and counted (`lost`). Without one,
    the failing append raises the OSError, and so does every later append. A flush by the flusher that
    fails is kept for the next append (or the guard). `kept`: lines known to be in the file."""

    def __init__(self, path: Path, encode: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 clock: Callable[[], float] = time.monotonic, guard: WriteGuard | None = None) -> None:
        make_dirs(path.parent)
        self.path, self._encode, self._guard = path, encode, guard
        self._lock, self._closed = threading.Lock(), threading.Event()
        self.failed: OSError | None = None
        self._frozen = False
        self.appended = 0  # lines asked for, kept or not
        self._sink: GzipSink | PlainSink
        if path.name.endswith(".gz"):
            self._sink = GzipSink(path, clock=clock)
            start_flusher(self.flush, self._sink.every_s, self._closed)
        else:
            self._sink = PlainSink(path)
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        if guard is not None:
            guard.add(self)

    @property
    def kept(self) -> int:
        """Lines in the file (a compressed log's as of its last flush)."""
        return self._sink.kept_lines

    @property
    def lost(self) -> int:
        """Lines asked for that are not in the file and never will be (after a failed write); 0 before."""
        return self.appended - self.kept if (self.failed is not None or self._frozen) else 0

    def identity(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the file this log writes to; None once closed."""
        with self._lock:
            if self._closed.is_set():
                return None
            stat = os.fstat(self._sink.fileno())
        return stat.st_dev, stat.st_ino

    def append(self, record: dict[str, Any]) -> None:
        if self._encode is None:
            self.append_line(_dumps(record))
        else:
            with self._lock:
                failure = self._write(scrub(_dumps(self._encode(record))))
            self._report(failure)
        for listener in self.listeners:
            listener(record)

    def append_line(self, line: str) -> None:
        line = scrub(line)
        with self._lock:
            failure = self._write(line)
        self._report(failure)

    def _write(self, line: str) -> OSError | None:
        """Under the lock: the line written, or dropped after a failure; a new failure returned."""
        if self._closed.is_set():
            raise ValueError(f"{self.path}: written after close")  # as a closed text file raises
        self.appended += 1
        if self.failed is not None and self._guard is None:
            raise self.failed
        if self.failed is not None or self._frozen:
            return None
        return self._attempt(lambda: self._sink.write((line + "\n").encode("utf-8", ENCODING_ERRORS)))

    def _attempt(self, write: Callable[[], None]) -> OSError | None:
        try:
            write()
        except OSError as exc:
            if self.failed is None:
                self.failed = exc
                return exc
        return None

    def _report(self, failure: OSError | None) -> None:
        """Outside the lock: a new failure to the guard, or raised without one."""
        if failure is None:
            return
        if self._guard is None:
            raise failure
        self._guard.failed(self.path, failure)

    def flush(self) -> None:
        """A compressed log's lines so far readable from the file now (a plain log's always are). Never raises
        an OSError: a failure goes to the guard, or to the next append."""
        with self._lock:
            live = not (self._closed.is_set() or self.failed is not None or self._frozen)
            failure = self._attempt(self._sink.flush_due) if live else None
        if self._guard is not None:
            self._report(failure)

    def freeze(self) -> None:
        """What was written kept (flushed, if the file takes it); nothing more is written, later lines are
        dropped and counted (`lost`). The file stays open until `close`, which ends a compressed member."""
        with self._lock:
            live = not (self._closed.is_set() or self.failed is not None or self._frozen)
            failure = self._attempt(self._sink.flush) if live else None
            self._frozen = True
        if self._guard is not None:
            self._report(failure)

    def event(self, event: Event, **fields: Any) -> None:
        """An events.jsonl line: the run's clock (k3load.clock), the event name, its fields (k3load.events
        says which). A name not in the catalogue raises ValueError here, before anything is written."""
        self.append({"ts": now(), "event": Event(event).value, **fields})

    def close(self) -> None:
        """Closes the file (a compressed one's member ended, unless a write failed). A failure here goes to
        the guard; without one it is raised."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            failure = self._attempt(self._sink.close)
        self._report(failure)


COPY_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Copied:
    """What `copy_file_redacted` wrote: whether a secret was replaced, and the copy's sha256 and size."""

    redacted: bool
    sha256: str
    bytes: int


def copy_file_redacted(src: Path | BinaryIO, dst: Path, secrets: Secrets | None = None,
                       chunk_bytes: int = COPY_CHUNK_BYTES) -> Copied:
    """`src` (a path, or a binary file open for reading) copied to `dst` with every secret replaced on the
    way: `secrets`' and every one this process knows (`redact_in_files`), in every form
    (k3load.client.secret_forms). Redacted before a byte is written, into a 0600 temporary file beside
    `dst`, synced and renamed onto it: an interrupted copy leaves no `dst` and at most that temporary file
    (`k3load.private_files.is_temp`, removed here on any exception), which never holds a secret in clear.
    A secret cut by a chunk's end is caught: the last `max_match` bytes wait for the next chunk."""
    values = [*(secrets.values if secrets else ()), *secret_values()]
    redactor_ = redactor(tuple(dict.fromkeys(values))) if values else None
    fd, tmp = temp_beside(dst)
    try:
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(os.fdopen(fd, "wb"))
            source = src if not isinstance(src, (str, Path)) else stack.enter_context(open(src, "rb"))
            copied = _copy_stream(source, out, redactor_, chunk_bytes)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return copied


def _copy_stream(source: BinaryIO, out: BinaryIO, redactor_: Redactor | None, chunk_bytes: int) -> Copied:
    digest, size, redacted, carry = hashlib.sha256(), 0, False, b""
    pattern = redactor_.bytes_pattern if redactor_ else None
    if redactor_ and pattern is None:
        raise ValueError("a secret that is not ASCII cannot be searched for in a byte stream")
    overlap = redactor_.max_match if redactor_ else 0
    while True:
        data = source.read(chunk_bytes)
        buf = carry + data
        cut = len(buf) if not data else max(0, len(buf) - overlap)  # past `cut`: wait for more bytes
        parts, pos = [], 0
        for match in pattern.finditer(buf) if pattern is not None else ():
            if match.start() >= cut:
                break
            parts += [buf[pos:match.start()], REDACTED_BYTES]
            pos, cut, redacted = match.end(), max(cut, match.end()), True
        parts.append(buf[pos:cut])
        chunk = b"".join(parts)
        out.write(chunk)
        digest.update(chunk)
        size += len(chunk)
        carry = buf[cut:]
        if not data:
            return Copied(redacted, digest.hexdigest(), size)


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))
