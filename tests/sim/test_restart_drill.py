"""The restart drill on the sim: --k3-restart-cmd really stops the running sim (its pidfile) and starts
one on the same port; the restart stage then holds the load of the stage before it. Recovered means
ready again, a good answer, and that load within the limits; a server that comes back broken fails."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3load.analysis.pillars.headroom.restart_audit import drill_reason, restart_drill
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.run.rundata import RunData
from k3load.evidence import lines, records_file
from k3load.loadgen.observe import Restarter
from k3load.loadgen.restart_drill import RestartDrill
from k3load.rundir import JsonlLog
from k3load.sim.process import SimProcess
from k3load.workload.plan import Stage
from tests.sim.test_verdicts import accept_with_restart

STAGES = [{"name": "load", "kind": "load", "duration_s": 3, "users": 4, "mix": {"agent": 3, "shared_prefix": 1}},
          # its own users and mix are not what the drill holds: the stage before's are
          {"name": "restart", "kind": "restart", "duration_s": 4, "users": 1, "mix": {"cold": 1}}]


def _drill(start_sim: Callable[..., SimProcess], tmp_path: Path, *faults: str) -> tuple[dict, Path]:
    verdict, _, out = accept_with_restart(start_sim, tmp_path, [], STAGES, faults)
    return verdict, out


def _events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_restart_drill_restarts_the_server_and_holds_the_load_before_it(start_sim, tmp_path):
    verdict, out = _drill(start_sim, tmp_path)
    resources = verdict["pillars"]["resources"]
    drill = resources["numbers"]["restart_drill"]
    assert drill["status"] == "pass" and drill["recovered"] is True, drill
    assert drill["down_seen"] is True and drill["up_before"] is True and 0 < drill["down_after_s"] < 5, drill
    assert 0 < drill["time_to_ready_s"] < 20, drill
    assert drill["time_to_ready_s"] < drill["time_to_first_good_answer_s"] < drill["time_to_ready_s"] + 5, drill
    assert drill["held_from"] == "load" and drill["users"] == 4 and drill["mix"] == {"agent": 3, "shared_prefix": 1}
    assert drill["held_attempts"] > 10 and drill["held_error_rate"] == 0, drill
    # the planned down is no crash: the crash path's restart never ran, the pillar passes
    assert resources["numbers"]["crashes"] == [] and resources["status"] == "pass", resources["reasons"]
    assert any(r.startswith("restart drill: recovered") for r in resources["reasons"])
    events = _events(out)
    names = [e["event"] for e in events]
    assert "restart_command" not in names and names.count("restart_drill_start") == 1
    assert names.index("restart_drill_start") < names.index("restart_drill_down") < names.index("restart_drill_ready")
    start = next(e for e in events if e["event"] == "stage_start" and e["stage"] == "restart")
    assert start["users"] == 4 and start["mix"] == {"agent": 3, "shared_prefix": 1}  # the load before it
    ready = next(e for e in events if e["event"] == "restart_drill_ready")
    records = [json.loads(x) for x in lines(records_file(out))]
    held = [r for r in records if r["stage"] == "restart"]
    assert held and all(r["send_ts"] >= ready["ts"] for r in held)  # no load while the server was away
    drains = {r["stage"]: r["status"] for r in resources["numbers"]["drain"]}
    assert drains == {"load": "drained", "restart": "drained"}, drains
    assert "## Restart drill" in (out / "report.md").read_text()
    assert (out / "restart-drill.log").exists()


@pytest.mark.slow
def test_restart_into_a_broken_server_is_not_recovered(start_sim, tmp_path):
    verdict, _ = _drill(start_sim, tmp_path, "--http-error-rate", "1", "--http-error-status", "503")
    resources = verdict["pillars"]["resources"]
    drill = resources["numbers"]["restart_drill"]
    assert drill["status"] == "fail" and drill["recovered"] is False, drill
    assert drill["time_to_ready_s"] is not None  # it answered /health and /v1/models: ready, yet broken
    assert drill["time_to_first_good_answer_s"] is None and drill["held_attempts"] > 0, drill
    assert resources["status"] == "fail"
    assert any(r.startswith("restart drill (server layer): not recovered") for r in resources["reasons"])
    assert verdict["verdict"] == "limited"  # a broken restart is the server's, not a shortage of GPUs


# -- the drill's own logic, no server: a probe says up or down ---------------------------------------------
def _session(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(run_dir=tmp_path, events=JsonlLog(tmp_path / "events.jsonl"))


def test_a_server_that_never_comes_back_fails_the_drill_within_its_bound(tmp_path):
    answers = iter([True])  # up before the command, then never again
    session = _session(tmp_path)
    drill = RestartDrill(session.events, session.run_dir, None, "true", 0.6, probe=lambda: next(answers, False),
                         poll_s=0.05)
    stage = Stage("restart", "restart", 0, 5, 1, 1.0, {"cold": 1})
    assert drill.due(stage) and drill.run(stage, None) is False and not drill.due(stage)
    assert 0.6 <= drill.paused_s < 2 and not drill.active
    names = [e["event"] for e in _events(tmp_path)]
    assert names == ["restart_drill_start", "restart_drill_down", "restart_drill_failed"]
    failed = _events(tmp_path)[-1]
    assert "did not answer /health and /v1/models again within 0.6 s" in failed["why"]
    data = RunData(path=tmp_path, events=_events(tmp_path))
    judged = restart_drill(data, [StageRow.of(kind="restart", stage="restart")])
    assert judged["status"] == "fail" and judged["recovered"] is False and judged["time_to_ready_s"] is None
    assert judged["why"].startswith("not recovered: the server did not answer")


def test_a_command_that_does_not_restart_the_server_fails_the_drill(tmp_path):
    session = _session(tmp_path)
    drill = RestartDrill(session.events, session.run_dir, None, "exit 3", 5, probe=lambda: True, poll_s=0.05)
    assert drill.run(Stage("restart", "restart", 0, 5, 1, 1.0, {"cold": 1}), None) is False
    failed = _events(tmp_path)[-1]
    assert failed["event"] == "restart_drill_failed" and failed["command_rc"] == 3
    assert "never went down" in failed["why"]


def test_without_a_restart_command_the_drill_is_not_run_never_passed(tmp_path):
    data = RunData(path=tmp_path, events=[{"ts": 1.0, "event": "stage_start", "stage": "restart"}])
    judged = restart_drill(data, [StageRow.of(kind="restart", stage="restart")])
    assert judged["status"] == "not_run" and "no --k3-restart-cmd" in judged["why"]
    assert drill_reason(judged).startswith("restart drill: not run")


def test_the_crash_path_stays_out_while_the_drill_runs_and_the_drill_after_a_crash_restart(tmp_path):
    session = _session(tmp_path)
    session.restart_drill = SimpleNamespace(active=True)
    restarter = Restarter(session.events, session.run_dir, "true", 3, drilling=lambda: session.restart_drill.active)
    restarter({"event": "server_down"})  # the drill's own down: no crash restart
    assert restarter.started == 0
    session.restart_drill.active = False
    restarter({"event": "server_down"})  # a real crash later in the run: the crash path restarts
    assert restarter.started == 1
    drill = RestartDrill(session.events, session.run_dir, None, "true", 5, probe=lambda: True,
                         crash_restarts=lambda: restarter.started)
    assert not drill.due(Stage("restart", "restart", 0, 5, 1, 1.0, {"cold": 1}))  # already restarted after a crash
    skipped = [e for e in _events(tmp_path) if e["event"] == "restart_drill_skipped"]
    assert len(skipped) == 1 and skipped[0]["crash_restarts"] == 1
    judged = restart_drill(RunData(path=tmp_path, events=_events(tmp_path)), [])
    assert judged["status"] == "not_run" and "already restarted after a crash" in judged["why"]
