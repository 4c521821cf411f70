"""New whole JSON lines of a run's file as it grows: what the web UI's live state and the live search read.

Why a module of its own: the live page (k3load.loadgen.live) and the capacity search (k3load.loadgen.search_live)
both follow the run's files while they are written; the search is the session's, the page reads the session, so
the reader they share sits below both.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3load.evidence import Follow, evidence_file


class Tail:
    """New whole JSON lines of a run's file since the last read (a torn last line waits for its end): `name`
    compressed as it is written (k3load.evidence), or its legacy plain file; `decode` gives a line back as
    it was before the writer's encoding (metrics: `SeriesTable.decode`, its table kept across reads)."""

    def __init__(self, run_dir: Path, name: str, decode: Callable[[Any], Any] = lambda row: row) -> None:
        self.run_dir, self.name, self.decode = run_dir, name, decode
        self.follow: Follow | None = None  # of whichever of the two files is there first

    def lines(self) -> list[dict[str, Any]]:
        if self.follow is None:
            found = evidence_file(self.run_dir, self.name)
            if not found.exists():
                return []
            self.follow = Follow(found)
        out = []
        for line in self.follow.new_lines():
            try:
                out.append(self.decode(json.loads(line)))
            except ValueError:
                continue
        return out
