"""The drain audit on the sim: a healthy server lets go of everything after each stage; a server that
keeps decoding for clients that left (a gateway not passing the disconnect on) is caught, with the
tokens it spent for nobody, as a resources failure of the server layer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from k3load.loadgen.drain import StageDrain, reading_of
from k3load.loadgen.role import ProcessRole
from k3load.loadgen.worker_count import WorkerCount
from k3load.rundir import JsonlLog
from k3load.workload.plan import Stage
from tests.sim.test_verdicts import ROOT, accept

# Two plan stages with different mixes (a drain window after each); the agent family plays the timeout drill.
HEALTHY_STAGES = [
    {"name": "load", "kind": "load", "duration_s": 4, "users": 4, "mix": {"agent": 3, "shared_prefix": 1}},
    {"name": "soak", "kind": "soak", "duration_s": 3, "users": 3, "mix": {"agent": 1, "cold": 1}},
]
# Long answers whose client leaves after 0.4 s; the engine at model speed (time scale 1) decodes each for ~5 s.
LONG_ANSWER = """name: long_answer_left
family: cold
description: A long answer whose client leaves after 0.4 s (the drain audit's departed clients).
system_prompt: |
  You are a patient writer of long answers.
defaults:
  max_tokens: 1500
  timeout_s: 0.4
turns:
  - user: Write a long essay about rivers.
    expect: {kind: answer}
"""


def _events(out: Path, name: str) -> list[dict]:
    return [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines()) if e["event"] == name]


def _drill_as_the_agents(folder: Path) -> str:
    """The scenarios with the timeout-retry drill as the agent family's only one: a stage of a few seconds
    draws its agents' scenarios at random, and on a busy machine (the run beside the main session, stop 48)
    its three agent users drew none of the drill, which this test needs in the load stage."""
    folder.mkdir()
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        if not path.name.startswith("agent_") or path.name == "agent_timeout_retry.yaml":
            (folder / path.name).write_bytes(path.read_bytes())
    return str(folder / "*.yaml")


@pytest.mark.slow
def test_healthy_sim_drains_after_every_stage(start_sim, tmp_path):
    verdict, _, out = accept(start_sim, tmp_path, [], stages=HEALTHY_STAGES,
                             scenarios=_drill_as_the_agents(tmp_path / "scenarios"))
    resources = verdict["pillars"]["resources"]
    rows = {r["stage"]: r for r in resources["numbers"]["drain"]}
    assert set(rows) == {"load", "soak"}
    for row in rows.values():
        assert row["status"] == "drained", row
        assert row["running_after"] == 0 and row["waiting_after"] == 0, row
        assert row["waited_s"] < 1.0 and row["bound_s"] == 10.0, row
        assert row["kv_usage_after"] <= row["kv_usage_baseline"] + 0.02, row
        assert row["tokens_after_clients_left"] is not None and row["tokens_after_clients_left"] < 50, row
        assert row["server_aborts"] is not None, row
    assert rows["load"]["timeout_drills"] > 0  # the agent family's timeout drill ran in the stage
    assert resources["status"] == "pass", resources["reasons"]
    assert not any("drain audit" in r for r in resources["reasons"])
    drains = _events(out, "stage_drain")
    assert [d["stage"] for d in drains] == ["load", "soak"] and all(d["drained"] for d in drains)
    starts = {e["stage"]: e["ts"] for e in _events(out, "stage_start")}
    assert drains[0]["ts"] < starts["soak"]  # the window comes before the next stage starts
    report = (out / "report.md").read_text()
    assert "## Drain audit" in report and "| load | drained |" in report
    assert "Drain audit" in (out / "report.html").read_text()


@pytest.mark.slow
def test_server_decoding_for_departed_clients_does_not_drain(start_sim, tmp_path):
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "long_answer_left.yaml").write_text(LONG_ANSWER)
    sim = ["--ignore-disconnect-rate", "1", "--time-scale", "1", "--answer-tokens-min", "1200",
           "--answer-tokens-max", "1400", "--reasoning-tokens", "0"]
    stages = [{"name": "orphans", "kind": "load", "duration_s": 3, "users": 2, "mix": {"cold": 1}}]
    verdict, code, out = accept(start_sim, tmp_path, sim, scenarios=str(scenarios / "*.yaml"), stages=stages,
                                thresholds={"resources": {"max_drain_s": 1.5}})
    resources = verdict["pillars"]["resources"]
    (row,) = resources["numbers"]["drain"]
    assert row["status"] == "not_drained", row
    assert row["clients_left_early"] > 0 and row["running_when_clients_left"] > 0, row
    assert row["running_after"] > 0 and 1.5 <= row["waited_s"] < 3, row
    assert row["tokens_after_clients_left"] > 100, row  # decoded for nobody while the window was open
    assert row["server_aborts"] == 0, row  # the server never heard that its clients left
    assert resources["status"] == "fail"
    reason = next(r for r in resources["reasons"] if "drain audit" in r)
    assert "(server layer)" in reason and "tokens generated after every client had left" in reason, reason
    assert verdict["verdict"] == "limited" and code == 3  # fix the gateway, not the GPUs
    assert "| orphans | not_drained |" in (out / "report.md").read_text()


# -- the window's own logic, no server: injected readings ------------------------------------------------
def _reading(ts: float, running: float, tokens: float) -> dict:
    return {"ts": ts, "running": running, "waiting": 0.0, "kv_usage": 0.01 * running, "generation_tokens": tokens,
            "aborted": 0.0}


def test_the_window_waits_for_the_server_within_its_bound_and_stops_the_plan_clock(tmp_path):
    events = JsonlLog(tmp_path / "events.jsonl")
    readings = iter([_reading(0, 2, 100), _reading(1, 1, 150), _reading(2, 0, 170)])
    drain = StageDrain(events, 5.0, read=lambda: next(readings), poll_s=0.01)
    load = Stage("load", "load", 0, 5, 4, 4.0, {"agent": 1})
    step2, step8 = (Stage(f"ramp-c{n}", "concurrency", 5, 5, n, 4.0, {"agent": 1}, step_of="ramp") for n in (2, 8))
    assert drain.due(load, step2) and drain.due(load, None) and not drain.due(load, load)
    assert not drain.due(step2, step8) and drain.due(step8, None)  # never between the steps of one ramp
    event = drain.run(load)
    assert event["drained"] is True and event["polls"] == 3 and event["first"]["running"] == 2
    assert event["last"]["generation_tokens"] - event["first"]["generation_tokens"] == 70
    assert not drain.due(load, None) and 0 < drain.paused_s < 1  # once per stage; the clock waited that long
    stuck = StageDrain(events, 0.05, read=lambda: _reading(0, 1, 0), poll_s=0.01).run(load)
    assert stuck["drained"] is False and stuck["waited_s"] >= 0.05
    blind = StageDrain(events, 5.0, read=lambda: None).run(load)  # no /metrics: no wait, nothing judged
    assert blind["drained"] is None and blind["polls"] == 1 and "no reading" in blind["error"]
    assert StageDrain(events, 0.0, read=lambda: None).due(load, None) is False  # max_drain_s 0: no window


def test_a_reading_sums_the_sources_and_takes_the_worst_kv():
    body = ('vllm:num_requests_running{{engine="0"}} {r}\nvllm:num_requests_waiting{{engine="0"}} 0\n'
            'vllm:kv_cache_usage_perc{{engine="0"}} {kv}\n# TYPE vllm:generation_tokens counter\n'
            'vllm:generation_tokens_total{{engine="0"}} {g}\n# TYPE vllm:request_success counter\n'
            'vllm:request_success_total{{engine="0",finished_reason="abort"}} {a}\n'
            'vllm:request_success_total{{engine="0",finished_reason="stop"}} 50\n')
    reading = reading_of([body.format(r=1, kv=0.2, g=10, a=2), body.format(r=2, kv=0.5, g=5, a=1), "not metrics"], 7)
    assert reading == {"ts": 7, "running": 3, "waiting": 0, "kv_usage": 0.5, "generation_tokens": 15, "aborted": 3}
    assert reading_of(["# nothing\n"], 7) is None


def test_the_plan_clock_stands_still_while_users_leave_so_a_short_stage_still_runs(tmp_path, monkeypatch):
    """The previous stage's users take 5 s to finish their turns; a 2 s stage after it must still be
    entered at its start, not skipped because the plan clock ran on while they left."""
    import locust.shape

    from k3load.loadgen import shape as shape_module

    now = [100.0]
    fake_time = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(locust.shape, "time", fake_time)
    monkeypatch.setattr(shape_module, "time", fake_time, raising=False)
    load = Stage("load", "load", 0, 4, 4, 4.0, {"agent": 1})
    short = Stage("long-input", "long_input", 4, 2, 1, 1.0, {"long_input": 1})
    soak = Stage("soak", "soak", 6, 4, 2, 2.0, {"agent": 1})
    entered: list[str] = []
    session = SimpleNamespace(fatal=False, run=SimpleNamespace(run_dir=tmp_path), finished=False,
                              role=ProcessRole.LOCAL, ensure_started=lambda: None,
                              plan=SimpleNamespace(stages=(load, short, soak),
                                                   stage_at=lambda t: next((s for s in (load, short, soak)
                                                                            if t < s.end_s), None)),
                              drain=StageDrain(None, 5.0, read=lambda: _reading(0, 0, 0)),
                              restart_drill=None, stage=None, events=None, load_skipped=False,
                              workers_seen=WorkerCount(), search=None)
    session.enter_stage = lambda stage: (entered.append(stage.name), setattr(session, "stage", stage))
    runner = SimpleNamespace(user_count=0, environment=SimpleNamespace(k3_session=session))
    shape = shape_module.PlanShape()
    shape.runner = runner
    assert shape.tick()[0] == 4 and entered == ["load"]
    runner.user_count, now[0] = 4, now[0] + 4.1  # load's time is up: its users must leave first
    assert shape.tick()[0] == 0 and entered == ["load"]
    for _ in range(5):  # they take 5 s to finish their answers
        now[0] += 1.0
        assert shape.tick()[0] == 0
    runner.user_count = 0
    assert shape.tick()[:2] == (1, 1.0) and entered == ["load", "long-input"]  # entered, not skipped
    assert 4.0 <= shape.get_run_time() - (shape._left_s + session.drain.paused_s) < 4.2  # its 2 s are all ahead
    shape.reset_time()  # a new test in the web UI starts with no departure time carried over
    assert shape._left_s == 0.0 and shape._leaving_since is None


def test_a_stage_the_clock_ran_past_is_still_entered_whole(tmp_path, monkeypatch):
    """Locust's runner blocks the shape while users spawn or finish their turns; a tick 3 s late after a 2 s
    stage's start must enter that stage, whole (a CI run skipped a 5 s ramp step of 4 users this way), and
    the plan after it keeps its length: the last stage too, when the clock ran past the plan's end."""
    load = Stage("load", "load", 0, 4, 4, 4.0, {"agent": 1})
    step1 = Stage("ramp-c1", "concurrency", 4, 2, 1, 1.0, {"agent": 1})
    step4 = Stage("ramp-c4", "concurrency", 6, 2, 4, 4.0, {"agent": 1})
    rig = _rig(tmp_path, monkeypatch, (load, step1, step4))
    shape, session, now, entered = rig.shape, rig.session, rig.now, rig.entered
    assert shape.tick()[0] == 4 and entered == ["load"]
    now[0] += 7.0  # the next tick comes 7 s on: the clock is past ramp-c1 (4-6) and in ramp-c4 (6-8)
    assert shape.tick()[0] == 1 and entered == ["load", "ramp-c1"]  # entered, not skipped
    assert abs(shape._plan_clock(session) - 4.0) < 1e-6  # at its start: its 2 s are all ahead
    now[0] += 1.9
    assert shape.tick()[0] == 1 and entered == ["load", "ramp-c1"]
    now[0] += 10.0  # late again, past the plan's end: the last step still runs, whole
    assert shape.tick()[0] == 4 and entered == ["load", "ramp-c1", "ramp-c4"]
    assert abs(shape._plan_clock(session) - 6.0) < 1e-6
    now[0] += 2.1
    assert shape.tick() is None  # the plan ended after its last stage's 2 s


def test_a_recovery_hold_runs_the_crash_stages_load_then_the_plan_goes_on_past_it(tmp_path, monkeypatch):
    """A crash mid-soak, the server back: the shape plays soak's users and mix as `soak-recovery-1` for the hold,
    the plan's clock standing still, then ends the stage the hold interrupted and enters the next one, whole."""
    soak = Stage("soak", "soak", 0, 10, 6, 6.0, {"agent": 1})
    after = Stage("after", "load", 10, 4, 2, 2.0, {"agent": 1})
    rig = _rig(tmp_path, monkeypatch, (soak, after), hold_s=5.0)
    shape, session, now, entered, written = rig.shape, rig.session, rig.now, rig.entered, rig.written
    assert shape.tick()[0] == 6 and entered == ["soak"]
    now[0] += 3.0
    session.recovery({"event": "server_down", "ts": 3.0, "reason": "connection refused"})
    now[0] += 2.0
    session.recovery({"event": "server_up", "ts": 5.0})
    assert shape.tick()[0] == 6 and entered == ["soak", "soak-recovery-1"]  # soak's users again
    clock = shape._plan_clock(session)
    now[0] += 4.9
    assert shape.tick()[0] == 6 and abs(shape._plan_clock(session) - clock) < 1e-6  # the clock stands still
    now[0] += 0.2
    assert shape.tick()[0] == 2 and entered == ["soak", "soak-recovery-1", "after"]  # soak ended with the hold
    assert abs(shape._plan_clock(session) - 10.0) < 1e-6 and written[-1]["ended"] == "held"


def test_a_hold_that_never_begins_leaves_the_plan_clock_running(tmp_path, monkeypatch):
    """The server back, a hold armed, the stage's users told to leave; the server dies again before they are gone,
    so the hold is disarmed: the stage goes on, and the plan's clock with it (a CI run froze in soak for good)."""
    soak = Stage("soak", "soak", 0, 10, 6, 6.0, {"agent": 1})
    after = Stage("after", "load", 10, 4, 2, 2.0, {"agent": 1})
    rig = _rig(tmp_path, monkeypatch, (soak, after),
               drain=StageDrain(None, 5.0, read=lambda: _reading(0, 0, 0)), hold_s=5.0)
    shape, session, runner, now, entered = rig.shape, rig.session, rig.runner, rig.now, rig.entered
    assert shape.tick()[0] == 6
    runner.user_count = 6
    session.recovery({"event": "server_down", "ts": 1.0, "reason": "connection refused"})
    now[0] += 2.0
    session.recovery({"event": "server_up", "ts": 3.0})
    assert shape.tick()[0] == 0  # soak's users leave for the hold
    now[0] += 1.0
    session.recovery({"event": "server_down", "ts": 4.0, "reason": "connection refused"})  # dead again: disarmed
    assert shape.tick()[0] == 6 and entered == ["soak"]
    now[0] += 8.5
    assert shape.tick()[0] == 0  # the clock ran on: soak's time is up, its users leave for `after`
    runner.user_count = 0
    assert shape.tick()[0] == 2 and entered == ["soak", "after"]


@dataclass
class ShapeRig:
    """A PlanShape driven by hand: a fake clock (`now`), the session it reads, the stages it entered, its runner."""

    shape: Any
    session: Any
    runner: Any
    now: list[float]
    entered: list[str]
    written: list[dict]


def _rig(tmp_path, monkeypatch, stages: tuple[Stage, ...], drain: Any = None, hold_s: float | None = None
         ) -> ShapeRig:
    """A shape over `stages` on a fake clock; with `hold_s`, a RecoveryHold on the same clock."""
    import locust.shape

    from k3load.loadgen import shape as shape_module
    from k3load.loadgen.recovery import RecoveryHold

    now = [100.0]
    fake_time = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(locust.shape, "time", fake_time)
    monkeypatch.setattr(shape_module, "time", fake_time, raising=False)
    entered: list[str] = []
    written: list[dict] = []
    session = SimpleNamespace(fatal=False, run=SimpleNamespace(run_dir=tmp_path), finished=False,
                              role=ProcessRole.LOCAL, ensure_started=lambda: None,
                              plan=SimpleNamespace(stages=stages, stage_at=lambda t: next((s for s in stages
                                                                                          if t < s.end_s), None)),
                              drain=drain, restart_drill=None, stage=None, events=None, load_skipped=False,
                              workers_seen=WorkerCount(), search=None)
    if hold_s is not None:
        session.recovery = RecoveryHold(SimpleNamespace(event=lambda e, **f: written.append(f)), lambda: session.stage,
                                        lambda: 0, lambda: False, hold_s=hold_s, cap_s=120.0, clock=lambda: now[0])
    session.enter_stage = lambda stage: (entered.append(stage.name), setattr(session, "stage", stage))
    runner = SimpleNamespace(user_count=0, environment=SimpleNamespace(k3_session=session))
    shape = shape_module.PlanShape()
    shape.runner = runner
    return ShapeRig(shape, session, runner, now, entered, written)
