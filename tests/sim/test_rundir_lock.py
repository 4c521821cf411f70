"""One run per directory (issue 37 item 6): a live run holds `DIR/.k3load.lock` (flock); a second run naming
DIR is refused with one line naming the live run's id and pid and never moves it aside; a dead run's
directory is set aside as before; a run whose directory was moved away while it ran judges nothing there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3load.evidence import RECORDS, lines
from k3load.loadgen.hold import RunHold
from k3load.rundir import JsonlLog, set_aside_previous_run
from k3load.rundir_lock import LOCK_NAME, RunDirBusy, RunDirLock, holder, in_use

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from pathlib import Path
from k3load.rundir_lock import RunDirLock
lock = RunDirLock.take(Path(sys.argv[1]), sys.argv[2])
print("held", flush=True)
time.sleep(60)
"""


def _hold_in_another_process(run_dir: Path, run_id: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), run_id], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def _previous_run(run: Path, run_id: str) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.json").write_text(json.dumps({"run_id": run_id}))
    (run / "events.jsonl").write_text(json.dumps({"ts": 1, "event": "run_start", "run_id": run_id}) + "\n")


def test_a_live_runs_directory_is_refused_naming_its_run_and_pid(tmp_path):
    run = tmp_path / "r1"
    _previous_run(run, "live-run")
    proc = _hold_in_another_process(run, "live-run")
    try:
        with pytest.raises(RunDirBusy) as refused:
            RunDirLock.take(run, "second")
        assert str(refused.value).startswith(f"{run} is in use by run live-run (pid {proc.pid} on ")
        assert "\n" not in str(refused.value)
        assert in_use(run) == str(refused.value)
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, "events.jsonl", "run.json"]  # nothing moved
    finally:
        proc.kill()
        proc.wait()
    assert in_use(run) is None  # the kernel dropped the dead process's lock


def test_a_dead_runs_directory_is_set_aside_and_the_lock_file_stays(tmp_path):
    run = tmp_path / "r1"
    _previous_run(run, "dead")
    (run / LOCK_NAME).write_text(json.dumps({"run_id": "dead", "pid": 999999, "host": "h"}))  # its lock free
    lock = RunDirLock.take(run, "new")
    try:
        assert holder(run)["run_id"] == "new" and holder(run)["pid"] == os.getpid()
        moved = set_aside_previous_run(run)
        assert moved == tmp_path / "r1.previous-dead"
        assert sorted(p.name for p in moved.iterdir()) == ["events.jsonl", "run.json"]
        assert [p.name for p in run.iterdir()] == [LOCK_NAME] and lock.moved() is None
    finally:
        lock.release()
    assert in_use(tmp_path / "nothing-here") is None and not (tmp_path / "nothing-here").exists()


def test_the_same_process_keeps_its_lock_across_the_web_uis_runs(tmp_path):
    """The web UI: each test a new run in the same directory, the same lock restamped; another directory
    given later drops the first."""
    hold = RunHold(lambda *_failed: None)
    hold.open(tmp_path / "r", "run-1")
    first = hold.lock
    hold.open(tmp_path / "r", "run-2")
    assert hold.lock is first and holder(tmp_path / "r")["run_id"] == "run-2"
    assert "in use by run run-2" in (in_use(tmp_path / "r") or "")
    hold.open(tmp_path / "other", "run-3")
    assert in_use(tmp_path / "r") is None and "run-3" in (in_use(tmp_path / "other") or "")
    hold.release()
    assert in_use(tmp_path / "other") is None


def test_a_directory_moved_or_emptied_while_the_run_is_live_is_no_longer_its_own(tmp_path):
    run = tmp_path / "r1"
    lock = RunDirLock.take(run, "mine")
    log = JsonlLog(run / RECORDS)
    try:
        assert lock.moved([(log.path, log.identity())]) is None
        os.rename(run / RECORDS, tmp_path / "elsewhere.gz")  # an old k3load emptying DIR into a sibling
        (run / RECORDS).write_bytes(b"")
        assert lock.moved([(log.path, log.identity())]) == (
            f"{run / RECORDS} is no longer the file this run wrote (moved out of {run} while the run was live)")
        os.rename(run, tmp_path / "r1.moved")  # an operator's mv, and a new DIR in its place
        run.mkdir()
        said = lock.moved()
        assert said == (f"{run} is no longer the directory this run opened (moved, removed or replaced while the "
                        f"run was live); its files are now at {tmp_path / 'r1.moved'}")
    finally:
        log.close()
        lock.release()


def test_a_file_written_beside_the_load_follows_the_directory_it_opened(tmp_path):
    """The design measurement finishes beside the load, maybe after an `mv`: its file goes to the run's own
    directory (by descriptor, wherever it went), never into the directory now at DIR (another run's)."""
    run = tmp_path / "r1"
    hold = RunHold(lambda *_failed: None)
    hold.open(run, "mine")
    try:
        hold.write_json("reuse_design.json", {"run_id": "mine"})
        assert json.loads((run / "reuse_design.json").read_text()) == {"run_id": "mine"}
        os.rename(run, tmp_path / "r1.moved")
        _previous_run(run, "other")
        other = {p.name: p.read_bytes() for p in run.iterdir()}
        hold.write_json("reuse_design.json", {"run_id": "mine", "late": True})
        assert {p.name: p.read_bytes() for p in run.iterdir()} == other
        moved = tmp_path / "r1.moved"
        assert json.loads((moved / "reuse_design.json").read_text()) == {"run_id": "mine", "late": True}
        assert sorted(p.name for p in moved.iterdir()) == [LOCK_NAME, "reuse_design.json"]  # no temp left
        assert (moved / "reuse_design.json").stat().st_mode & 0o777 == 0o600
    finally:
        hold.release()


# -- whole runs against the sim ------------------------------------------------------------------------------------

def _start(sim, out: Path, plan: Path, log_path: Path, run_id: str):
    from tests.sim.locust_runs import _locust_group, locust_cmd

    cmd = locust_cmd(sim.base_url, out, plan, "--k3-run-id", run_id)
    cmd = cmd[:cmd.index("--csv")] + cmd[cmd.index("--csv") + 2:]
    handle = log_path.open("w")
    return handle, _locust_group(cmd, handle, subprocess.STDOUT)


def _wait_for_records(out: Path, proc: subprocess.Popen, n: int = 5) -> None:
    from tests.sim.locust_runs import _lines

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _lines(out / RECORDS) < n and proc.poll() is None:
        time.sleep(0.2)
    assert _lines(out / RECORDS) >= n


def test_a_second_run_naming_a_live_runs_directory_exits_2_and_the_first_judges_its_own(start_sim, tmp_path):
    from tests.sim.locust_runs import VERDICT_CODES, _plan, run_locust

    sim = start_sim("--time-scale", "0.1")
    out = tmp_path / "shared"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 300, "users": 2, "mix": {"agent": 1}}])
    handle, group = _start(sim, out, plan, tmp_path / "first.log", "first")
    with handle, group as first:
        _wait_for_records(out, first)
        second = run_locust(sim.base_url, out, plan, "--k3-run-id", "second", timeout_s=120)
        assert first.poll() is None  # still live: the second was refused while it ran
        first.send_signal(signal.SIGTERM)  # ends as Ctrl-C does: its records judged
        first_code = first.wait(90)
    output = (tmp_path / "first.log").read_text()
    assert second.returncode == 2, second.stderr[-3000:]
    said = [x for x in second.stderr.splitlines() if "k3load" in x]
    assert said == [f"k3load: harness error: {out} is in use by run first (pid {first.pid} on "
                    f"{said[0].split(' on ')[1]}"], second.stderr[-3000:]
    assert "Traceback" not in second.stderr + output
    assert first_code in VERDICT_CODES, output[-3000:]
    assert not list(tmp_path.glob("shared.previous-*"))  # the live run was never moved aside
    records = [json.loads(x) for x in lines(out / RECORDS)]
    assert records and {r["run_id"] for r in records} == {"first"}
    agent = json.loads((out / "verdict.json").read_text())["pillars"]["agent_api"]["numbers"]
    assert agent["attempts"] + agent["timeout_drill"]["drills"] == len(records)


def test_a_run_whose_directory_is_moved_away_judges_nothing_there(start_sim, tmp_path):
    """An operator moves DIR aside while run 1 is live and puts another run's files at DIR: run 1 judges
    neither (exit 2, one line naming where its files went), and DIR's new files are left as they were."""
    from tests.sim.locust_runs import _plan

    sim = start_sim("--time-scale", "0.1")
    out = tmp_path / "r"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 300, "users": 2, "mix": {"agent": 1}}])
    handle, group = _start(sim, out, plan, tmp_path / "first.log", "first")
    with handle, group as first:
        _wait_for_records(out, first)
        os.rename(out, tmp_path / "r.moved")
        _previous_run(out, "other")  # another run's files now at DIR
        other = {p.name: p.read_bytes() for p in out.iterdir()}
        first.send_signal(signal.SIGTERM)  # its end: the check before the end's first write
        code = first.wait(90)
    output = (tmp_path / "first.log").read_text()
    assert code == 2, output[-3000:]
    said = [x for x in output.splitlines() if "is no longer the directory" in x]
    assert said == [f"k3load: harness error: {out} is no longer the directory this run opened (moved, removed or "
                    f"replaced while the run was live); its files are now at {tmp_path / 'r.moved'}: this run is "
                    "not judged (`k3load analyze` on its files judges them)"], output[-3000:]
    assert "Traceback" not in output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == other  # nothing written over the other run
    assert not (tmp_path / "r.moved" / "verdict.json").exists()
    assert {json.loads(x)["run_id"] for x in lines(tmp_path / "r.moved" / RECORDS)} == {"first"}
