"""Nobody in through the worker port (issue 36): the secrets are held out of Locust's options and only a
salted check travels, so a worker receives no secret from the master; a worker without the master's secrets
refuses the run and the master stops with one line, one with the same key in its own environment runs the
plan; a spool name sent over the port never points the master at another file; a worker's harness error
stops the master with one line. The web UI is test_webui_security.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from k3load.events import Message
from k3load.evidence import lines
from k3load.loadgen import held_secrets
from k3load.loadgen.options import run_access
from k3load.private_files import exposed
from tests.sim.locust_runs import ROOT, _free_port, _locust_group, _plan, locust_cmd
from tests.sim.test_workers_remote import _process, _wait
from tests.sim.ui_secrets import GATEWAY, HEADER, KEY, TARGET, _leaks


# -- the secrets held out of Locust's options ----------------------------------------------------------------
def test_the_secrets_leave_the_options_and_only_a_salted_check_travels() -> None:
    parsed = SimpleNamespace(k3_api_key=KEY, k3_header=[HEADER], k3_secrets_check="", k3_ca_bundle="",
                             k3_insecure=False)
    try:
        held = held_secrets.hold(parsed, TARGET + "/v1")
        assert parsed.k3_api_key == "" and parsed.k3_header == [] and held.origin == "http://127.0.0.1:8000"
        token = parsed.k3_secrets_check
        assert token.startswith("pbkdf2-sha256$") and not _leaks({"token": token})
        secrets, _tls = run_access(parsed)  # the options Locust relays are empty; the process still sends them
        assert secrets.request_headers() == {"Authorization": f"Bearer {KEY}", "X-Gateway-Token": GATEWAY}
        other = SimpleNamespace(k3_api_key="", k3_header=[])  # options built elsewhere (a test) get nothing held
        assert not run_access(other)[0]
        same = held_secrets.Held(KEY, (HEADER,))
        assert held_secrets.worker_problem(token, same, TARGET) is None
        assert held_secrets.worker_problem(token, same, "http://127.0.0.1:8001") is not None  # another target
        for why in (held_secrets.worker_problem(token, held_secrets.Held(), TARGET),
                    held_secrets.worker_problem(token, held_secrets.Held("sk-other", (HEADER,)), TARGET),
                    held_secrets.worker_problem("", same, TARGET), held_secrets.worker_problem("junk$1", same, TARGET),
                    held_secrets.worker_problem(token, held_secrets.Held(KEY, (HEADER,), "http://a:1"), TARGET)):
            assert why is not None and not _leaks({"why": why})
        assert held_secrets.worker_problem("", held_secrets.Held(), TARGET) is None
    finally:
        held_secrets.release()


# -- the worker port -----------------------------------------------------------------------------------------
SPY_WORKER = '''
"""A worker of the test's own: everything the master sends it, written to SPY_OUT."""
import json, os
from locust import User, constant, events, task
from locust.runners import WorkerRunner


class _Idle(User):
    abstract = True
    wait_time = constant(1)

    @task
    def idle(self):
        pass


AgentUser = type("AgentUser", (_Idle,), {})
ColdUser = type("ColdUser", (_Idle,), {})
LongInputUser = type("LongInputUser", (_Idle,), {})
SharedPrefixUser = type("SharedPrefixUser", (_Idle,), {})


def _dump(kind, data):
    with open(os.environ["SPY_OUT"], "a") as out:
        out.write(json.dumps({"kind": kind, "data": data}, default=str) + "\\n")


@events.init.add_listener
def _spy(environment, runner=None, **_kw):
    if not isinstance(runner, WorkerRunner):
        return
    receive = runner.client.recv

    def recv():
        msg = receive()
        _dump(msg.type, msg.data)
        return msg

    runner.client.recv = recv


@events.test_start.add_listener
def _options(environment, **_kw):
    _dump("parsed_options", vars(environment.parsed_options))
'''


def _master_cmd(sim: Any, out: Path, plan: Path, port: int, *extra: str) -> list[str]:
    return locust_cmd(sim.base_url, out, plan, "--master", "--expect-workers", "1", "--expect-workers-max-wait", "60",
                      "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port), "--k3-api-key", KEY,
                      "--k3-header", HEADER, "--stop-timeout", "2", *extra)


def _worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("K3_API_KEY", "K3_HEADER")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.slow
def test_a_worker_receives_no_secret_from_the_master(start_sim, tmp_path):
    sim, port, out = start_sim("--time-scale", "0.05"), _free_port(), tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 60, "users": 2, "mix": {"agent": 1}}])
    spy_file, spy_out = tmp_path / "spy.py", tmp_path / "spy.jsonl"
    spy_file.write_text(SPY_WORKER)
    spy_cmd = [sys.executable, "-m", "locust", "-f", str(spy_file), "--worker", "--master-host", "127.0.0.1",
               "--master-port", str(port)]
    logs = [tmp_path / "master.log", tmp_path / "spy.log"]
    with _process(_master_cmd(sim, out, plan, port), ROOT, logs[0]), logs[1].open("w") as spy_log, \
            subprocess.Popen(spy_cmd, cwd=tmp_path, stdout=spy_log, stderr=subprocess.STDOUT, start_new_session=True,
                             env=_worker_env(SPY_OUT=str(spy_out))) as spy:
        try:
            def received() -> set[str]:
                return {json.loads(line)["kind"] for line in spy_out.read_text().splitlines()} \
                    if spy_out.exists() else set()

            _wait(lambda: {"spawn", "parsed_options", Message.RUN.value} <= received(), 90,
                  "the spawn, the options and the run identity", logs)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(spy.pid, signal.SIGKILL)
    got = spy_out.read_text()
    assert not _leaks({"what the worker received": got})
    options = next(json.loads(line)["data"] for line in got.splitlines()
                   if json.loads(line)["kind"] == "parsed_options")
    assert options["k3_api_key"] == "" and options["k3_header"] == [] and options["k3_secrets_check"]
    assert not _leaks({"master log": logs[0].read_text()})


@pytest.mark.slow
def test_a_worker_without_the_masters_secrets_refuses_and_the_master_stops_with_one_line(start_sim, tmp_path):
    sim, port, out = start_sim("--time-scale", "0.05"), _free_port(), tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 60, "users": 2, "mix": {"agent": 1}}])
    worker_cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--worker",
                  "--master-host", "127.0.0.1", "--master-port", str(port), "--k3-worker-spool", "off"]
    logs = [tmp_path / "master.log", tmp_path / "worker.log"]
    start = time.monotonic()
    with _process(_master_cmd(sim, out, plan, port), ROOT, logs[0]) as master, logs[1].open("w") as worker_log, \
            _locust_group(worker_cmd, worker_log, subprocess.STDOUT) as _worker:
        returncode = master.wait(90)
    master_text, worker_text = logs[0].read_text(), logs[1].read_text()
    assert returncode == 2, master_text[-3000:]
    assert time.monotonic() - start < 60  # stopped at the refusal, not after the 60-second stage
    assert master_text.count("cannot take part") == 1 and "K3_API_KEY" in master_text, master_text[-3000:]
    assert "worker refuses the run" in worker_text and "Traceback" not in worker_text, worker_text[-3000:]
    assert not (out / "records.jsonl.gz").exists() or not "".join(lines(out / "records.jsonl.gz")).strip()
    assert not _leaks({"master": master_text, "worker": worker_text})


@pytest.mark.slow
def test_a_worker_with_the_same_key_in_its_environment_runs_the_masters_plan(start_sim, tmp_path):
    """The other side of the refusal: the key read by the worker itself, never relayed, and the run goes on."""
    from tests.sim.locust_runs import VERDICT_CODES
    from tests.sim.test_workers_remote import _records

    sim, port, out = start_sim("--time-scale", "0.05"), _free_port(), tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 60, "users": 2, "mix": {"agent": 1}}])
    master_cmd = [arg for arg in _master_cmd(sim, out, plan, port) if arg not in ("--k3-header", HEADER)]
    worker_cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--worker",
                  "--master-host", "127.0.0.1", "--master-port", str(port), "--k3-worker-spool", "off"]
    logs = [tmp_path / "master.log", tmp_path / "worker.log"]
    with _process(master_cmd, ROOT, logs[0]) as master, logs[1].open("w") as worker_log, \
            subprocess.Popen(worker_cmd, cwd=ROOT, stdout=worker_log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=_worker_env(K3_API_KEY=KEY)) as worker:
        try:
            _wait(lambda: _records(out) >= 2, 90, "two records from the worker", logs)
            master.send_signal(signal.SIGTERM)
            returncode = master.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # it leaves with its master
                os.killpg(worker.pid, signal.SIGKILL)
    assert returncode in VERDICT_CODES, logs[0].read_text()[-3000:]
    assert "refuse" not in logs[1].read_text() and not _leaks({"worker": logs[1].read_text()})
    assert exposed(out) == [] and (out / "locust_stats.csv").exists()  # Locust's own --csv outputs too


def test_a_spool_name_from_the_worker_port_never_points_the_master_at_another_file(tmp_path) -> None:
    """Whoever joins the worker port names its spool in `k3_join` / `k3_done`: only a name WorkerLink gives is
    read, directly under DIR/spool/ (a name like `../../x` or `/etc/x` is no spool at all)."""
    from k3load.loadgen.delivery import Workers

    workers = Workers()
    for i, name in enumerate(("../../secret.jsonl.gz", "/etc/passwd", "worker-1/../../x.jsonl", 7,
                              "worker-12.jsonl.gz\n", "worker-12.jsonl.gz")):
        workers.joined(f"w{i}", {"host": "h", "pid": 1, "spool": name})
        workers.done(f"w{i}", {"run_id": "r", "sent": 0, "unsent": 0, "spool": name})
    spools = [workers.tallies[f"w{i}"].spool for i in range(6)]
    assert spools == [None, None, None, None, None, "worker-12.jsonl.gz"]


@pytest.mark.slow
def test_a_workers_harness_error_stops_the_master_with_one_line_naming_it(start_sim, tmp_path):
    """Issue 38: a worker started from another directory (its --k3-scenarios 'scenarios/*.yaml' matches no file)
    says its harness error, tells the master, and both exit 2; the master never runs on with part of the load."""
    sim, port, out = start_sim("--time-scale", "0.05"), _free_port(), tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 60, "users": 2, "mix": {"agent": 1}}])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    worker_cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--worker",
                  "--master-host", "127.0.0.1", "--master-port", str(port), "--k3-worker-spool", "off"]
    logs = [tmp_path / "master.log", tmp_path / "worker.log"]
    start = time.monotonic()
    with _process(_master_cmd(sim, out, plan, port), ROOT, logs[0]) as master, logs[1].open("w") as worker_log, \
            subprocess.Popen(worker_cmd, cwd=elsewhere, stdout=worker_log, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env=_worker_env(K3_API_KEY=KEY, K3_HEADER=HEADER)) as worker:
        try:
            returncode = master.wait(90)
            worker_code = worker.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
    master_text, worker_text = logs[0].read_text(), logs[1].read_text()
    assert returncode == 2 and worker_code == 2, (master_text[-3000:], worker_text[-3000:])
    assert time.monotonic() - start < 60  # stopped at the worker's error, not after the 60-second stage
    named = [line for line in master_text.splitlines() if "cannot take part: harness error:" in line]
    assert len(named) == 1 and "matched no file" in named[0], master_text[-3000:]
    assert "Traceback" not in worker_text, worker_text[-3000:]
    assert not (out / "verdict.json").exists()
