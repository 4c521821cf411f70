"""A directory that already holds a run is emptied into a sibling before a new run writes there.

Why: the logs are appended to and the analysis reads every line, so a second run into the same directory
would judge both runs' records and events together and sign the first run's leftovers into its own manifest.
Its own module because it is the run directory's one move (whole trees, kept files, the manifest read back),
not a way of writing a file (`k3load.rundir`, which re-exports these names for its callers).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Collection
from pathlib import Path

from k3load.events import Event
from k3load.evidence import LEGACY, RECORDS
from k3load.private_files import DIR_MODE, make_dirs
from k3load.rundir_lock import LOCK_NAME

RUN_MARKERS = ("run.json", RECORDS, LEGACY[RECORDS])  # with a `run_start` in events.jsonl: a run was here
_RUN_START_TEXT = f'"{Event.RUN_START.value}"'  # a line without it is not parsed


def set_aside_previous_run(run_dir: Path, keep: Collection[Path] = ()) -> Path | None:
    """Move the run already in `run_dir` to a new sibling `NAME.previous-RUNID` and return it (None
    when `run_dir` holds no run: missing, empty, or only a side sampler's baseline).

    Why: the logs are appended to and the analysis reads every line, so a second run into the same
    directory would judge both runs' records and events together and sign the first run's leftovers
    (verdict, reports, evidence) into its own manifest. Nothing is deleted or overwritten: the previous
    run keeps every file at the same relative path, so its manifest still verifies. `keep` (absolute
    paths) stay put: files this run already uses, such as Locust's --csv/--logfile outputs that Locust
    opened before the run started; a kept file the previous manifest signed is also copied along. The
    directory's lock file (k3load.rundir_lock) always stays: the run calling this holds it.
    """
    run_dir = Path(os.path.abspath(run_dir))
    run_id = previous_run_id(run_dir)
    if run_id is None:
        return None
    target = _new_sibling(run_dir, re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip("._") or "run")
    kept = {Path(os.path.abspath(p)) for p in keep} | {run_dir / LOCK_NAME}  # the lock: the new run's
    _move_tree(run_dir, target, kept)
    signed = read_manifest(target / "manifest.sha256")
    for path in sorted(kept):
        rel = path.relative_to(run_dir).as_posix() if path.is_relative_to(run_dir) else None
        if rel in signed and path.is_file():
            make_dirs((target / rel).parent)
            shutil.copy2(path, target / rel)
    return target


def previous_run_id(run_dir: Path) -> str | None:
    """The id of the run in `run_dir`: run.json's, else its run_start event's, else the directory's
    modification time; None when no run is there."""
    if not run_dir.is_dir():
        return None
    started = _run_start_id(run_dir / "events.jsonl")
    if started is None and not any((run_dir / name).exists() for name in RUN_MARKERS):
        return None
    try:
        info = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
        from_info = info.get("run_id") if isinstance(info, dict) else None
    except (OSError, ValueError):
        from_info = None
    return str(from_info or started or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(run_dir.stat().st_mtime)))


def _run_start_id(events: Path) -> str | None:
    """The first run_start event's run id ("" when it has none); None without a run_start."""
    try:
        with events.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if _RUN_START_TEXT not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("event") == Event.RUN_START:
                    return str(record.get("run_id") or "")
    except OSError:
        pass
    return None


def _new_sibling(run_dir: Path, run_id: str) -> Path:
    """A directory created here and now (an existing one is never reused): NAME.previous-ID[-N]."""
    n = 1
    while True:
        target = run_dir.with_name(f"{run_dir.name}.previous-{run_id}" + (f"-{n}" if n > 1 else ""))
        try:
            target.mkdir(mode=DIR_MODE)
            return target
        except FileExistsError:
            n += 1


def _move_tree(src: Path, dst: Path, keep: set[Path]) -> None:
    for entry in sorted(src.iterdir()):
        if entry in keep:
            continue
        if entry.is_dir() and not entry.is_symlink() and any(k.is_relative_to(entry) for k in keep):
            (dst / entry.name).mkdir(mode=DIR_MODE)
            _move_tree(entry, dst / entry.name, keep)
        else:
            shutil.move(entry, dst / entry.name)


def read_manifest(manifest: Path) -> dict[str, str]:
    """`manifest.sha256` as {relative path: sha256} (the `sha  path` lines of sha256sum); {} if absent."""
    try:
        lines = manifest.read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    return {rel: sha for sha, _, rel in (line.partition("  ") for line in lines)}
