"""Workers as on other machines: records and CPU readings reach the master by Locust messages only.

The end-to-end test starts a master (`--master --headless --expect-workers 2`) and two workers
(`--worker --master-host 127.0.0.1`) as separate processes on loopback, each worker in a directory of its
own and with `--k3-worker-spool off`, so no worker writes anything under the master's run directory (as on a
machine without a shared disk). It stops the master with SIGTERM mid-turn, so the workers' last turns end
after the stop, when Locust's master has quit listening (k3load.loadgen.delivery reads them then).

The unit tests judge hand-made stage data: each process's CPU per stage, and the saturation rule naming the
process that was saturated.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3load.analysis.pillars.headroom.pillar_resources import judge_resources
from k3load.analysis.pillars.headroom.stages import cpu_by_process
from k3load.analysis.pillars.pillar import thresholds
from k3load.analysis.run.record_columns import RecordColumns
from k3load.analysis.run.rundata import RunData, StageWindow
from k3load.analysis.run.timeline import MetricIndex
from k3load.evidence import lines, records_file
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.records import read_records
from k3load.sampler.cpu_wait import read_run_queue_ns
from tests.sim.locust_runs import (
    VERDICT_CODES,
    _assert_each_served_request_recorded_once,
    _free_port,
    _locust_group,
    locust_cmd,
)

ROOT = Path(__file__).resolve().parents[2]
DONE = re.compile(r"k3load: worker done: run (\S+), worker (\S+), pid (\d+): (\d+) records sent to the master, "
                  r"(\d+) could not be sent, spool (\S+)")


def _rows(stage: str, ttft_ms: float, count: int, t0: float) -> list[dict[str, Any]]:
    return [{"attempt_id": f"{stage}-{i}", "stage": stage, "status": "ok", "send_ts": t0 + i, "end_ts": t0 + i + 0.5,
             "ttft_ms": ttft_ms, "itl_mean_ms": 10.0, "e2e_ms": ttft_ms + 100, "completion_tokens": 10,
             "prompt_tokens": 100, "drill": False, "valid": True, "http_status": 200} for i in range(count)]


def _run(worker_b_pct: float) -> RunData:
    """Two stages of 10 s: `slow` (TTFT over its SLO) and `fine`; the master samples at 20-30 %, worker a at
    50 %, worker b at `worker_b_pct` during `slow` only."""
    records = RecordColumns.of([*_rows("slow", 60_000.0, 10, 0.0), *_rows("fine", 50.0, 10, 10.0)])
    metrics = [{"ts": t + 0.5, "ok": True, "load_generator_cpu_pct": 20.0 + t, "samples": {}} for t in range(10)]
    events = [{"ts": t + 0.5, "event": "load_generator_cpu", "process": process, "cpu_pct": pct}
              for t in range(20) for process, pct in (("worker a:1", 50.0), ("worker b:2", worker_b_pct if t < 10
                                                                                        else 40.0))]
    stages = [StageWindow("slow", "load", 0, 10, 4), StageWindow("fine", "soak", 10, 20, 4)]
    return RunData(path=Path("."), run={"options": {"master": True}}, columns=records, metrics=metrics,
                   events=events, stages=stages)


def test_each_process_cpu_per_stage_and_the_max_over_them():
    data = _run(worker_b_pct=99.0)
    assert cpu_by_process(data, 0, 10) == {"master": 29.0, "worker a:1": 50.0, "worker b:2": 99.0}
    assert cpu_by_process(data, 10, 20) == {"worker a:1": 50.0, "worker b:2": 40.0}
    _result, table = judge_resources(data, MetricIndex([]), thresholds(None))
    slow, fine = table
    assert slow.load_generator_cpu_max_pct == 99.0 and fine.load_generator_cpu_max_pct == 50.0
    assert slow.load_generator_cpu_max_pct_by_process == {"master": 29.0, "worker a:1": 50.0, "worker b:2": 99.0}
    old = RunData(path=Path("."), metrics=data.metrics, stages=data.stages)  # a local run: no worker events
    assert cpu_by_process(old, 0, 10) == {"local": 29.0}


def test_a_saturated_worker_makes_the_latency_of_its_stage_inconclusive_and_is_named():
    result, table = judge_resources(_run(worker_b_pct=99.0), MetricIndex([]), thresholds(None))
    assert {p.signal for p in table[0].problems} == {"latency"} and not table[1].problems
    assert result.status == INCONCLUSIVE, result.reasons
    assert result.reasons[0].startswith("inconclusive, because the load generator was saturated (CPU >= 95%) in "
                                        "slow (worker b:2 99%): the latencies measured there are the client's")
    assert result.numbers["load_generator_saturated"] == [{"stage": "slow", "processes": {"worker b:2": 99.0}}]
    calm, _ = judge_resources(_run(worker_b_pct=60.0), MetricIndex([]), thresholds(None))
    assert calm.status == FAIL and "stage slow (4 users): TTFT p95" in calm.reasons[0]


def test_a_stage_within_its_slos_with_a_saturated_worker_passes_and_says_so():
    data = _run(worker_b_pct=99.0)
    data.columns = RecordColumns.of(_rows("fine", 50.0, 10, 10.0))
    data.events = [{**e, "cpu_pct": 97.0} if e["process"] == "worker a:1" and e["ts"] > 10 else e for e in data.events]
    result, _ = judge_resources(data, MetricIndex([]), thresholds(None))
    assert result.status in (PASS, INCONCLUSIVE)  # no engine metrics in hand-made data: inconclusive for that
    numbers = result.numbers["load_generator_saturated"]
    assert {"stage": "fine", "processes": {"worker a:1": 97.0}} in numbers


class _Runner:
    """A worker's or a quit master's runner, as far as the link and the pump use one."""

    def __init__(self, fail: frozenset[str] = frozenset(), inbox: tuple[Any, ...] = ()) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.fail, self.inbox = set(fail), list(inbox)
        self.greenlet: list[Any] = []  # Locust's greenlets: none left once its master quit
        self.custom_messages: dict[str, tuple[Any, bool]] = {}
        self.environment, self.client_id = None, "node-1"
        self.server = self

    def send_message(self, kind: str, data: Any = None) -> None:
        from locust.exception import RPCSendError

        if kind in self.fail:
            raise RPCSendError("ZMQ sent failure")
        self.sent.append((kind, data))

    def recv_from_client(self) -> tuple[str, Any]:
        return "node-1", self.inbox.pop(0)


def test_a_worker_counts_what_it_sent_and_spools_only_into_this_runs_directory(tmp_path, caplog):
    from k3load.loadgen.worker import WorkerLink

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "run.json").write_text(json.dumps({"run_id": "r1"}))
    runner = _Runner()
    link = WorkerLink(runner)
    link.join("r2", shared)  # a directory of that name, but another run's: not the master's
    assert link.spool is None and runner.sent[-1][1]["spool"] is None
    link.join("r1", shared)
    assert link.spool_name and runner.sent[-1] == ("k3_join", {"run_id": "r1", "spool": link.spool_name,
                                                               "host": runner.sent[-1][1]["host"], "pid": os.getpid()})
    link.send('{"attempt_id": "a"}')
    runner.fail = {"k3_record"}
    link.send('{"attempt_id": "b"}')  # Locust gave up sending it: counted, and still in the spool
    runner.fail = set()
    with caplog.at_level("WARNING", logger="k3load"):
        link.seal()
    assert runner.sent[-1] == ("k3_done", {"run_id": "r1", "sent": 1, "unsent": 1, "spool": link.spool_name})
    assert DONE.search(caplog.text).groups()[3:] == ("1", "1", link.spool_name)
    assert "".join(lines(shared / "spool" / link.spool_name)).count("attempt_id") == 2  # sealed: flushed at once
    assert WorkerLink(_Runner(), "off").spool_mode == "off"


def test_after_locusts_master_quit_the_wait_reads_the_workers_messages_itself():
    from locust.rpc import Message

    from k3load.loadgen.delivery import pump

    seen = []
    runner = _Runner(inbox=(Message("k3_done", {"sent": 0}, "node-1"), Message("heartbeat", {}, "node-1")))
    runner.custom_messages["k3_done"] = (lambda environment, msg: seen.append(msg.data), False)
    runner.custom_messages["heartbeat"] = (lambda environment, msg: seen.append("not ours"), False)
    assert pump(runner, 0.01) and not pump(runner, 0.01)  # a k3_* message handled; Locust's own dropped
    assert seen == [{"sent": 0}]
    runner.greenlet = ["Locust's listener"]  # still listening: the wait only sleeps
    assert not pump(runner, 0.01)


@contextlib.contextmanager
def _process(cmd: list[str], cwd: Path, log_path: Path) -> Iterator[subprocess.Popen]:
    """One Locust process in its own session, its output in `log_path`; SIGKILL to its group at exit."""
    with log_path.open("w") as log, _locust_group(cmd, log, subprocess.STDOUT, cwd) as proc:
        yield proc


def _worker_dir(tmp_path: Path, name: str) -> Path:
    """A working directory of the worker's own: the scenarios copied (as an image would hold them), nothing
    of the master's run directory."""
    home = tmp_path / name
    shutil.copytree(ROOT / "scenarios", home / "scenarios")
    return home


def _worker_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--worker",
            "--master-host", "127.0.0.1", "--master-port", str(port), "--k3-worker-spool", "off"]


def _records(out: Path) -> int:
    path = records_file(out)
    return sum(line.endswith("\n") for line in lines(path)) if path.exists() else 0


def _wait(condition: Any, timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s} s:\n" + "\n".join(p.read_text()[-3000:] for p in logs))


@pytest.mark.slow
def test_remote_workers_records_reach_the_master_by_message_exactly_once(start_sim, tmp_path):
    profile = tmp_path / "slow.yaml"  # every turn stalls 2.5 s before its first token: turns are in flight at stop
    profile.write_text(yaml.safe_dump({"faults": {"slow_first_token_rate": 1.0, "slow_first_token_ms": 2500}}))
    sim = start_sim("--time-scale", "1", "--profile", str(profile))
    out, port = tmp_path / "run", _free_port()
    plan = tmp_path / "plan.yaml"
    load = {"name": "load", "kind": "load", "duration_s": 300, "users": 4, "mix": {"agent": 1, "shared_prefix": 1}}
    plan.write_text(yaml.safe_dump({"name": "remote", "stages": [load]}))
    master_cmd = locust_cmd(sim.base_url, out, plan, "--master", "--expect-workers", "2", "--expect-workers-max-wait",
                            "60", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port))
    logs = [tmp_path / "master.log", tmp_path / "worker-1.log", tmp_path / "worker-2.log"]
    with _process(master_cmd, ROOT, logs[0]) as master, \
            _process(_worker_cmd(port), _worker_dir(tmp_path, "w1"), logs[1]) as one, \
            _process(_worker_cmd(port), _worker_dir(tmp_path, "w2"), logs[2]) as two:
        _wait(lambda: _records(out) >= 4, 90, "four records", logs)
        signal_ts = time.time()
        master.send_signal(signal.SIGTERM)  # only the master: its workers hear it by message, as on other machines
        returncode = master.wait(60)
        one.wait(30), two.wait(30)  # both workers leave when the master quits (TimeoutExpired if not)
    master_log, worker_logs = logs[0].read_text(), [p.read_text() for p in logs[1:]]
    assert returncode in VERDICT_CODES, master_log[-3000:]
    assert not (out / "spool").exists()  # no worker reached the run directory: messages were the only path
    attempts = read_records(records_file(out))
    ids = [a.attempt_id for a in attempts]
    assert len(ids) == len(set(ids))
    _assert_each_served_request_recorded_once(attempts, sim)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    by_pid = {}
    for text in worker_logs:
        done = [m for m in DONE.finditer(text) if m.group(1) == run_id]
        assert done, text[-3000:]
        _run_id, _node, pid, sent, unsent, spool = done[-1].groups()
        assert unsent == "0" and spool == "none", text[-2000:]
        by_pid[pid] = int(sent)
    mine = {pid: sum(1 for a in attempts if a.user_id.split("-")[-2] == pid) for pid in by_pid}
    assert mine == by_pid and all(by_pid.values()), (mine, by_pid)  # each worker's every attempt, once
    assert len(attempts) == sum(by_pid.values())
    assert any(a.end_ts > signal_ts + 0.5 for a in attempts)  # turns that ended after the stop are in
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    (ledger,) = [e for e in events if e["event"] == "worker_spools"]
    assert ledger["final"] == 2 and not ledger["not_final"], ledger
    assert sorted(t["received"] for t in ledger["by_worker"].values()) == sorted(by_pid.values())
    cpu = {e["process"] for e in events if e["event"] == "load_generator_cpu"}
    assert {p.split(":")[-1] for p in cpu} == set(by_pid), cpu  # each worker's own CPU reached the run directory
    if read_run_queue_ns() is not None:  # this kernel counts run-queue time: each worker sent its wait with its CPU
        waits = {e["process"] for e in events if e["event"] == "load_generator_cpu"
                 and isinstance(e.get("cpu_wait_pct"), float) and 0 <= e["cpu_wait_pct"] <= 100}
        assert waits == cpu, events
    verdict = json.loads((out / "verdict.json").read_text())
    (stage,) = verdict["pillars"]["resources"]["numbers"]["stages"]
    assert set(stage["load_generator_cpu_max_pct_by_process"]) == cpu | {"master"}
    assert "### Load generator CPU" in (out / "report.md").read_text()
    if read_run_queue_ns() is not None:  # each process's wait for a CPU, the master's from its metrics lines
        assert set(stage["load_generator_cpu_wait_pct_by_process"]) == cpu | {"master"}, stage
        assert "Waiting for a CPU" in (out / "report.md").read_text()
