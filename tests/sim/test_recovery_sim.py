"""The restart check under the same conditions (issue 33): an OOM the restart clears, one that comes back, and an
engine that died behind a live API server (restarted by the operator's command).

The sim dies the way vLLM does on a CUDA OOM (a `torch.OutOfMemoryError` line, the process gone) once its KV
demand passes `--oom-kv-demand-tokens`: 8 users of the agent family pass it, 2 do not. The operator's restart
command brings a sim back on the same port, with the fault (the OOM comes back under the same load) or without
it (the restart cleared it). Both runs go side by side; each asserts on the run's own events and verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from k3load.sim.process import SimProcess
from tests.conftest import FAST_SIM
from tests.sim.test_verdicts import ROOT, SIM, _free_port, restart_command

pytestmark = pytest.mark.slow

OOM = ["--oom-kv-demand-tokens", "6000"]
# The restart takes 3 s: the 2 s soak is over when the server is back, so no request of soak's own meets the
# restarted server (its 8 users would crash it again as soak, before the hold); the hold interrupts `after`.
STAGES = [{"name": "load", "kind": "load", "duration_s": 3, "users": 2, "mix": {"agent": 1}},
          {"name": "soak", "kind": "soak", "duration_s": 2, "users": 8, "mix": {"agent": 1}},
          {"name": "after", "kind": "load", "duration_s": 10, "users": 2, "mix": {"agent": 1}}]


# vLLM 0.32's engine death with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1: /health 503 and the log's EngineDeadError line,
# the port open; the restart command must stop the live API server before starting the next
ENGINE_DEATH = ["--engine-death-after-requests", "40", "--engine-death-exit-s", "0"]


def _run(tmp_path: Path, faults: list[str], restart_faults: list[str]) -> tuple[dict, list[dict], int]:
    port, pidfile, log = _free_port(), tmp_path / "sim.pid", tmp_path / "sim.log"
    sim = SimProcess([*FAST_SIM, *SIM, *faults, "--port", str(port)], log).start()
    pidfile.write_text(str(sim.proc.pid))
    restart = restart_command(pidfile, port, log, *restart_faults, delay_s=3)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "recovery", "stages": STAGES,
                                    "thresholds": {"resources": {"recovery_hold_s": 4}}}))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
           "--host", sim.base_url, "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe",
           "recipes/local-dev.yaml", "--k3-server-log", str(log), "--k3-restart-cmd", restart, "--only-summary"]
    try:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    finally:
        sim.stop()
        # every restart command's own session: one still sleeping when the run ended would start a sim after it
        started = [json.loads(line).get("pid") for line in _lines(out / "events.jsonl")
                   if '"restart_command"' in line]
        for pid in started:
            with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                os.killpg(pid, signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int(pidfile.read_text()), signal.SIGTERM)  # the restarted sim
    assert (out / "verdict.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return json.loads((out / "verdict.json").read_text()), events, run.returncode


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, list[dict], int]]:
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_run, tmp_path_factory.mktemp(name), faults, restart_faults)
                   for name, faults, restart_faults in (("clears", OOM, []), ("recurs", OOM, OOM),
                                                        ("engine-death", ENGINE_DEATH, []))}
        return {name: future.result() for name, future in futures.items()}


def test_an_oom_the_restart_clears_holds_the_same_load_and_is_a_one_off(runs):
    verdict, events, code = runs["clears"]
    crashes = verdict["pillars"]["resources"]["numbers"]["crashes"]
    assert len(crashes) == 1 and crashes[0]["oom"] and crashes[0]["stage"] == "soak", crashes
    same = crashes[0]["restart"]["same_conditions"]
    assert set(same) == {"users", "mix", "held_s", "recurred", "status", "why"}
    assert same["status"] == "held" and same["recurred"] is False and same["users"] == 8, same
    assert same["mix"] == {"agent": 1} and same["held_s"] >= 3.6, same
    assert crashes[0]["ended"]["port_closed"] is True, crashes[0]["ended"]
    holds = [e for e in events if e["event"] == "recovery_hold"]
    assert [(h["crash_stage"], h["ended"], h["users"]) for h in holds] == [("soak", "held", 8)], holds
    # the hold interrupted the stage running when the server was back; the plan ended with it (nothing followed)
    started = [e["stage"] for e in events if e["event"] == "stage_start"]
    assert started == ["load", "soak", "after", "soak-recovery-1"], started
    assert verdict["verdict"] == "limited" and code == 3, verdict["next_action"]
    assert any("OOM crash in stage soak" in r and "a one-off" in r
               for r in verdict["pillars"]["resources"]["reasons"]), verdict["pillars"]["resources"]["reasons"]
    restart = next(i for i in verdict["checklist"] if i["item"].startswith("Restart check"))
    assert restart["status"] == "ok" and "held the crash stage's load" in restart["detail"], restart


def test_an_oom_that_comes_back_under_the_same_load_is_scale_up(runs):
    verdict, events, code = runs["recurs"]
    crashes = verdict["pillars"]["resources"]["numbers"]["crashes"]
    assert len(crashes) >= 2 and all(c["oom"] for c in crashes[:2]), crashes
    first, second = crashes[0], crashes[1]
    assert first["stage"] == "soak" and first["restart"]["same_conditions"]["status"] == "recurred"
    assert first["restart"]["same_conditions"]["recurred"] is True
    assert second["stage"] == "soak-recovery-1" and second["recurrence_of"] == 0, second
    assert second["restart"]["same_conditions"]["status"] == "not_run"
    holds = [e for e in events if e["event"] == "recovery_hold"]
    assert [h["ended"] for h in holds] == ["crashed_again"], holds
    assert verdict["verdict"] == "scale_up" and code == 5, verdict["next_action"]
    because = " ".join(verdict["next_action"]["because"])
    assert "a continuing OOM" in because and because.count("OOM line in the server log") >= 2, because
    restart = next(i for i in verdict["checklist"] if i["item"].startswith("Restart check"))
    assert restart["status"] == "open" and "the crash recurred under the same load" in restart["detail"], restart


def test_an_engine_dead_behind_a_live_api_server_is_a_crash_restarted_and_held(runs):
    """The port stays open (503), the death is read from the log line that came before the down: a crash, restarted
    by the operator's command, its stage's load held after it; no memory evidence, so never scale_up."""
    verdict, events, code = runs["engine-death"]
    crashes = verdict["pillars"]["resources"]["numbers"]["crashes"]
    assert len(crashes) == 1 and "log_engine_dead" in crashes[0]["events"] and not crashes[0]["oom"], crashes
    crash = crashes[0]
    assert crash["ended"]["port_closed"] is False and "EngineDeadError" in " ".join(crash["ended"]["log_tail"])
    same = crash["restart"]["same_conditions"]
    assert same["status"] == "held" and same["recurred"] is False, same
    holds = [e for e in events if e["event"] == "recovery_hold"]
    assert [(h["crash_stage"], h["ended"]) for h in holds] == [(crash["stage"], "held")], holds
    assert verdict["verdict"] == "limited" and code == 3, verdict["next_action"]
