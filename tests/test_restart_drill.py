"""The restart drill on the sim: --k3-restart-cmd really stops the running sim (its pidfile) and starts
one on the same port; the restart stage then holds the load of the stage before it. Recovered means
ready again, a good answer, and that load within the limits; a server that comes back broken fails."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from k3load.sim.process import SimProcess
from tests.conftest import FAST_SIM
from tests.test_verdicts import SIM, _free_port, accept

pytestmark = pytest.mark.slow

STAGES = [{"name": "load", "kind": "load", "duration_s": 3, "users": 4, "mix": {"agent": 3, "shared_prefix": 1}},
          # its own users and mix are not what the drill holds: the stage before's are
          {"name": "restart", "kind": "restart", "duration_s": 4, "users": 1, "mix": {"cold": 1}}]


def _restart_command(pidfile: Path, port: int, log: Path, *faults: str) -> str:
    """An operator's restart hook: stop the pidfile's sim (wait until it is gone, a zombie counts as gone),
    then `exec` a new one on the same port, its pid in the pidfile."""
    args = " ".join([*FAST_SIM, *SIM, *faults])
    return (f"pid=$(cat {pidfile}); kill $pid; "
            f"while s=$(awk '{{print $3}}' /proc/$pid/stat 2>/dev/null) && [ -n \"$s\" ] && [ \"$s\" != Z ]; "
            f"do sleep 0.05; done; echo $$ > {pidfile}; exec {sys.executable} -m k3load sim {args} --port {port} "
            f">> {log} 2>&1")


def _drill(start_sim: Callable[..., SimProcess], tmp_path: Path, *faults: str) -> tuple[dict, Path]:
    port, pidfile = _free_port(), tmp_path / "sim.pid"

    def first_sim(*args: str) -> SimProcess:
        sim = start_sim(*args)
        pidfile.write_text(str(sim.proc.pid))  # type: ignore[union-attr]
        return sim

    command = _restart_command(pidfile, port, tmp_path / "restarted.log", *faults)
    try:
        verdict, _, out = accept(first_sim, tmp_path, ["--port", str(port)], stages=STAGES,
                                 options=lambda sim: ["--k3-restart-cmd", command])
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int(pidfile.read_text()), signal.SIGTERM)  # the restarted sim
    return verdict, out


def _events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


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
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    held = [r for r in records if r["stage"] == "restart"]
    assert held and all(r["send_ts"] >= ready["ts"] for r in held)  # no load while the server was away
    drains = {r["stage"]: r["status"] for r in resources["numbers"]["drain"]}
    assert drains == {"load": "drained", "restart": "drained"}, drains
    assert "## Restart drill" in (out / "report.md").read_text()
    assert (out / "restart-drill.log").exists()


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
