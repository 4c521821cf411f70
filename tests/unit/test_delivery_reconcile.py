"""The master's reconcile at a run's end without a set of every attempt id (issue 31): a short worker's spool
adds only what the records file lacks, each once, and a message arriving late for an added attempt is dropped."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from k3load.evidence import RECORDS, lines, records_file
from k3load.loadgen.delivery import Tally, Workers, _reconcile, on_record, written_ids
from k3load.loadgen.open_run import OpenRun
from k3load.rundir import JsonlLog, WriteGuard
from k3load.workload.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]


def _record(attempt_id: str, run_id: str = "r1") -> str:
    return json.dumps({"run_id": run_id, "attempt_id": attempt_id, "stage": "load"})


def _run(run_dir: Path) -> OpenRun:
    guard = WriteGuard(lambda path, exc: None)
    return OpenRun("r1", run_dir, load_plan(ROOT / "plans" / "smoke.yaml"), JsonlLog(run_dir / RECORDS, guard=guard),
                   JsonlLog(run_dir / "events.jsonl", guard=guard), guard, None)  # type: ignore[arg-type]


def _ids(run_dir: Path) -> list[str]:
    return [json.loads(line)["attempt_id"] for line in lines(records_file(run_dir)) if line.endswith("\n")]


def test_a_short_workers_spool_adds_what_the_records_lack_once_and_a_late_message_is_dropped(tmp_path):
    run = _run(tmp_path / "run")
    for attempt_id in ("a", "b"):  # arrived by message (b twice in the spool: a worker resent it there)
        run.records.append_line(_record(attempt_id))
    spool = tmp_path / "run" / "spool"
    spool.mkdir()
    (spool / "worker-1.jsonl").write_text("".join(_record(x) + "\n" for x in ("a", "b", "c", "b", "d", "c"))
                                          + '{"attempt_id": "e", "torn')  # the worker died mid-line
    (spool / "worker-2.jsonl").write_text(_record("z") + "\n")  # complete by message: never read
    workers = Workers({"w1": Tally(spool="worker-1.jsonl", received=2, sent=6),
                       "w2": Tally(spool="worker-2.jsonl", received=1, sent=1)})

    def write(attempt_id: str, line: str) -> bool:
        run.records.append_line(line)
        return True

    assert written_ids(run, {"a", "c", "x"}) == {"a"}  # read from the file, flushed first
    assert _reconcile(workers, write, spool, lambda among: written_ids(run, among)) == 2
    assert workers.tallies["w1"].recovered == 2 and workers.recovered == {"c", "d"}
    session = SimpleNamespace(run_id="r1", workers=workers, write_record_line=write)
    on_record(session, "w1", _record("c"))  # its message came after the wait: not written twice
    on_record(session, "w1", _record("f"))  # one the spool never had: written
    run.records.close()
    assert _ids(tmp_path / "run") == ["a", "b", "c", "d", "f"]
    assert workers.tallies["w1"].received == 4


def test_no_short_worker_reads_no_file(tmp_path):
    workers = Workers({"w1": Tally(spool="worker-1.jsonl", received=3, sent=3)})
    asked: list[set[str]] = []
    assert _reconcile(workers, lambda *_: True, tmp_path, lambda among: asked.append(among) or set()) == 0
    assert asked == []


def test_a_message_that_arrives_while_the_spools_are_read_is_not_added_again(tmp_path):
    """The records file is read once (flushed first), then the spool's missing lines are written: a message
    handled in between (the flush may let the hub run) is written by its handler and not again from the spool."""
    run = _run(tmp_path / "run")
    spool = tmp_path / "run" / "spool"
    spool.mkdir()
    (spool / "worker-1.jsonl").write_text("".join(_record(x) + "\n" for x in ("a", "b")))
    workers = Workers({"w1": Tally(spool="worker-1.jsonl", received=0, sent=2)})

    def write(attempt_id: str, line: str) -> bool:
        run.records.append_line(line)
        return True

    session = SimpleNamespace(run_id="r1", workers=workers, write_record_line=write)

    def written(among: set[str]) -> set[str]:
        found = written_ids(run, among)
        on_record(session, "w1", _record("b"))  # its message, handled after the file was read
        return found

    assert _reconcile(workers, write, spool, written) == 1 and workers.recovered == {"a"}
    assert workers.during_reconcile is None
    run.records.close()
    assert sorted(_ids(tmp_path / "run")) == ["a", "b"]
