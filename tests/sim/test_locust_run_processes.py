"""The locustfile over several processes (`--processes`, a master and its workers) against a real sim: no
record lost or duplicated, a trace's replay rows split over the workers, the master judging only when every
worker's turns ended and its records arrived (after Ctrl-C, SIGTERM or the plan's end), and the master's wait
for a worker whose records fell short (no sockets)."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml

from k3load.analysis.outputs.manifest import verify
from k3load.evidence import records_file
from k3load.records import read_records
from tests.sim.locust_runs import (
    VERDICT_CODES,
    _assert_each_served_request_recorded_once,
    _lines,
    _locust_group,
    _plan,
    _processes,
    locust_cmd,
    run_locust,
)

PROCESSES_PLAN = [{"name": name, "kind": "load", "duration_s": 5, "users": 6, "mix": {"agent": 1, "shared_prefix": 1}}
                  for name in ("load-a", "load-b")]
TRACE_ROWS = 12  # a replay stage after them: its rows split over the processes, each sent once (issue 28)


def _replay_stage(tmp_path: Path) -> dict:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 120 * i, "input_length": 40, "output_length": 4,
                                         "hash_ids": [i % 3]}) + "\n" for i in range(TRACE_ROWS)))
    return {"name": "replay-c", "kind": "replay", "trace": str(trace), "block_tokens": 64, "users": 4,
            "duration_s": 4}


@pytest.mark.slow
def test_processes_lose_and_duplicate_no_record(start_sim, tmp_path):
    sim = start_sim("--time-scale", "0.05")
    out = tmp_path / "run"
    run = run_locust(sim.base_url, out, _plan(tmp_path, [*PROCESSES_PLAN, _replay_stage(tmp_path)]), *_processes(2))
    assert run.returncode in VERDICT_CODES, run.stderr[-3000:]
    attempts = read_records(records_file(out))
    assert attempts
    _assert_each_served_request_recorded_once(attempts, sim)
    assert len({a.user_id.split("-")[-2] for a in attempts}) == 2  # both worker processes sent records
    stages = Counter(a.stage for a in attempts)  # each worker knows the stage the master's shape is in
    assert set(stages) == {"load-a", "load-b", "replay-c"}, stages
    rows = sorted(a.session_id for a in attempts if a.stage == "replay-c")  # every row once, over both workers
    assert rows == sorted(f"k3load-trace-row-{i}" for i in range(TRACE_ROWS)), rows
    assert len({a.user_id.split("-")[-2] for a in attempts if a.stage == "replay-c"}) == 2
    ends = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()
            if json.loads(line).get("event") == "replay_end"]  # each worker's, sent to the master
    assert sorted(e["share"] for e in ends) == ["0 of 2", "1 of 2"], ends
    assert sum(e["rows_sent"] for e in ends) == TRACE_ROWS and sum(e["rows_due"] for e in ends) == TRACE_ROWS
    assert verify(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "end"])
def test_processes_master_waits_for_every_worker_turn(start_sim, tmp_path, how):
    """Turns of about two seconds, longer than Locust's half-second wait for its workers at quit: the
    master judges only when every worker's users have stopped and every record it says it sent arrived,
    after a Ctrl-C to the whole process group (a terminal's) as after the plan's normal end."""
    import signal
    import time

    profile = tmp_path / "slow.yaml"
    profile.write_text(yaml.safe_dump({"faults": {"slow_first_token_rate": 1.0, "slow_first_token_ms": 1500}}))
    sim = start_sim("--time-scale", "1", "--profile", str(profile))
    out = tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 300 if how == "ctrl-c" else 8,
                             "users": 6, "mix": {"agent": 1, "shared_prefix": 1}}])
    log_path = tmp_path / "locust.log"
    with log_path.open("w") as log, \
            _locust_group(locust_cmd(sim.base_url, out, plan, *_processes(2)), log, subprocess.STDOUT) as proc:
        if how == "ctrl-c":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _lines(records_file(out)) < 6:
                time.sleep(0.2)
            assert _lines(records_file(out)) >= 6, log_path.read_text()[-3000:]
            os.killpg(proc.pid, signal.SIGINT)
        try:
            returncode = proc.wait(90)
        except subprocess.TimeoutExpired:  # seen once in 15 runs (Dec 3): keep what the master said
            raise AssertionError("the run did not stop within 90 s of the signal:\n"
                                 + log_path.read_text()[-6000:]) from None
    output = log_path.read_text()
    assert returncode in VERDICT_CODES, output[-3000:]
    attempts = read_records(records_file(out))
    _assert_each_served_request_recorded_once(attempts, sim)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    finals = [e for e in events if e["event"] == "worker_spools"]
    assert len(finals) == 1 and finals[0]["final"] == 2 and not finals[0]["not_final"], finals
    tallies = finals[0]["by_worker"].values()  # every record came by message: the spools were not needed
    assert all(t["sent"] == t["received"] > 0 and t["recovered"] == 0 for t in tallies), tallies
    assert "problems" not in json.loads((out / "validation_summary.json").read_text())
    assert verify(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("processes", [0, 2], ids=["local", "master"])
def test_sigterm_mid_run_stops_it_as_ctrl_c_does(start_sim, tmp_path, processes):
    """A CI timeout or `kubectl delete` (SIGTERM to the locust process, the master with --processes) in
    the middle of a stage: the users finish their turns and are recorded, then `run_end`, the analysis
    and verdict.json; the exit code is the verdict's, as with Ctrl-C."""
    import signal
    import time

    from k3load.analysis.verdict import EXIT_CODES

    sim = start_sim("--time-scale", "0.3")  # turns of a few hundred ms, six users: some in flight at the signal
    out = tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 300, "users": 6,
                             "mix": {"agent": 1, "shared_prefix": 1}}])
    log_path = tmp_path / "locust.log"
    extra = _processes(processes) if processes else []
    with log_path.open("w") as log, \
            _locust_group(locust_cmd(sim.base_url, out, plan, *extra), log, subprocess.STDOUT) as proc:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and _lines(records_file(out)) < 8:
            time.sleep(0.2)
        assert _lines(records_file(out)) >= 8, log_path.read_text()[-3000:]
        signal_ts = time.time()
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(40)  # users finish within --stop-timeout 10, then the analysis
    output = log_path.read_text()
    assert returncode in VERDICT_CODES, output[-3000:]
    events = [json.loads(line)["event"] for line in (out / "events.jsonl").read_text().splitlines()]
    assert events.count("run_end") == 1
    verdict = json.loads((out / "verdict.json").read_text())
    assert returncode == EXIT_CODES[verdict["verdict"]] and (out / "report.md").exists()
    attempts = read_records(records_file(out))
    _assert_each_served_request_recorded_once(attempts, sim)
    assert any(a.send_ts < signal_ts < a.end_ts for a in attempts)  # in flight at the signal, and recorded
    assert "stopping the run as Ctrl-C does" in output


def test_a_worker_whose_records_fell_short_is_named_after_the_bound(tmp_path):
    """The master's wait (no sockets): a worker is complete when it said `k3_done` and as many of its records
    arrived as it says it sent, or when its spool is sealed (the fallback on a shared disk); any other worker
    is returned once the bound passed, named with what is missing (never dropped silently)."""
    from k3load.loadgen.delivery import Tally, Workers
    from k3load.loadgen.spools import final_line, is_final

    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "worker-1.jsonl").write_text('{"attempt_id": "a"}\n' + json.dumps(final_line()) + "\n")
    (spool / "worker-2.jsonl").write_text('{"attempt_id": "b"}\n')
    workers = Workers({"w1": Tally(spool="worker-1.jsonl"),  # no message at all, but a sealed spool
                       "w2": Tally(spool="worker-2.jsonl", received=1),  # still running: no k3_done
                       "w3": Tally(host="pod-3", pid=7, received=5, sent=5),  # complete by message
                       "w4": Tally(host="pod-4", pid=8, received=3, sent=5, unsent=1)})  # two records short
    now = [0.0]
    pending = workers.wait(spool, 5.0, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert pending == ["w2", "w4"] and 5.0 <= now[0] < 5.2
    assert "w1" in workers.pending(spool, {"w1": 0.0}, now=1.0)  # a sealed spool waits 2 s for its messages first
    assert is_final(spool / "worker-1.jsonl") and not is_final(spool / "worker-2.jsonl")
    assert workers.describe("w4") == ("worker w4 (pod-4:8; sent 5 records, 3 arrived, 2 missing, 1 could not be "
                                      "sent; no spool: run directory not shared)")
    assert "1 records arrived, no final count; spool worker-2.jsonl" in workers.describe("w2")
    workers.received("w3")  # a record after its k3_done: its users run again, it is not complete until the next
    assert not workers.tallies["w3"].complete
