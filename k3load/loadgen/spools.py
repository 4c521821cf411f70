"""Worker spools under `DIR/spool/`, and the master's wait until every worker's are final.

    worker  join_run   -> `k3_spool` {"spool": name or None} to the master
    worker  test_stop  -> its users have stopped: FINAL line appended to its spool, `k3_done` to the master
    master  quitting   -> `wait_final`: each worker said `k3_done` or its spool ends with FINAL (bounded)

Why: Locust's `MasterRunner.quit()` waits half a second for its workers and then stops listening, while a
worker's users may still finish turns for up to --stop-timeout. A spool is final when its last line is
FINAL (a worker that starts users again appends records after it, and seals it again when they stop).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from k3load.clock import now

FINAL_KEY = "k3_spool_final"


def final_line() -> dict[str, float | bool]:
    return {FINAL_KEY: True, "ts": now()}


def is_final(path: Path) -> bool:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
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
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            attempt_id = json.loads(line).get("attempt_id")
        except (ValueError, AttributeError):
            continue
        if attempt_id:
            yield attempt_id, line


@dataclass
class Workers:
    """The master's view: which workers joined (with their spool, if they keep one), which said done."""

    spools: dict[str, str | None] = field(default_factory=dict)  # worker id -> spool file name
    done: set[str] = field(default_factory=set)

    def pending(self, spool_dir: Path) -> list[str]:
        return sorted(w for w, name in self.spools.items()
                      if w not in self.done and not (name and is_final(spool_dir / name)))

    def wait_final(self, spool_dir: Path, timeout_s: float, sleep: Callable[[float], object],
                   clock: Callable[[], float] = time.monotonic) -> list[str]:
        """Waits until every worker is final or `timeout_s` passed; returns the workers still not final."""
        deadline = clock() + timeout_s
        pending = self.pending(spool_dir)
        while pending and clock() < deadline:
            sleep(0.1)
            pending = self.pending(spool_dir)
        return pending

    def describe(self, worker: str) -> str:
        name = self.spools.get(worker)
        return f"worker {worker} (spool {name})" if name else f"worker {worker} (no spool: run directory not shared)"
