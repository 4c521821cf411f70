"""Only runs are judged (issue 38, part 4): `k3load analyze` and `k3load verify` on a folder that is not a run
directory exit 2 with one line and write nothing; a run in which every pillar is `not_run` is a harness
error saying so, never `limited`.

Each case runs the real command in a subprocess (the way an operator or CI meets it) and asserts the exit
code, exactly one line on stderr, nothing on stdout, the folder's files unchanged, and that it ended in
seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3load.analysis.cli import run_dir_problem

ROOT = Path(__file__).resolve().parents[2]
QUICK_S = 30  # "ends in seconds": a cold interpreter importing pandas on a loaded CI machine, with margin


def _k3load(*argv: str) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "k3load", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert time.monotonic() - started < QUICK_S, f"took {time.monotonic() - started:.1f} s"
    return done


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(done: subprocess.CompletedProcess[str], line: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [line], done.stderr


@pytest.mark.parametrize("command", ["analyze", "verify"])
def test_a_folder_holding_only_a_readme_is_refused_and_left_untouched(tmp_path: Path, command: str) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "README").write_text("not a run\n")
    before = _files(folder)
    _refused(_k3load(command, str(folder)),
             f"k3load {command}: {folder}: not a run directory (no run.json, no records.jsonl.gz)")
    assert _files(folder) == before  # no verdict.json, no reports, no manifest.sha256


def test_analyze_with_a_reference_writes_nothing_into_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    done = _k3load("analyze", str(folder), "--reference", str(tmp_path))
    _refused(done, f"k3load analyze: {folder}: not a run directory (no run.json, no records.jsonl.gz)")
    assert list(folder.iterdir()) == []  # not even reference.json


def test_a_run_in_which_every_pillar_is_not_run_is_a_harness_error_never_limited(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "r1"}))
    before = _files(run)
    done = _k3load("analyze", str(run), "--accept-limited")
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"k3load analyze: {run}: nothing could be judged, every pillar is not_run (compat: "
                                  "no compat.json: the precheck did not run; resources: ")
    assert _files(run) == before  # no verdict.json: `limited` on nothing would read as a judgment
    verified = _k3load("verify", str(run))
    assert verified.returncode == 1 and "manifest.sha256 is missing" in verified.stdout  # a run, never judged


def test_a_run_with_one_pillar_judged_gets_a_verdict(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "r1"}))
    (run / "compat.json").write_text(json.dumps({"status": "fail", "recipe": {"name": "kimi-k3"}, "rules": [
        {"id": "driver_branch", "status": "fail", "reason": "n01: driver 575.57.08 below R580"}]}))
    done = _k3load("analyze", str(run))
    assert done.returncode == 4 and "k3load verdict: rebuild" in done.stdout, done.stdout + done.stderr
    assert (run / "verdict.json").is_file() and _k3load("verify", str(run)).returncode == 0


def test_run_dir_problem_is_one_check_for_every_command(tmp_path: Path) -> None:
    assert run_dir_problem(tmp_path / "nope") == f"{tmp_path / 'nope'}: no such directory"
    (tmp_path / "file").write_text("x")
    assert run_dir_problem(tmp_path / "file") == f"{tmp_path / 'file'}: not a directory"
    assert run_dir_problem(tmp_path) == f"{tmp_path}: not a run directory (no run.json, no records.jsonl.gz)"
    (tmp_path / "records.jsonl").write_text("")  # a run from before the records were gzipped
    assert run_dir_problem(tmp_path) is None
    (tmp_path / "records.jsonl").unlink()
    (tmp_path / "run.json").write_text("{}")  # a run that stopped before its first request
    assert run_dir_problem(tmp_path) is None
