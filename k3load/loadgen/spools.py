"""Worker spools under `DIR/spool/`: the fallback copy of a worker's records where it shares the master's disk.

    worker  join_run   -> a spool only when the master's run directory is reachable (--processes, a shared
                          volume) and --k3-worker-spool is not off
    worker  test_stop  -> its users have stopped: FINAL line appended to its spool
    master  finish_run -> a worker whose messages fell short (k3load.loadgen.delivery) is read from its spool

Why only a fallback: workers on other machines have no such disk, so the messages are the path that must be
complete (k3load.loadgen.delivery counts them). A spool is final when its last line is FINAL (a worker that
starts users again appends records after it, and seals it again when they stop).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from k3load.clock import now
from k3load.records import jsonl_lines

FINAL_KEY = "k3_spool_final"


def final_line() -> dict[str, float | bool]:
    return {FINAL_KEY: True, "ts": now()}


def is_final(path: Path) -> bool:
    """Its last line is FINAL; only the file's tail is read (the master asks every 0.1 s while it waits)."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, 2) - 4096))
            lines = [x for x in jsonl_lines(handle.read().decode("utf-8", errors="replace")) if x.strip()]
    except OSError:
        return False
    if not lines:
        return False
    try:
        return bool(json.loads(lines[-1]).get(FINAL_KEY))
    except (ValueError, AttributeError):
        return False


def attempt_lines(path: Path) -> Iterator[tuple[str, str]]:
    """(attempt_id, line) of every whole record of a spool; FINAL lines and a torn last line skipped."""
    for line in jsonl_lines(path.read_text(encoding="utf-8")):
        try:
            attempt_id = json.loads(line).get("attempt_id")
        except (ValueError, AttributeError):
            continue
        if attempt_id:
            yield attempt_id, line
