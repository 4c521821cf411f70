"""The recovery hold's decisions (k3load.loadgen.recovery) and their judgment (analysis/pillars/headroom/recovery.py),
on events
written by hand: which down spells arm a hold, how one ends, and what each crash's same_conditions says."""

from __future__ import annotations

from typing import Any

import pandas as pd

from k3load.analysis.pillars.headroom.recovery import Hold, _released, hold_at, same_conditions
from k3load.events import Event
from k3load.loadgen.recovery import RECOVERY, RecoveryHold
from k3load.workload.plan import Stage

SOAK = Stage("soak", "soak", 10.0, 40.0, 8, 8.0, {"agent": 2, "cold": 1})


class Log:
    def __init__(self) -> None:
        self.written: list[dict[str, Any]] = []

    def event(self, event: Event, **fields: Any) -> None:
        self.written.append({"event": Event(event).value, **fields})


def _hold(restarts: list[int] | None = None, hold_s: float | None = None) -> tuple[RecoveryHold, Log, list[float]]:
    log, now, started = Log(), [0.0], restarts if restarts is not None else [0]
    hold = RecoveryHold(log, stage=lambda: SOAK, restarts=lambda: started[0], drilling=lambda: False,
                        hold_s=hold_s, cap_s=120.0, clock=lambda: now[0])
    return hold, log, now


def _running_hold(reason: str) -> tuple[RecoveryHold, Log, list[float]]:
    """A hold begun: soak's server went down (`reason`) at 100, was back at 110, the hold entered."""
    hold, log, now = _hold()
    hold({"event": "server_down", "ts": 100.0, "reason": reason})
    hold({"event": "server_up", "ts": 110.0})
    hold.begin(SOAK)
    return hold, log, now


def test_a_crash_the_server_comes_back_from_arms_the_crash_stages_load():
    hold, log, now = _hold()
    hold({"event": "server_down", "ts": 100.0, "reason": "connection refused"})
    assert hold.hold_now() is None  # not back yet
    hold({"event": "server_up", "ts": 120.0})
    stage = hold.hold_now()
    assert stage is not None and stage.name == "soak-recovery-1" and stage.kind == RECOVERY
    assert (stage.users, stage.mix, stage.duration_s) == (8, {"agent": 2, "cold": 1}, 40.0)  # the stage's length
    hold.begin(SOAK)
    now[0] += 39.0
    assert hold.hold_now() is stage and hold.paused_s == 39.0  # the plan's clock stands still during it
    now[0] += 1.5
    assert hold.hold_now() is None and hold.take_interrupted() is SOAK and hold.take_interrupted() is None
    assert [(e["ended"], e["crash_stage"], e["down_reason"]) for e in log.written] == [("held", "soak",
                                                                                        "connection refused")]


def test_a_health_flap_arms_nothing_but_a_restart_or_an_oom_line_does():
    hold, _, _ = _hold()
    hold({"event": "server_down", "ts": 1.0, "reason": "http 503"})
    hold({"event": "server_up", "ts": 2.0})
    assert hold.hold_now() is None  # /health flapped: no evidence of a crash
    hold({"event": "log_engine_dead", "ts": 2.9, "line": "EngineDeadError"})  # the log is read before /health
    hold({"event": "server_down", "ts": 3.0, "reason": "http 503"})
    hold({"event": "server_up", "ts": 9.0})
    assert hold.hold_now() is not None  # an engine dead behind a live API server: a crash
    hold, _, _ = _hold()
    hold({"event": "server_down", "ts": 1.0, "reason": "HTTP 502", "http_status": 502})  # nginx: upstream refused
    hold({"event": "server_up", "ts": 9.0})
    assert hold.hold_now() is not None  # behind a gateway the process gone is its 502, never a closed port
    hold, _, _ = _hold()
    hold({"event": "log_oom", "ts": 1.0, "line": "CUDA out of memory"})
    hold({"event": "server_down", "ts": 40.0, "reason": "http 503"})  # 39 s after the line: not this down's
    hold({"event": "server_up", "ts": 41.0})
    assert hold.hold_now() is None
    restarts = [0]
    hold, _, _ = _hold(restarts, hold_s=5.0)
    hold({"event": "server_down", "ts": 1.0, "reason": "timeout"})
    restarts[0] = 1  # our restart command ran for it (the restarter listens after the hold: it starts afterwards)
    hold({"event": "server_up", "ts": 30.0})
    assert hold.hold_now().duration_s == 5.0  # the plan's recovery_hold_s, as given


def test_a_crash_under_the_hold_ends_it_as_a_recurrence_and_no_second_hold_follows():
    hold, log, now = _running_hold("connection reset")
    now[0] += 3.0
    hold({"event": "server_down", "ts": 113.0, "reason": "connection refused"})
    assert log.written[-1]["ended"] == "crashed_again" and log.written[-1]["held_s"] == 3.0
    hold({"event": "server_up", "ts": 130.0})
    assert hold.hold_now() is None
    hold.close()  # nothing running: nothing more said
    assert len(log.written) == 1


def test_each_hold_status_is_read_from_the_events():
    held = Hold("soak-recovery-1", 120.0, 160.0, 8, {"agent": 1}, 40.0, 40.0, "held", "soak", 100.0, 50, 8)
    result = same_conditions(100.0, None, None, [held], 110.0)
    assert result["status"] == "held" and result["recurred"] is False and "a one-off" in result["why"]
    # a crash 3 s after a hold that ended `held` is its own, not the hold's recurrence
    assert same_conditions(100.0, 163.0, None, [held], 110.0)["status"] == "held"
    # lasting is not holding: no answer, or fewer users than the crash stage ran, proves nothing
    silent = Hold("soak-recovery-1", 120.0, 160.0, 8, {"agent": 1}, 40.0, 40.0, "held", "soak", 100.0, 0, 8)
    assert same_conditions(100.0, None, None, [silent], 110.0)["why"] == \
        "inconclusive, because the hold of stage soak's load answered no request"
    thin = Hold("soak-recovery-1", 120.0, 160.0, 8, {"agent": 1}, 40.0, 40.0, "held", "soak", 100.0, 9, 3)
    assert same_conditions(100.0, None, None, [thin], 110.0)["status"] == "cut_short"
    arriving = Hold("soak-recovery-1", 120.0, 160.0, 8, {"agent": 1}, 40.0, 40.0, "held", "soak", 100.0, 9, 3, True)
    assert same_conditions(100.0, None, None, [arriving], 110.0)["status"] == "held"  # users: a ceiling there
    recurring = Hold("soak-recovery-1", 120.0, 123.0, 8, {"agent": 1}, 40.0, 3.0, "crashed_again", "soak", 100.0)
    result = same_conditions(100.0, 123.2, None, [recurring], 200.0)
    assert result["status"] == "recurred" and result["recurred"] is True and abs(result["held_s"] - 3.2) < 1e-9
    assert hold_at([recurring], 123.2) is recurring  # the second crash is the recurrence
    assert same_conditions(123.2, None, recurring, [recurring], 200.0)["status"] == "not_run"
    cut = Hold("soak-recovery-1", 120.0, 130.0, 8, {"agent": 1}, 40.0, 10.0, "run_ended", "soak", 100.0)
    assert same_conditions(100.0, None, None, [cut], 130.0)["status"] == "cut_short"
    result = same_conditions(100.0, None, None, [], None)
    assert result["status"] == "not_run" and result["why"] == \
        "not re-applied, because the server did not come back within the run"
    assert "nothing showed its down was a crash" in same_conditions(100.0, None, None, [], 120.0)["why"]


def test_memory_still_held_with_the_server_gone_is_named():
    gpu = pd.DataFrame({"ts": [101.0, 102.0, 101.0, 102.0], "gpu": [0, 0, 1, 1],
                        "memory_used_mib": [70000.0, 300.0, 76000.0, 75500.0],
                        "memory_total_mib": [81920.0] * 4})
    result = _released(gpu, 100.0, 110.0)
    assert result["judged"] and result["released"] is False and list(result["held_mib"]) == ["GPU 1"], result
    assert "outlived its server" in result["why"]
    assert _released(gpu[gpu["gpu"] == 0], 100.0, 110.0)["released"] is True
    assert _released(gpu, 200.0, 210.0)["judged"] is False


def test_the_hold_hears_a_down_before_the_restarter_starts_a_command_for_it():
    """Both listen to the same server_down, one after the other: the hold must take its count of restarts first, or
    the command started for this very down never counts as evidence that it was a crash."""
    from pathlib import Path
    from types import SimpleNamespace

    from k3load.loadgen.observe import Restarter, watch_recoveries

    run = SimpleNamespace(events=SimpleNamespace(listeners=[]), limits={"resources": {}},
                          target=SimpleNamespace(options=SimpleNamespace(k3_max_restarts=3)))
    restarter = Restarter(run.events, Path("."), "true", 3)
    run.events.listeners.append(restarter)
    hold = watch_recoveries(run, lambda: SOAK, lambda: False)
    assert run.events.listeners == [hold, restarter]
    hold({"event": "server_down", "ts": 1.0, "reason": "timeout"})
    restarter.started = 1  # what the restarter does next, for the same down
    hold({"event": "server_up", "ts": 20.0})
    assert hold.hold_now() is not None and hold.hold_now().duration_s == 40.0


def test_a_health_flap_under_the_hold_does_not_end_it():
    hold, log, now = _running_hold("connection refused")
    now[0] += 2.0
    hold({"event": "server_down", "ts": 112.0, "reason": "http 503"})  # no death: the hold goes on
    assert hold.hold_now() is not None and log.written == []
    hold({"event": "log_engine_dead", "ts": 113.0, "line": "EngineDeadError"})
    hold({"event": "server_down", "ts": 114.0, "reason": "http 503"})  # now with the engine's death line
    assert hold.hold_now() is None and log.written[-1]["ended"] == "crashed_again"


def test_holds_are_bounded_by_the_runs_restarts():
    """A server that dies and comes back for good arms at most --k3-max-restarts holds (each stands the plan's
    clock still): the run ends."""
    log, now = Log(), [0.0]
    hold = RecoveryHold(log, stage=lambda: SOAK, restarts=lambda: 0, drilling=lambda: False, hold_s=1.0, cap_s=120.0,
                        clock=lambda: now[0], max_holds=2)
    armed = []
    for k in range(5):
        hold({"event": "server_down", "ts": 10.0 * k, "reason": "connection refused"})
        hold({"event": "server_up", "ts": 10.0 * k + 5})
        stage = hold.hold_now()
        armed.append(stage is not None)
        if stage is not None:
            hold.begin(SOAK)
            now[0] += 2.0
            assert hold.hold_now() is None  # held its second, ended
    assert armed == [True, True, False, False, False]
