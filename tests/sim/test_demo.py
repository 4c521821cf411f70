"""`k3load demo`'s pieces: a bad sim profile and a harness error are one line and exit 2; the demo's restart
command restarts its sim on the same port, and once the demo closes it no sim is left running."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import httpx

from k3load import demo, demo_restart
from k3load.sim.process import SimProcess
from tests.conftest import FAST_SIM


def _args(tmp_path: Path, **given: object) -> argparse.Namespace:
    return argparse.Namespace(**{"out": tmp_path / "run", "plan": "smoke", "recipe": "recipes/local-dev.yaml",
                                 "sim_profile": None, **given})


def test_a_bad_sim_profile_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys):
    profile = tmp_path / "bad.yaml"
    profile.write_text("faults: {no_such_fault: 1}\n")
    assert demo.run(_args(tmp_path, sim_profile=profile)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"k3load demo: --sim-profile {profile}: faults: unknown field")
    assert not (tmp_path / "run").exists()


def test_the_harness_error_line_is_read_from_the_output_or_else_from_the_events(tmp_path):
    line = "k3load: harness error: --k3-plan x: no such file"
    code, printed = demo.watch([sys.executable, "-c", f"import sys; print('noise'); sys.exit(print({line!r}) or 2)"],
                               0.0)
    assert (code, printed) == (2, line)
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "harness_error", "error": "bad input"}) + "\n")
    assert demo.harness_error(tmp_path, "") == "k3load: harness error: bad input"
    assert demo.harness_error(tmp_path / "none", "") == ""


def test_the_demo_hands_the_sim_log_and_its_restart_command_over(tmp_path):
    command = demo._locust_command(_args(tmp_path), "http://127.0.0.1:1", tmp_path / "sim.log", "RESTART")
    options = dict(itertools.pairwise(command))
    assert options["--k3-server-log"] == options["--k3-startup-log"] == str(tmp_path / "sim.log")
    assert options["--k3-restart-cmd"] == "RESTART"


def test_a_missing_plan_stops_the_demo_with_the_harness_error_line_and_no_sim_left(tmp_path, capsys, monkeypatch):
    closed: list[int] = []
    close = demo_restart.close

    def closing(state: Path) -> None:
        closed.append(demo_restart.load(state).pid)
        close(state)

    monkeypatch.setattr(demo_restart, "close", closing)
    assert demo.run(_args(tmp_path, plan="nosuchplan")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("k3load demo: stopped after") and "harness error: --k3-plan nosuchplan: no such file" in last
    assert len(closed) == 1 and not demo_restart.is_sim(closed[0])


def _answers(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_the_restart_command_restarts_the_sim_on_its_port_and_close_stops_it_for_good(tmp_path):
    log = tmp_path / "sim.log"
    with SimProcess(FAST_SIM, log) as sim:
        assert sim.proc is not None
        port = int(sim.base_url.rsplit(":", 1)[1])
        state = tmp_path / "sim.json"
        demo_restart.save(state, demo_restart.SimState(sim.proc.pid, port, FAST_SIM, str(log)))
        try:
            assert demo_restart.main([str(state)]) == 0  # a running sim: stopped, then started again
            first, restarted = sim.proc.pid, demo_restart.load(state).pid
            assert sim.proc.wait(5) is not None and restarted != first and _answers(sim.base_url)
            assert log.read_text().count("listening on") == 2  # one log, appended to
            assert demo_restart.main([str(state)]) == 0 and not demo_restart.is_sim(restarted)
        finally:
            demo_restart.close(state)
        assert not demo_restart.is_sim(demo_restart.load(state).pid)
        assert demo_restart.main([str(state)]) == 1  # after the demo's end no sim is started
