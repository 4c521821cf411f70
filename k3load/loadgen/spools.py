"""Worker spools under `DIR/spool/`: the fallback copy of a worker's records where it shares the master's disk.

    worker  join_run   -> a spool only when the master's run directory is reachable (--processes, a shared
                          volume) and --k3-worker-spool is not off
    worker  test_stop  -> its users have stopped: FINAL line appended to its spool
    master  finish_run -> a worker whose messages fell short (k3load.loadgen.delivery) is read from its spool

Why only a fallback: workers on other machines have no such disk, so the messages are the path that must be
complete (k3load.loadgen.delivery counts them). A spool is final when its last line is FINAL (a worker that
starts users again appends records after it, and seals it again when they stop).

Why compressed (`worker-PID.jsonl.gz`, k3load.evidence): a spool copies every record of its worker into the
run directory; plain, an hour of `--processes` would add 650 MB beside 90 MB of records.jsonl.gz. The worker
flushes its seal at once; `is_final` follows each spool from where it last read (the master asks every 0.1 s).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from k3load.clock import now
from k3load.evidence import Follow, lines
from k3load.records import jsonl_lines

FINAL_KEY = "k3_spool_final"


def final_line() -> dict[str, float | bool]:
    return {FINAL_KEY: True, "ts": now()}


class SpoolTails:
    """The last whole line of each compressed spool, read on from where the last look stopped."""

    def __init__(self) -> None:
        self._follows: dict[Path, tuple[Follow, str]] = {}

    def last_line(self, path: Path) -> str:
        follow, last = self._follows.get(path) or (Follow(path), "")
        for line in follow.iter_new_lines():  # a day's spool read on a chunk at a time, only its last line kept
            if line.strip():
                last = line
        self._follows[path] = (follow, last)
        return last

    def forget(self, spool_dir: Path) -> None:
        """A run's spools read for the last time (its end): their followers let go, so a master that runs test
        after test from the web UI (each its own run directory) keeps none of the runs before."""
        for path in [p for p in self._follows if p.parent == spool_dir]:
            del self._follows[path]

    def __len__(self) -> int:
        return len(self._follows)


TAILS = SpoolTails()  # the master's, for the run's spools (a spool is only ever appended to)


def is_final(path: Path, tails: SpoolTails = TAILS) -> bool:
    """Its last line is FINAL; only what is new is read (the master asks every 0.1 s while it waits): a plain
    spool's last 4 KB, a compressed one's bytes since the last look."""
    if path.name.endswith(".gz"):
        return _final(tails.last_line(path))
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, 2) - 4096))
            tail = [x for x in jsonl_lines(handle.read().decode("utf-8", errors="replace")) if x.strip()]
    except OSError:
        return False
    return _final(tail[-1]) if tail else False


def _final(line: str) -> bool:
    try:
        return bool(json.loads(line).get(FINAL_KEY))
    except (ValueError, AttributeError):
        return False


def attempt_lines(path: Path) -> Iterator[tuple[str, str]]:
    """(attempt_id, line without its "\\n") of every whole record of a spool (compressed or plain); FINAL lines
    and a torn last line skipped."""
    for line in (x.removesuffix("\n") for x in lines(path)):
        try:
            attempt_id = json.loads(line).get("attempt_id")
        except (ValueError, AttributeError):
            continue
        if attempt_id:
            yield attempt_id, line
