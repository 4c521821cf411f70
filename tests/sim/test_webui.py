"""The web UI's k3load parts over HTTP (the browser test is test_webui_browser.py): one run per test
started from the UI, judged at its stop while the UI keeps answering, `GET /k3load/state`, the tab's
rows, manual stages `manual-N`, and the pure parts (manual plan, live counts, tab rows)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3load.evidence import RECORDS, records_file
from k3load.loadgen.manual import LiveCounts, ManualStages
from k3load.loadgen.webui import tab_rows
from k3load.records import read_records
from k3load.workload.plan import parse_plan
from tests.sim.locust_runs import _free_port, _processes, _served
from tests.webui_fixtures import STATE_KEYS, web_ui_fixture  # noqa: F401  (the web_ui fixture)


def test_each_test_from_the_ui_is_its_own_run_judged_at_its_stop(web_ui):
    ui, sim = web_ui("--k3-manual")
    idle = ui.state()
    assert set(idle) >= STATE_KEYS and idle["run_id"] is None and idle["verdict"] is None
    ui.swarm(2, sim.base_url)
    first = ui.wait_for(lambda s: (s["signals"].get("attempts") or 0) >= 3 and s["signals"].get("kv_usage")
                        is not None, 30, "attempts and a KV reading")
    assert first["stage"]["name"] == "manual-1" and first["stage"]["users"] == 2
    assert first["stage"]["left_s"] is None
    ui.swarm(4, sim.base_url)  # a change of the user count while running: a new stage
    ui.wait_for(lambda s: s["stage"]["name"] == "manual-2" and (s["signals"].get("users") or 0) == 4, 20,
                "stage manual-2 at 4 users")
    ui.wait_for(lambda s: s["pillars"] is not None, 20, "provisional pillars")
    time.sleep(1.5)  # a few attempts in manual-2
    started = time.monotonic()
    assert ui.http.post(ui.base + "/stop").json()["success"]
    judged = ui.wait_for(lambda s: s["verdict"] is not None, 60, "the verdict")
    assert time.monotonic() - started < 60
    assert ui.http.get(ui.base + "/stats/requests").status_code == 200  # the UI answers after judging
    verdict = judged["verdict"]
    assert verdict["verdict"] in ("go", "limited", "scale_up", "rebuild") and verdict["because"]
    report = ui.http.get(ui.base + verdict["links"]["report.html"])
    assert report.status_code == 200 and "<html" in report.text.lower()
    run_dir = Path(first["run_dir"])
    records = ui.http.get(ui.base + verdict["links"][RECORDS])  # the file as it is on disk, not unpacked
    assert records.status_code == 200 and "content-encoding" not in records.headers, records.headers
    assert records.headers["content-type"] == "application/gzip"
    assert records.content == (run_dir / RECORDS).read_bytes()
    stages = {a.stage for a in read_records(records_file(run_dir))}
    assert {"manual-1", "manual-2"} <= stages, stages
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    assert [s["name"] for s in plan["stages"]] == ["manual-1", "manual-2"]
    assert [s["users"] for s in plan["stages"]] == [2, 4]
    ramp = json.loads((run_dir / "verdict.json").read_text())
    assert ramp["verdict"] == verdict["verdict"]

    ui.swarm(1, sim.base_url)  # a second test: a new run, the first one set aside and kept whole
    second = ui.wait_for(lambda s: s["run_id"] not in (None, first["run_id"]) and s["stage"] is not None, 30,
                         "a new run")
    assert second["verdict"] is None and second["stage"]["name"] == "manual-1"
    ui.wait_for(lambda s: s["signals"].get("kv_usage") is not None and len(s["history"]) >= 2
                and s["history"][0]["ts"] >= json.loads((run_dir / "run.json").read_text())["started_ts"], 20,
                "the second run's own scrapes")
    assert second["run_dir"] == first["run_dir"]
    moved = [p for p in run_dir.parent.iterdir() if p.name.startswith("run.previous-")]
    assert len(moved) == 1 and (moved[0] / "verdict.json").exists()
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == second["run_id"]
    ui.http.post(ui.base + "/stop")
    ui.wait_for(lambda s: s["verdict"] is not None, 60, "the second verdict")


SHORT_PLAN = [{"name": "load", "kind": "load", "duration_s": 8, "users": 2, "mix": {"agent": 1}},
              {"name": "soak", "kind": "soak", "duration_s": 3, "users": 1, "mix": {"agent": 1}}]


def test_the_tab_is_declared_and_its_rows_come_with_the_stats(web_ui):
    """With a plan shape: the tab's rows come with the stats; the shape's end stops the test and judges it;
    a second test from the UI runs the plan again from its first stage, as a new run."""
    ui, sim = web_ui(plan_stages=SHORT_PLAN)
    page = ui.http.get(ui.base + "/").text
    assert '"extended_tabs": [{"key": "k3load", "title": "k3load"}]' in page or "extended_tabs" in page
    ui.swarm(1, sim.base_url)  # the plan shape drives this one
    state = ui.wait_for(lambda s: s["stage"] is not None and (s["signals"].get("attempts") or 0) >= 1, 30,
                        "the plan's stage")
    assert state["stage"]["name"] == "load" and state["stage"]["left_s"] is not None
    stats = ui.http.get(ui.base + "/stats/requests").json()
    rows = {r["signal"]: r["value"] for r in stats["extended_stats"][0]["data"]}
    assert stats["extended_stats"][0]["key"] == "k3load"
    assert rows["stage"].startswith("load (load, 2 users)") and "KV cache usage" in rows
    live = ui.http.get(ui.base + "/k3load/")
    assert live.status_code == 200 and "/k3load/state" not in live.text and "fetch('state'" in live.text
    first = ui.wait_for(lambda s: s["verdict"] is not None, 60, "the verdict at the plan's end (no /stop)")
    ran = {a.stage for a in read_records(records_file(Path(first["run_dir"])))}
    assert ran == {"load", "soak"}, ran
    ui.swarm(1, sim.base_url)  # the same plan again: a new run from its first stage
    second = ui.wait_for(lambda s: s["run_id"] not in (None, first["run_id"]) and s["stage"] is not None, 30,
                         "a new run of the plan")
    assert second["stage"]["name"] == "load" and second["verdict"] is None
    ui.http.post(ui.base + "/stop")
    ui.wait_for(lambda s: s["verdict"] is not None, 60, "the second verdict")


def _plan_of(text: str):
    return parse_plan(yaml.safe_load(text), "test", text)


def test_manual_stages_make_a_valid_plan_as_they_ran():
    clock = iter([100.0, 110.0, 130.0, 140.0]).__next__
    base = _plan_of(yaml.safe_dump({"name": "x", "stages": [{"name": "a", "kind": "load", "duration_s": 5,
                                                             "users": 1, "mix": {"agent": 1}}],
                                    "thresholds": {"agent_api": {"min_attempts": 3}}}))
    manual = ManualStages(active=True)
    assert [s["name"] for s in yaml.safe_load(manual.plan_source(base))["stages"]] == ["manual-1"]  # placeholder
    assert manual.next(2, 1.0, {"agent": 1, "cold": 0}, clock=clock).name == "manual-1"
    assert manual.next(0, 1.0, {"agent": 1}, clock=clock).name == "manual-2"
    third = manual.next(6, 2.0, {"agent": 2}, clock=clock)
    assert (third.name, third.kind, third.start_s) == ("manual-3", "concurrency", 30.0)
    manual.stop(clock=clock)
    plan = _plan_of(manual.plan_source(base))
    assert plan.name == "manual" and plan.thresholds == {"agent_api": {"min_attempts": 3}}
    assert [(s.name, s.users, s.duration_s, s.mix) for s in plan.stages] == [
        ("manual-1", 2, 10.0, {"agent": 1}), ("manual-3", 6, 10.0, {"agent": 2})]  # 0 users: no plan stage


def test_live_counts_and_tab_rows():
    counts = LiveCounts()
    for line in ('{"valid": true}', '{"valid": false, "primary_layer": "parser"}', '{"valid": false}',
                 '{"valid": false, "drill": true}', "torn"):
        counts.add(line)
    assert (counts.attempts, counts.valid, dict(counts.failed_by_layer)) == (3, 1, {"parser": 1, "unknown": 1})
    rows = {r["signal"]: r["value"] for r in tab_rows({
        "run_id": "r1", "run_dir": "/x", "stage": {"name": "manual-2", "kind": "concurrency", "users": 4,
                                                   "left_s": None},
        "signals": {"users": 4, "kv_usage": 0.5, "gpus": [{"node": "n1", "gpu": 0, "memory_used_mib": 10.0,
                                                            "memory_total_mib": 20.0, "simulated": True}],
                    "failed_by_layer": {"parser": 2}, "load_generator_cpu_pct": {"local": 12.0}},
        "pillars": {"agent_api": {"status": "inconclusive", "reason": "too few attempts"}},
        "verdict": {"verdict": "limited", "because": ["x"]}})}
    assert rows["stage"] == "manual-2 (concurrency, 4 users), set by hand" and rows["KV cache usage"] == "50.0%"
    assert rows["GPU memory n1 #0 (simulated)"] == "10 / 20 MiB" and rows["failures by layer"] == "parser 2"
    assert rows["agent_api so far"] == "inconclusive: too few attempts" and rows["verdict"] == "limited: x"


def test_the_class_pickers_default_shape_is_a_manual_ramp_of_the_chosen_classes(web_ui):
    ui, sim = web_ui("--class-picker")
    answer = ui.http.post(ui.base + "/swarm", data={"user_count": 2, "spawn_rate": 10, "host": sim.base_url,
                                                    "shape_class": "Default", "user_classes": "AgentUser"})
    assert answer.json()["success"], answer.text
    state = ui.wait_for(lambda s: s["stage"] is not None and (s["signals"].get("attempts") or 0) >= 2, 30,
                        "stage manual-1")
    assert state["stage"]["name"] == "manual-1" and state["stage"]["left_s"] is None
    ui.http.post(ui.base + "/stop")
    ui.wait_for(lambda s: s["verdict"] is not None, 60, "the verdict")
    run_dir = Path(state["run_dir"])
    assert {(a.family, a.stage) for a in read_records(records_file(run_dir))} == {("agent", "manual-1")}
    assert yaml.safe_load((run_dir / "plan.yaml").read_text())["stages"][0]["mix"] == {"agent": 1}


def _fake_session(run_dir: Path) -> Any:
    from types import SimpleNamespace

    runner = SimpleNamespace(state="running", user_count=3, stats=None, current_cpu_usage=12.5)
    from k3load.analysis.pillars.headroom.goodput import Slo
    from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
    from k3load.loadgen.search_live import LiveGoodput

    return SimpleNamespace(env=SimpleNamespace(runner=runner), run_id="r1", run_dir=run_dir, stage=None,
                           stage_started=0.0, stage_name="manual-1", finished=False, judgment=None,
                           live=LiveCounts(), fatal="", goodput=LiveGoodput(Slo.from_limits(DEFAULT_THRESHOLDS)),
                           search=None)


def _scrape(ts: float, kv: float, waiting: float, hits: float, queries: float) -> str:
    return json.dumps({"ts": ts, "source": "http://s/metrics", "ok": True, "samples": {
        'vllm:kv_cache_usage_perc{engine="0"}': kv, 'vllm:num_requests_waiting{engine="0"}': waiting,
        'vllm:num_requests_running{engine="0"}': 2.0, 'vllm:prefix_cache_hits_total{engine="0"}': hits,
        'vllm:prefix_cache_queries_total{engine="0"}': queries, 'vllm:num_preemptions_total{engine="0"}': 5.0}})


def test_live_state_reads_the_run_incrementally_and_judges_it_provisionally(tmp_path):
    import gevent

    from k3load.analysis.pillars.pillar import PillarResult
    from k3load.loadgen.live import LiveState

    (tmp_path / "metrics.jsonl").write_text(_scrape(1.0, 0.25, 0.0, 100, 1000) + "\n" + _scrape(2.0, 0.5, 3, 400, 2000)
                                            + "\n" + '{"ts": 3.0, "torn')
    (tmp_path / "gpu.jsonl").write_text(json.dumps({"ts": 2.0, "node": "n1", "gpu": 0, "memory_used_mib": 70.0,
                                                    "memory_total_mib": 80.0, "simulated": True}) + "\n")
    judged = []

    def judge(run_dir: Path) -> Any:
        from types import SimpleNamespace

        from k3load.analysis.pillars.headroom.stage_row import StageRow

        judged.append(run_dir)
        return SimpleNamespace(pillars={"agent_api": PillarResult("pass", ["agent so far 97.1% valid"])},
                               stage_table=[StageRow.of(stage="manual-1", ttft_p95_ms=42.0)])

    live = LiveState(_fake_session(tmp_path), judge=judge)
    state = live.state()
    sig = state["signals"]
    assert (sig["kv_usage"], sig["waiting"], sig["running"], sig["preemptions"]) == (0.5, 3.0, 2.0, 0.0)
    assert sig["prefix_cache_hit_ratio"] == 0.3  # (400 - 100) / (2000 - 1000): over this run only
    assert sig["gpus"] == [{"node": "n1", "gpu": 0, "memory_used_mib": 70.0, "memory_total_mib": 80.0,
                            "simulated": True}]
    assert [p["kv_usage"] for p in state["history"]] == [0.25, 0.5]  # the torn line waits for its end
    gevent.sleep(0.5)
    state = live.state()
    assert state["pillars"] == {"agent_api": {"status": "pass", "reason": "agent so far 97.1% valid"}}
    assert state["signals"]["ttft_p95_ms"] == 42.0 and len(judged) == 1  # cached: not judged again so soon
    (tmp_path / "records.jsonl").write_text("x" * 10)
    paused = LiveState(_fake_session(tmp_path), judge=judge, max_records_bytes=5).state()
    assert paused["pillars"]["all"]["status"] == "paused" and len(judged) == 1


def _wait_for_workers_ready(ui: Any, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = ui.http.get(ui.base + "/stats/requests").json().get("workers") or []
        if len(workers) == count and all(w["state"] == "ready" for w in workers):
            return
        time.sleep(0.3)
    raise AssertionError(f"{count} workers never ready again")


@pytest.mark.slow
def test_under_a_master_each_ui_test_is_its_own_run_with_every_workers_records(web_ui):
    ui, sim = web_ui("--k3-manual", *_processes(2))
    # the workers import the locustfile after the master's UI is up (seconds on a busy machine): a start before
    # they join is refused (test_a_start_before_any_worker_joined_is_refused_with_the_reason)
    _wait_for_workers_ready(ui, 2, 90)
    ui.swarm(2, sim.base_url)
    first = ui.wait_for(lambda s: (s["signals"].get("attempts") or 0) >= 3, 40, "workers' attempts")
    ui.swarm(4, sim.base_url)
    ui.wait_for(lambda s: s["stage"]["name"] == "manual-2" and (s["signals"].get("users") or 0) == 4, 20,
                "manual-2 on the workers")
    time.sleep(1.5)
    ui.http.post(ui.base + "/stop")
    ui.wait_for(lambda s: s["verdict"] is not None, 60, "the verdict")
    _wait_for_workers_ready(ui, 2)  # Locust's workers leave and join again after a stop (a few seconds)
    ui.swarm(2, sim.base_url)
    second = ui.wait_for(lambda s: s["run_id"] not in (None, first["run_id"])
                         and (s["signals"].get("attempts") or 0) >= 2, 40, "a new run with attempts")
    ui.http.post(ui.base + "/stop")
    ui.wait_for(lambda s: s["verdict"] is not None, 60, "the second verdict")
    run_dir = Path(second["run_dir"])
    previous = next(p for p in run_dir.parent.iterdir() if p.name.startswith("run.previous-"))
    for directory, stages in ((previous, {"manual-1", "manual-2"}), (run_dir, {"manual-1"})):
        attempts = read_records(records_file(directory))
        ids = [a.attempt_id for a in attempts]
        assert len(ids) == len(set(ids)) and {a.stage for a in attempts} == stages, directory
        assert {a.run_id for a in attempts} == {json.loads((directory / "run.json").read_text())["run_id"]}


def test_a_start_before_any_worker_joined_is_refused_with_the_reason(web_ui):
    """A master no worker has joined: Locust's own /swarm answers success and starts nothing (its console says
    why); k3load refuses the start with the reason, in the answer the page shows."""
    port = str(_free_port())
    ui, sim = web_ui("--k3-manual", "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", port)
    answer = ui.http.post(ui.base + "/swarm", data={"user_count": 2, "spawn_rate": 10, "host": sim.base_url}).json()
    assert not answer["success"] and answer["message"].startswith("k3load refused: no worker has connected"), answer
    time.sleep(1)
    assert ui.state()["run_id"] is None and _served(sim) == 0


def test_a_dead_server_is_said_in_the_state_and_the_tab(web_ui):
    dead = f"http://127.0.0.1:{_free_port()}"  # nobody listens there
    ui, _sim = web_ui("--host", dead)  # given at start: the web UI refuses to change the target (ui_guard)
    ui.swarm(1, dead)
    state = ui.wait_for(lambda s: s["error"] is not None, 30, "the harness error")
    assert "does not answer /v1/models" in state["error"] and state["verdict"] is None
    rows = {r["signal"]: r["value"] for r in ui.http.get(ui.base + "/stats/requests").json()["extended_stats"][0]
            ["data"]}
    assert rows["harness error"].startswith(state["error"][:40])


def test_the_pages_scripts_parse(tmp_path):
    """A syntax error in the live page's script leaves the tab without charts or verdict: caught here in a
    second where node is installed (the browser test catches it everywhere)."""
    import shutil
    import subprocess

    from k3load.loadgen.webui_page import PAGE, TAB_JS

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (the browser test still runs the scripts)")
    page_js = PAGE.split("<script>", 1)[1].split("</script>", 1)[0]
    for name, source in (("page.js", page_js), ("tab.js", TAB_JS)):
        (tmp_path / name).write_text(source)
        checked = subprocess.run([node, "--check", str(tmp_path / name)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{name}: {checked.stderr}"
