"""Follow the server's log (a file, or a command such as `kubectl logs -f POD`) into DIR/server.log,
flagging the lines the verdict cares about as events.

Why: an OOM is only a resource conclusion when it is tied to the moment and the load that caused it;
the log line is the proof of *what* failed (CUDA OOM, NCCL, a CUDA error, a kernel/communication
warning), the sampler's other files show *when* and *under what*. Flags (first match wins):

    log_oom         CUDA out of memory, torch.OutOfMemoryError, cudaErrorMemoryAllocation
    log_nccl        NCCL WARN/ERROR lines, ncclXxxError, collective timeouts (watchdog)
    log_cuda_error  CUDA error / cudaError*, CUBLAS/CUDNN status, illegal memory access, Xid, device asserts
    log_engine_dead EngineDeadError, "EngineCore encountered/failed", engine process died
    log_warning     a WARNING/ERROR line about kernels, attention backends, all-reduce, P2P/NVLink,
                    NCCL/gloo or other communication, CUDA graphs, or a fallback

Bounded: each flag kind writes at most `max_events_per_kind` events (the rest are counted and
reported at stop), a line kept in an event is cut to 2,000 characters, a line without newline is cut
at 1 MiB. A command that ends is not restarted (it would replay old lines): `log_tail_ended` says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO

from k3load.command_name import withheld
from k3load.events import Event, EventSink
from k3load.rundir import JsonlLog, WriteGuard

FLAGS: tuple[tuple[Event, re.Pattern[str]], ...] = (
    (Event.LOG_OOM,
     re.compile(r"CUDA out of memory|OutOfMemoryError|cudaErrorMemoryAllocation|CUDA error: out of memory")),
    (Event.LOG_NCCL, re.compile(r"NCCL (?:WARN|ERROR)|nccl\w*Error|NCCL error|NCCL\b.*\b(?:timed out|timeout|failed)"
                                r"|Watchdog caught collective operation timeout", re.IGNORECASE)),
    (Event.LOG_CUDA_ERROR,
     re.compile(r"CUDA error|cudaError\w*|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|illegal memory access"
                r"|\bXid\b|device-side assert|CUDA driver version is insufficient")),
    (Event.LOG_ENGINE_DEAD,
     re.compile(r"EngineDeadError|EngineCore (?:encountered|failed)|Engine core proc \S+ died")),
    (Event.LOG_WARNING, re.compile(r"\b(?-i:WARNING|WARN|ERROR)\b.*(?:kernel|triton|flashinfer|flash[_ -]?attn"
                                   r"|attention backend|all[_ -]?reduce|\bp2p\b|nvlink|gloo|nccl|communicat|cuda ?graph"
                                   r"|fall(?:ing|s)? ?back)", re.IGNORECASE)),
)
MAX_EVENT_LINE = 2000
MAX_PARTIAL = 2**20


def classify(line: str) -> Event | None:
    """The flag of a log line, or None for an ordinary one."""
    for kind, pattern in FLAGS:
        if pattern.search(line):
            return kind
    return None


class LogTail:
    """Copies lines to `out_path` and flags them; runs in its own thread until `stop()`."""

    def __init__(self, out_path: Path, event: EventSink, clock: Callable[[], float], *, path: Path | None = None,
                 cmd: str | list[str] | None = None, poll_s: float = 0.2, max_events_per_kind: int = 100,
                 guard: WriteGuard | None = None) -> None:
        if (path is None) == (cmd is None):
            raise ValueError("give exactly one of path (a file to follow) or cmd (a command to run)")
        self.path, self.cmd = path, cmd
        self.source = f"file:{path}" if path is not None else "cmd"
        self._out = JsonlLog(out_path, guard=guard)  # a write that fails: to the run's guard (k3load.rundir)
        self._event, self._clock, self.poll_s = event, clock, poll_s
        self.max_events_per_kind = max_events_per_kind
        self.flagged: Counter[Event] = Counter()
        self.lines = 0
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="k3load-logtail", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._end_command()
        self._thread.join(timeout_s)
        suppressed = {k: n - self.max_events_per_kind for k, n in self.flagged.items() if n > self.max_events_per_kind}
        if suppressed:
            self._event(Event.LOG_FLAGS_SUPPRESSED, self._clock(), source=self.source, counts=suppressed)
        self._out.close()

    def _run(self) -> None:
        try:
            if self.path is not None:
                self._follow_file(self.path)
            else:
                self._follow_command()
        except Exception as exc:  # a log tail must never take the sampler down
            self._event(Event.LOG_TAIL_ERROR, self._clock(), source=self.source, error=self._error(exc))

    def _error(self, exc: Exception) -> str:
        """The failure in one line; a command's by its program only (its words may hold tokens, and an OSError
        names the word it could not run: `VLLM_API_KEY=...` when an assignment leads the command)."""
        if self.cmd is None:
            return f"{type(exc).__name__}: {exc}"
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        return f"{type(exc).__name__}: {why} ({withheld(self.cmd)})"

    def on_line(self, line: str) -> None:
        line = line.rstrip("\r\n")
        self.lines += 1
        self._out.append_line(line)
        kind = classify(line)
        if kind is None:
            return
        self.flagged[kind] += 1
        if self.flagged[kind] <= self.max_events_per_kind:
            self._event(kind, self._clock(), source=self.source, line=line[:MAX_EVENT_LINE])

    # -- a file ----------------------------------------------------------------------------------------
    def _follow_file(self, path: Path) -> None:
        """Read from the start (the startup log matters), then follow; reopen on truncation or rotation."""
        handle: IO[bytes] | None = None
        ino, partial = None, b""
        while True:
            stopping = self._stop.is_set()
            if handle is None and path.exists():
                handle, ino, partial = path.open("rb"), path.stat().st_ino, b""
            chunk = handle.read(1 << 16) if handle is not None else b""
            if chunk:
                partial = self._feed(partial + chunk)
                continue
            if stopping:
                break
            if handle is not None and _replaced(path, handle, ino):
                handle.close()
                handle = None
                continue
            self._stop.wait(self.poll_s)
        if partial:
            self.on_line(partial.decode("utf-8", errors="replace"))
        if handle is not None:
            handle.close()

    def _feed(self, data: bytes) -> bytes:
        *complete, rest = data.split(b"\n")
        for raw in complete:
            self.on_line(raw.decode("utf-8", errors="replace"))
        if len(rest) > MAX_PARTIAL:
            self.on_line(rest.decode("utf-8", errors="replace"))
            return b""
        return rest

    # -- a command -------------------------------------------------------------------------------------
    def _follow_command(self) -> None:
        argv = shlex.split(self.cmd) if isinstance(self.cmd, str) else list(self.cmd or [])
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        assert self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            self.on_line(raw.decode("utf-8", errors="replace"))
        code = self._proc.wait()
        if not self._stop.is_set():
            self._event(Event.LOG_TAIL_ENDED, self._clock(), source=self.source, returncode=code)

    def _end_command(self) -> None:
        """End the command we started (its own session): SIGTERM to its group, then SIGKILL."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(3.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(3.0)


def _replaced(path: Path, handle: IO[bytes], ino: int | None) -> bool:
    """Truncated (copytruncate) or rotated (a new file under the same name)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    return stat.st_ino != ino or stat.st_size < handle.tell()
