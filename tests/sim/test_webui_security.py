"""Nobody in through the web UI or the worker port (issue 36): no command, target, path or secret from a visitor,
no secret in any page, route or message, and a worker without the master's secrets refuses the run."""

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
from k3load.loadgen import held_secrets, ui_guard
from k3load.loadgen.live import LINKS
from k3load.loadgen.options import LIVE_OPTIONS, SAFE_WEB_HOST, add_options, run_access
from k3load.private_files import exposed
from tests.sim.locust_runs import ROOT, _free_port, _locust_group, _plan, locust_cmd
from tests.sim.test_workers_remote import _process, _wait
from tests.webui_fixtures import WebUI, web_ui_fixture  # noqa: F401  (the web_ui fixture)

KEY = "sk-k3-UI-SECRET-93be1"
GATEWAY = "gw-UI-SECRET-5c0d"
HEADER = f"X-Gateway-Token: {GATEWAY}"
SECRETS = (KEY, GATEWAY)
PLANS = ROOT / "plans"
TARGET = "http://127.0.0.1:8000"


def _leaks(texts: dict[str, str]) -> list[str]:
    return [f"{where}: {secret}" for where, text in texts.items() for secret in SECRETS if secret in text]


# -- what a start request may set -------------------------------------------------------------------------
FIXED = {"k3_server_log_cmd": "bash -c 'id > /tmp/proof'", "k3_restart_cmd": "touch /tmp/proof",
         "k3_out": "/tmp/elsewhere", "k3_metrics_url": "http://10.0.0.9:9/metrics",
         "k3_gpu_metrics_url": "http://10.0.0.9:9/metrics", "k3_prometheus_url": "http://10.0.0.9:9090",
         "k3_api_key": "sk-other", "k3_header": "X-A: b", "k3_recipe": "recipes/local-dev.yaml",
         "k3_scenarios": "/etc/*", "k3_run_id": "../../escape", "k3_insecure": "true", "k3_ca_bundle": "/tmp/ca.pem",
         "k3_server_log": "/etc/shadow", "k3_startup_log": "/etc/shadow", "k3_judge": "someone",
         "k3_accept_limited": "true", "k3_reference": "/tmp", "k3_secrets_check": "pbkdf2-sha256$1$00$00",
         "html_file": "/tmp/r.html", "csv_prefix": "/tmp/x", "logfile": "/tmp/l", "json_file": "/tmp/j",
         "locustfile": "/tmp/evil.py", "web_login": "false", "master_host": "10.0.0.9"}


@pytest.mark.parametrize("name", sorted(FIXED))
def test_a_start_request_that_sets_anything_fixed_at_start_is_refused_without_its_value(name: str) -> None:
    form = {"user_count": "1", "spawn_rate": "1", "host": TARGET, name: FIXED[name]}
    why = ui_guard.refusal(form, TARGET, PLANS)
    assert why is not None and name in why and FIXED[name] not in why


def test_a_field_name_is_said_on_one_line_whatever_the_visitor_sent() -> None:
    why = ui_guard.refusal({"x\nk3load: forged line": "1"}, TARGET, PLANS) or ""
    assert "\n" not in why and "forged" in why
    assert "\n" not in (ui_guard.user_settings_refusal({"a\nb": 1}, TARGET) or "")


def test_users_rates_live_options_and_a_shipped_plan_pass_and_the_target_is_bound_to_its_origin() -> None:
    live = {"user_count": "4", "spawn_rate": "2", "run_time": "1m", "profile": "p", "shape_class": "Default",
            "user_classes": "AgentUser", "host": TARGET + "/", "k3_plan": "smoke", "k3_seed": "3",
            "k3_model": "m", "k3_transport": "httpx", "k3_sample_interval": "2", "k3_max_body_bytes": "10",
            "k3_max_line_bytes": "10"}
    assert set(live) - {"host"} <= ui_guard.SWARM_FIELDS | LIVE_OPTIONS
    assert ui_guard.refusal(live, TARGET, PLANS) is None
    assert ui_guard.refusal({"host": "HTTP://127.0.0.1:8000/v1"}, TARGET, PLANS) is None  # the same origin
    assert ui_guard.refusal({"host": "http://localhost:80"}, "http://localhost", PLANS) is None  # default port
    for other in ("http://127.0.0.1:8001", "https://127.0.0.1:8000", "http://evil.example:8000", "not a url",
                  "http://user:pw@10.1.1.1:8000"):
        why = ui_guard.refusal({"host": other}, TARGET, PLANS)
        assert why is not None and "bound" in why and "pw" not in why, other
    assert "bound" in (ui_guard.refusal({"host": TARGET}, None, PLANS) or "")  # no target given at start
    for plan in ("../plans/smoke", "/tmp/plan.yaml", "nosuchplan", "smoke.yaml"):
        assert "plan" in (ui_guard.refusal({"k3_plan": plan}, TARGET, PLANS, "/srv/mine.yaml") or ""), plan
    # the page sends the live options back as they are: the plan file given at start passes
    assert ui_guard.refusal({"k3_plan": "/srv/mine.yaml"}, TARGET, PLANS, "/srv/mine.yaml") is None


def test_the_live_options_pass_under_the_names_locusts_page_gives_them_and_are_read_as_values() -> None:
    """Locust's page camelCases option names and snake_cases them back, mangling the digit of `k3_`: its start
    request carries `k_3plan`, `k_3max_body_bytes`, ... (seen from the page in test_webui_browser)."""
    assert ui_guard.page_name("k3_max_body_bytes") == "k_3max_body_bytes"
    assert ui_guard.page_name("k3_plan") == "k_3plan" and ui_guard.page_name("user_count") == "user_count"
    assert set(ui_guard.LIVE_TYPES) == set(LIVE_OPTIONS) and set(ui_guard.PAGE_NAMES.values()) == set(LIVE_OPTIONS)
    page = {"user_count": "2", "spawn_rate": "1", "host": TARGET, "k_3plan": "smoke", "k_3seed": "7",
            "k_3model": "", "k_3transport": "httpx", "k_3sample_interval": "0.5", "k_3max_body_bytes": "100",
            "k_3max_line_bytes": "50"}
    assert ui_guard.refusal(page, TARGET, PLANS) is None
    assert ui_guard.live_settings(page) == {"k3_plan": "smoke", "k3_seed": 7, "k3_model": "", "k3_transport": "httpx",
                                            "k3_sample_interval": 0.5, "k3_max_body_bytes": 100,
                                            "k3_max_line_bytes": 50}
    for key, bad in (("k_3seed", "x"), ("k3_transport", "curl"), ("k_3max_body_bytes", "0"),
                     ("k_3sample_interval", "nan"), ("k_3plan", "/etc/passwd")):
        assert ui_guard.refusal({**page, key: bad}, TARGET, PLANS) is not None, key


def test_user_settings_change_only_tasks_weight_and_count() -> None:
    ok = {"user_class_name": "AgentUser", "tasks": ["play"], "weight": 2, "fixed_count": 0}
    assert ui_guard.user_settings_refusal(ok, TARGET) is None
    assert "target" in (ui_guard.user_settings_refusal({**ok, "host": "http://evil:1"}, TARGET) or "")
    assert "wait_time" in (ui_guard.user_settings_refusal({**ok, "wait_time": 0}, TARGET) or "")
    assert ui_guard.user_settings_refusal(["not", "an", "object"], TARGET) is not None


def test_only_the_live_options_reach_the_page_and_the_web_ui_binds_to_loopback_by_default() -> None:
    from locust.argument_parser import get_parser

    parser = get_parser()  # Locust's own, with k3load's options added as the locustfile's listener does
    add_options(parser)
    shown = {dest for dest in parser.args_included_in_web_ui if dest.startswith("k3_")}
    assert shown == set(LIVE_OPTIONS)
    assert not {"k3_api_key", "k3_header"} & set(parser.secret_args_included_in_web_ui)
    assert parser.parse_args([]).web_host == SAFE_WEB_HOST == "127.0.0.1"
    assert parser.parse_args(["--web-host", "0.0.0.0"]).web_host == "0.0.0.0"


def test_exposure_is_said_for_a_web_ui_or_worker_port_beyond_loopback_only() -> None:
    def said(**opts: Any) -> list[str]:
        parsed = SimpleNamespace(**{"web_host": "127.0.0.1", "web_login": False, "master_bind_host": "127.0.0.1",
                                    "master_bind_port": 5557, **opts})
        return list(ui_guard.exposure_warnings(parsed, True, True))

    assert said() == [] and said(web_host="::1", master_bind_host="localhost") == []
    assert said(web_host="0.0.0.0", web_login=True) == []
    (web,) = said(web_host="0.0.0.0")
    assert "without --web-login" in web and "SSH tunnel" in web
    assert len(said(web_host="", master_bind_host="*")) == 2 and len(said(web_host="10.0.0.5")) == 1


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


# -- the web UI, attacked ------------------------------------------------------------------------------------
LOCUST_GET_ROUTES = ("/", "/stats/requests", "/stats/report", "/stats/requests/csv",
                     "/stats/requests_full_history/csv", "/stats/failures/csv", "/exceptions", "/exceptions/csv",
                     "/tasks", "/logs", "/worker-count")
K3_GET_ROUTES = ("/k3load/state", "/k3load/", "/k3load/tab.js", *(f"/k3load/run/{name}" for name in LINKS))


def test_the_route_list_covers_every_get_route_locust_serves() -> None:
    from locust.env import Environment
    from locust.web import WebUI as LocustWebUI

    app = LocustWebUI(Environment(), "127.0.0.1", 0).app
    served = {rule.rule for rule in app.url_map.iter_rules() if "GET" in (rule.methods or ())
              and "<" not in rule.rule and rule.rule not in ("/login", "/static/")}
    assert served <= set(LOCUST_GET_ROUTES), served - set(LOCUST_GET_ROUTES)


def _all_routes(ui: WebUI) -> dict[str, str]:
    pages = {}
    for route in (*LOCUST_GET_ROUTES, *K3_GET_ROUTES):
        answer = ui.http.get(ui.base + route)
        pages[route] = answer.content.decode("latin-1")
        if route.endswith(".gz") and answer.status_code == 200:
            import gzip

            pages[route] += gzip.decompress(answer.content).decode("utf-8", "replace")
    return pages


@pytest.mark.slow
def test_the_web_ui_runs_no_ones_command_sends_the_key_nowhere_else_and_shows_no_secret(web_ui, tmp_path):
    marker = tmp_path / "proof"
    elsewhere = tmp_path / "elsewhere"
    ui, sim = web_ui("--k3-api-key", KEY, "--k3-header", HEADER)
    assert KEY not in ui.http.get(ui.base + "/").text and "k3_api_key" not in ui.http.get(ui.base + "/").text
    command = f"bash -c 'id > {marker}'"
    attacks = {"k3_server_log_cmd": command, "k3_restart_cmd": command, "k3_out": str(elsewhere),
               "html_file": str(elsewhere / "r.html"), "k3_metrics_url": f"http://127.0.0.1:{_free_port()}/metrics"}
    for name, value in attacks.items():
        answer = ui.http.post(ui.base + "/swarm", data={"user_count": 1, "spawn_rate": 1, "host": sim.base_url,
                                                         name: value}).json()
        assert answer["success"] is False and name in answer["message"] and value not in answer["message"], answer
    other = f"http://127.0.0.1:{_free_port()}"
    answer = ui.http.post(ui.base + "/swarm", data={"user_count": 1, "spawn_rate": 1, "host": other}).json()
    assert answer["success"] is False and "bound" in answer["message"]
    user = ui.http.post(ui.base + "/user", json={"user_class_name": "AgentUser", "host": other})
    assert user.status_code == 403
    assert ui.state()["run_id"] is None  # nothing started
    ui.swarm(1, sim.base_url)  # the same origin: a run starts
    ui.wait_for(lambda s: (s.get("signals") or {}).get("attempts", 0) >= 2, 60, "two attempts")
    ui.http.post(ui.base + "/stop")
    ui.wait_for(lambda s: s.get("verdict") is not None, 120, "the verdict")
    pages = _all_routes(ui)
    assert not _leaks(pages)
    assert not marker.exists() and not elsewhere.exists()
    run_files = {str(p): "".join(lines(p, errors="replace")) for p in ui.out.rglob("*") if p.is_file()}
    assert run_files and not _leaks(run_files)
    assert exposed(ui.out) == []  # every file 0600, every folder 0700 (k3load.private_files)
    log = (tmp_path / "locust.log").read_text()
    assert log.count("k3load: web UI: refused") == len(attacks) + 2 and not _leaks({"log": log})


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
