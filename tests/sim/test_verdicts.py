"""Each verdict, driven by the sim's fault profiles through the whole pipeline (Locust run, sampler,
precheck, analysis), asserting the reasons and not only the label; plus reproducibility and the
manifest."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3load.analysis.outputs.manifest import verify
from k3load.evidence import METRICS, RECORDS, lines, records_file
from tests.conftest import FAST_SIM

ROOT = Path(__file__).resolve().parents[2]
STAGES = [
    {"name": "prefix-control", "kind": "prefix_control", "duration_s": 4, "users": 1, "mix": {"shared_prefix": 1},
     "iterations_per_user": 1},
    {"name": "load", "kind": "load", "duration_s": 4, "users": 4, "mix": {"agent": 3, "shared_prefix": 1}},
    {"name": "long-input", "kind": "long_input", "duration_s": 3, "users": 1, "mix": {"long_input": 1}},
    {"name": "concurrency", "kind": "concurrency", "duration_s": 3, "steps": [2, 12],
     "mix": {"agent": 2, "shared_prefix": 1}},
    {"name": "soak", "kind": "soak", "duration_s": 4, "users": 4,
     "mix": {"agent": 2, "shared_prefix": 1, "cold": 1, "long_input": 1}},
]
DRILL = {"turns": ["tool_call"], "share": 0.5}  # as plans/smoke.yaml plays it
SIM = ["--time-scale", "0.05", "--prefill-ms-per-token", "0.2", "--max-model-len", "8192"]

pytestmark = pytest.mark.slow


def accept(start_sim, tmp_path: Path, sim_args: list[str], recipe: str = "recipes/local-dev.yaml",
           scenarios: str = "scenarios/*.yaml", stages: list[dict] | None = None,
           options: Callable[[Any], list[str]] = lambda sim: [], thresholds: dict | None = None
           ) -> tuple[dict, int, Path]:
    """One whole run against a sim started with `sim_args`; `options(sim)` adds locust options."""
    sim = start_sim(*SIM, *sim_args)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "verdict-test", "stages": stages or STAGES, "stream_equivalence": DRILL}
                                   | ({"thresholds": thresholds} if thresholds else {})))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
           "--host", sim.base_url, "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe", recipe,
           "--k3-scenarios", scenarios, "--k3-startup-log", str(sim.log_path), "--k3-server-log",
           str(sim.log_path), "--only-summary", *options(sim)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (out / "verdict.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "verdict.json").read_text()), run.returncode, out


def restart_command(pidfile: Path, port: int, log: Path, *faults: str, delay_s: float = 0.0) -> str:
    """An operator's restart hook: stop the pidfile's sim (wait until it is gone, a zombie counts as gone),
    wait `delay_s` (a slow start), then `exec` a new one on the same port, its pid in the pidfile."""
    args = " ".join([*FAST_SIM, *SIM, *faults])
    return (f"pid=$(cat {pidfile}); kill $pid; "
            f"while s=$(awk '{{print $3}}' /proc/$pid/stat 2>/dev/null) && [ -n \"$s\" ] && [ \"$s\" != Z ]; "
            f"do sleep 0.05; done; {f'sleep {delay_s:g}; ' if delay_s else ''}echo $$ > {pidfile}; "
            f"exec {sys.executable} -m k3load sim {args} --port {port} >> {log} 2>&1")


def accept_with_restart(start_sim, tmp_path: Path, sim_args: list[str], stages: list[dict],
                        restart_faults: tuple[str, ...] = ()) -> tuple[dict, int, Path]:
    """`accept` with the plan's restart stage drilled: the sim restarted on its port by `restart_command` (with
    `restart_faults`: a server that comes back broken)."""
    port, pidfile = _free_port(), tmp_path / "sim.pid"

    def first_sim(*args: str):
        sim = start_sim(*args)
        pidfile.write_text(str(sim.proc.pid))
        return sim

    command = restart_command(pidfile, port, tmp_path / "restarted.log", *restart_faults)
    try:
        return accept(first_sim, tmp_path, [*sim_args, "--port", str(port)], stages=stages,
                      options=lambda sim: ["--k3-restart-cmd", command])
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int(pidfile.read_text()), signal.SIGTERM)  # the restarted sim


RESTART = {"name": "restart", "kind": "restart", "duration_s": 3, "users": 4, "mix": {"agent": 1}}


def test_healthy_sim_is_go_reproducible_and_signed(start_sim, tmp_path):
    """Every stage kind the seed asks for, the restart drill included: `go`, every checklist line ticked (or not
    applicable under the local-dev recipe, or the signer's own)."""
    verdict, code, out = accept_with_restart(start_sim, tmp_path, [], [*STAGES, RESTART])
    assert set(verdict) == {"verdict", "pillars", "limits", "checklist", "next_action"}
    assert verdict["verdict"] == "go" and code == 0, verdict["next_action"]
    assert verdict["pillars"]["resources"]["numbers"]["restart_drill"]["status"] == "pass"
    assert {i["status"] for i in verdict["checklist"]} <= {"ok", "not_applicable", "to_sign"}, verdict["checklist"]
    assert {p["status"] for p in verdict["pillars"].values()} == {"pass"}
    assert "cold/warm pairs" in verdict["pillars"]["prefix_cache"]["reasons"][0]
    assert any("k3load sim" in b for b in verdict["next_action"]["because"])
    for name in (METRICS, RECORDS, "gpu.jsonl", "events.jsonl", "compat.json", "report.md", "report.html",
                 "alerts.yaml", "dashboard.json", "manifest.sha256"):
        assert (out / name).exists(), name
    records = [json.loads(x) for x in lines(out / RECORDS)]
    per_request = ((out / RECORDS).stat().st_size + (out / METRICS).stat().st_size) / len(records)
    assert per_request <= 300, f"{per_request:.0f} B per request (issue 16: at most 300, compact evidence)"
    for name in (METRICS, "gpu.jsonl", "events.jsonl"):  # the timelines overlap the records'
        stamps = [json.loads(x)["ts"] for x in lines(out / name)]
        assert min(stamps) <= min(r["send_ts"] for r in records) and max(stamps) >= max(r["end_ts"] for r in records)
    gpu = [json.loads(x) for x in (out / "gpu.jsonl").read_text().splitlines()]
    assert gpu and all(row["simulated"] for row in gpu)
    assert verify(out) == []
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = (copy / "verdict.json").read_bytes()
    (copy / "verdict.json").unlink()
    again = subprocess.run([sys.executable, "-m", "k3load", "analyze", str(copy)], capture_output=True, text=True)
    assert again.returncode == 0 and (copy / "verdict.json").read_bytes() == before
    (out / RECORDS).write_bytes((out / RECORDS).read_bytes() + b"\0")
    assert verify(out) == [f"changed: {RECORDS}"]


def test_rebuild_stops_before_load_unless_asked_and_the_verdict_stays_rebuild(start_sim, tmp_path):
    """The production recipe against the sim fails the precheck: by default no load runs (test_verdict_matrix's
    production row); with --k3-load-after-rebuild the plan runs, its load judged beside the rebuild."""
    stage = [{"name": "load", "kind": "load", "duration_s": 2, "users": 2, "mix": {"agent": 1}}]
    verdict, code, out = accept(start_sim, tmp_path, [], recipe="recipes/kimi-k3.yaml", stages=stage,
                                options=lambda sim: ["--k3-load-after-rebuild"])
    assert verdict["verdict"] == "rebuild" and code == 4
    assert verdict["pillars"]["resources"]["numbers"]["stages"][0]["attempts"] > 0
    assert not any(b.startswith("no load ran") for b in verdict["next_action"]["because"])
    precheck = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if '"precheck"' in x]
    assert precheck[0]["status"] == "fail" and precheck[0]["load_skipped"] is False


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_killed_mid_soak_is_restarted_and_checked(start_sim, tmp_path):
    import os
    import signal
    import time

    port = _free_port()
    sim = start_sim(*SIM, "--port", str(port))
    pidfile, restart_log = tmp_path / "restarted.pid", tmp_path / "restarted.log"
    restart = (f"echo $$ > {pidfile}; exec {sys.executable} -m k3load sim {' '.join(FAST_SIM + SIM)} "
               f"--port {port} >> {restart_log} 2>&1")
    stages = [STAGES[1], {"name": "soak", "kind": "soak", "duration_s": 14, "users": 4,
                          "mix": {"agent": 2, "shared_prefix": 1}},
              {"name": "restart", "kind": "restart", "duration_s": 5, "users": 4,
               "mix": {"agent": 2, "shared_prefix": 1}}]
    plan = tmp_path / "plan.yaml"
    # the crash's hold (the soak's load again once the server is back) is not what this test is about: 3 s of it
    plan.write_text(yaml.safe_dump({"name": "restart-test", "stages": stages,
                                    "thresholds": {"resources": {"recovery_hold_s": 3}}}))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
           "--host", sim.base_url, "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe",
           "recipes/local-dev.yaml", "--k3-restart-cmd", restart, "--only-summary"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and '"stage":"soak"' not in _read(out / "events.jsonl"):
            time.sleep(0.2)
        time.sleep(3)
        sim.proc.send_signal(signal.SIGKILL)  # the crash, mid-soak
        killed_ts = time.time()
        assert proc.wait(120) in (0, 3, 5)
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
    verdict = json.loads((out / "verdict.json").read_text())
    crash = verdict["pillars"]["resources"]["numbers"]["crashes"][0]
    assert crash["stage"] == "soak" and "after long running" in crash["phase"]
    assert crash["restart"]["recovered"] is True and crash["restart"]["ok_after_restart"] > 0
    events = [json.loads(x) for x in _read(out / "events.jsonl").splitlines()]
    assert [e["event"] for e in events if e["event"] in ("server_down", "restart_command", "server_up")][:3] == \
        ["server_down", "restart_command", "server_up"]
    attempts = [json.loads(x) for x in lines(records_file(out))] if records_file(out).exists() else []
    assert len({a["attempt_id"] for a in attempts}) == len(attempts)
    finished_before = [a for a in attempts if a["end_ts"] < killed_ts - 0.5]
    assert finished_before and all(a["status"] == "ok" for a in finished_before if not a["drill"])


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
