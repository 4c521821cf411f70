"""The run directory, the one hand-off between running and judging: atomic files and JSONL logs.

Why these two ways of writing: a reader (or a crash) must never see half a file. Whole documents
(`run.json`, `plan.yaml`) are written to a temp file and renamed; timelines (`events.jsonl`) are
appended a line at a time and flushed as they happen.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


class JsonlLog:
    """A thread-safe JSONL appender; every line is flushed when written. `listeners` see each record
    appended (e.g. the restarter reacts to the sampler's `server_down`)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def append(self, record: dict[str, Any]) -> None:
        self.append_line(json.dumps(record, ensure_ascii=False, separators=(",", ":")))
        for listener in self.listeners:
            listener(record)

    def append_line(self, line: str) -> None:
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def event(self, event: str, **fields: Any) -> None:
        """An events.jsonl line: wall-clock time, the event name, its fields."""
        self.append({"ts": time.time(), "event": event, **fields})

    def close(self) -> None:
        with self._lock:
            self._file.close()
