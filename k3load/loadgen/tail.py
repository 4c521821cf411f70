"""New whole JSON lines of a run's file as it grows: what the web UI's live state and the live search read.

Why a module of its own: the live page (k3load.loadgen.live) and the capacity search (k3load.loadgen.search_live)
both follow the run's files while they are written; the search is the session's, the page reads the session, so
the reader they share sits below both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from k3load.evidence import Follow, SeriesTable, evidence_file


class Tail:
    """New whole JSON lines of a run's file since the last read (a torn last line waits for its end): `name`
    compressed as it is written (k3load.evidence), or its legacy plain file. `table`: the metrics' series names
    (`SeriesTable`), kept across reads, that give a line back as it was before the writer's encoding.

    Why a generator with `since`: a reader may come back after hours (a capacity search begun late in a day, a
    web UI page opened late); it is given the lines one chunk at a time, and the lines before `since` (their
    `ts`) are only taught to the table, never decoded, so its memory does not grow with the run."""

    def __init__(self, run_dir: Path, name: str, table: SeriesTable | None = None) -> None:
        self.run_dir, self.name, self.table = run_dir, name, table
        self.follow: Follow | None = None  # of whichever of the two files is there first

    def lines(self, since: float | None = None) -> Iterator[dict[str, Any]]:
        """The new rows, decoded; with `since`, only those whose `ts` is at or after it (the others read past).
        Consume it whole: the position moves on as rows are given."""
        if self.follow is None:
            found = evidence_file(self.run_dir, self.name)
            if not found.exists():
                return
            self.follow = Follow(found)
        for line in self.follow.iter_new_lines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if since is not None and isinstance(row, dict) and _before(row.get("ts"), since):
                if self.table is not None:
                    self.table.learn(row)
                continue
            try:
                yield self.table.decode(row) if self.table is not None else row
            except ValueError:
                continue


def _before(ts: Any, since: float) -> bool:
    return isinstance(ts, (int, float)) and not isinstance(ts, bool) and ts < since
