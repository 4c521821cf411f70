"""The run directory: an earlier run found where a new one starts is moved whole to a sibling, never
mixed with the new run nor lost (no sockets, tmp dirs only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from k3load.analysis import manifest
from k3load.rundir import previous_run_id, set_aside_previous_run


def _previous_run(run: Path, run_id: str = "r1") -> None:
    """A finished run as a Locust run leaves it: logs, documents, evidence, a subfolder, Locust's CSV."""
    (run / "samples").mkdir(parents=True)
    (run / "evidence").mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": run_id, "unsigned_files": ["locust_stats.csv"]}))
    (run / "records.jsonl").write_text(json.dumps({"run_id": run_id, "attempt_id": "a1"}) + "\n")
    (run / "events.jsonl").write_text(json.dumps({"ts": 1, "event": "run_start", "run_id": run_id}) + "\n")
    (run / "verdict.json").write_text("{}\n")
    (run / "samples" / "agent.json").write_text("{}\n")
    (run / "evidence" / "startup.log").write_text("started\n")
    (run / "locust_stats.csv").write_text("old stats\n")
    manifest.write(run)


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_previous_run_moves_whole_to_a_sibling_named_after_its_run_id(tmp_path):
    run = tmp_path / "latest"
    _previous_run(run)
    before = _tree(run)
    moved = set_aside_previous_run(run)
    assert moved == tmp_path / "latest.previous-r1"
    assert _tree(moved) == before and manifest.verify(moved) == []
    assert run.is_dir() and list(run.iterdir()) == []


def test_files_in_use_stay_and_a_signed_one_is_copied_along(tmp_path):
    """Locust's --csv / --logfile outputs (open before the run starts) and this run's inputs stay put,
    also inside a subfolder; an input the previous manifest signed goes along as a copy too."""
    run = tmp_path / "latest"
    _previous_run(run)
    (run / "logs").mkdir()
    (run / "logs" / "locust.log").write_text("log line\n")
    (run / "logs" / "old.txt").write_text("old\n")
    manifest.write(run)
    keep = {run / "locust_stats.csv", run / "logs" / "locust.log", run / "evidence" / "startup.log"}
    moved = set_aside_previous_run(run, keep)
    assert moved is not None
    assert _tree(run) == {"locust_stats.csv": "old stats\n", "logs/locust.log": "log line\n",
                          "evidence/startup.log": "started\n"}
    assert {"records.jsonl", "run.json", "logs/old.txt", "evidence/startup.log"} <= set(_tree(moved))
    assert "locust_stats.csv" not in _tree(moved)  # unsigned: its run never vouched for it
    assert manifest.verify(moved) == []


def test_an_existing_sibling_is_never_overwritten(tmp_path):
    run = tmp_path / "latest"
    taken = tmp_path / "latest.previous-r1"
    taken.mkdir()
    (taken / "records.jsonl").write_text("older\n")
    _previous_run(run)
    moved = set_aside_previous_run(run)
    assert moved == tmp_path / "latest.previous-r1-2"
    assert (taken / "records.jsonl").read_text() == "older\n"
    _previous_run(run, "r1")
    assert set_aside_previous_run(run) == tmp_path / "latest.previous-r1-3"


def test_no_run_here_touches_nothing(tmp_path):
    assert set_aside_previous_run(tmp_path / "missing") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert set_aside_previous_run(empty) is None
    assert list(tmp_path.iterdir()) == [empty] and list(empty.iterdir()) == []
    baseline = tmp_path / "baseline"  # a side sampler's idle baseline, recorded for the run about to start
    baseline.mkdir()
    (baseline / "metrics.jsonl").write_text("{}\n")
    (baseline / "events.jsonl").write_text(json.dumps({"ts": 1, "event": "server_up"}) + "\n")
    assert set_aside_previous_run(baseline) is None
    assert sorted(p.name for p in baseline.iterdir()) == ["events.jsonl", "metrics.jsonl"]


def test_the_run_id_comes_from_run_json_then_run_start_then_the_mtime(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text('{"ts": 1, "event": "server_up"}\nnot json "run_start"\n'
                                      + json.dumps({"ts": 2, "event": "run_start", "run_id": "from-events"}) + "\n")
    assert previous_run_id(run) == "from-events"
    (run / "run.json").write_text(json.dumps({"run_id": "from-run-json"}))
    assert previous_run_id(run) == "from-run-json"
    (run / "run.json").write_text("{half")
    (run / "events.jsonl").unlink()
    os.utime(run, (0, 0))
    assert previous_run_id(run) == "19700101T000000Z"
    (run / "run.json").write_text(json.dumps({"run_id": "../../etc x"}))
    assert set_aside_previous_run(run) == tmp_path / "run.previous-etc_x"
