"""`k3load demo`: the full acceptance job against the embedded sim, start to verdict, in minutes.

Starts `k3load sim` (a stand-in: the report says so), runs `locust -f locustfiles/agent.py` headless
with the smoke plan and the local-dev recipe, shows each stage as it starts, and ends with the verdict
and where the report is. The sim runs at a twentieth of model time so the whole plan takes about
1.5 minutes on a 2-core machine.

The demo owns the sim's process, so it hands the harness what an operator would: the sim's log as the
startup log and the server log it follows (`--k3-server-log`: a sim profile's injected OOM is read as one),
and a restart command of its own (`python -m k3load.demo_restart`, k3load.demo_restart) that restarts the
sim on the same port: the plan's restart stage runs the restart drill, and a crashed sim is started again.
Whatever happens, the sim (first or restarted) is stopped before the demo returns.

A bad `--sim-profile` is one line and exit code 2 before anything starts; a harness error (a plan that
does not exist, a bad option) is its one line and exit code 2, no verdict and no report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from k3load import demo_restart
from k3load.events import Event
from k3load.rundir_lock import in_use
from k3load.sim import cli as sim_cli
from k3load.sim.config import ProfileError
from k3load.sim.process import SimProcess
from k3load.yamlfile import one_line

ROOT = Path(__file__).resolve().parents[1]
SIM_ARGS = ["--time-scale", "0.05", "--prefill-ms-per-token", "0.2", "--seed", "1"]
HARNESS_ERROR = "k3load: harness error: "
# Locust's own "[date time] host/LEVEL/logger: " before each log line: the demo stamps its own elapsed time
LOCUST_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] [^ /]+/(?:INFO|WARNING|ERROR|CRITICAL|DEBUG)/[\w.]+: ")
HARNESS_ERROR_EXIT = 2  # as the harness's own: nothing was judged
PROGRESS = ("k3load: stage", "k3load verdict", "because:", "report:", "k3load precheck", "attempts recorded",
            "valid ", "restart drill", "restart command", HARNESS_ERROR)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/demo"),
                        help="run directory (replaced; refused while a live run holds it)")
    parser.add_argument("--plan", default="smoke", help="stage plan (name under plans/ or a file)")
    parser.add_argument("--recipe", default="recipes/local-dev.yaml", help="compat recipe")
    parser.add_argument("--sim-profile", type=Path, help="a sim profile (faults) to rehearse against")


def sim_args(profile: Path | None) -> list[str]:
    """The sim's arguments, checked as the sim will read them: ProfileError says what is wrong."""
    args = [*SIM_ARGS, *(["--profile", str(profile)] if profile else [])]
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    sim_cli.config_from_args(parser.parse_args(args))
    return args


def restart_command(state: Path) -> str:
    return f"{shlex.quote(sys.executable)} -m k3load.demo_restart {shlex.quote(str(state))}"


def _locust_command(args: argparse.Namespace, url: str, sim_log: Path, restart: str) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
            "--host", url, "--k3-out", str(args.out.resolve()), "--k3-plan", args.plan, "--k3-recipe", args.recipe,
            "--k3-startup-log", str(sim_log), "--k3-server-log", str(sim_log), "--k3-restart-cmd", restart,
            "--only-summary", "--loglevel", "INFO"]  # progress lines are INFO; the demo shows only its markers


def watch(command: list[str], started: float) -> tuple[int, str]:
    """Run Locust, show its progress lines; its exit code and the harness error's line ("" when none)."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    error = ""
    try:
        for line in proc.stdout:
            if HARNESS_ERROR in line and not error:
                error = line[line.index(HARNESS_ERROR):].strip()
            if any(marker in line for marker in PROGRESS) or "Traceback" in line or "Error" in line:
                print(f"[{time.monotonic() - started:5.0f}s] {LOCUST_PREFIX.sub('', line.rstrip())}", flush=True)
        return proc.wait(), error
    finally:
        if proc.poll() is None:  # the demo was interrupted: Locust goes with it
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def harness_error(out: Path, printed: str) -> str:
    """The harness error's line: as Locust printed it, else from events.jsonl; "" when there was none."""
    if printed:
        return printed
    try:
        events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return ""
    return next((HARNESS_ERROR + e["error"] for e in events if e.get("event") == Event.HARNESS_ERROR), "")


def _run_with_sim(args: argparse.Namespace, sims: list[str], sim_log: Path, started: float) -> tuple[int, str]:
    state_dir = Path(tempfile.mkdtemp(prefix="k3load-demo-"))
    try:
        with SimProcess(sims, sim_log) as sim:
            assert sim.proc is not None
            state = state_dir / "sim.json"
            port = urlsplit(sim.base_url).port or 0
            demo_restart.save(state, demo_restart.SimState(sim.proc.pid, port, sims, str(sim_log.resolve())))
            print(f"k3load demo: sim at {sim.base_url} (a stand-in, never evidence); plan {args.plan}; "
                  f"run directory {args.out}", flush=True)
            try:
                return watch(_locust_command(args, sim.base_url, sim_log.resolve(), restart_command(state)), started)
            finally:
                demo_restart.close(state)  # the restarted sim too; no restart after this
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    try:
        sims = sim_args(args.sim_profile)
    except ProfileError as exc:
        print(f"k3load demo: --sim-profile {one_line(str(exc))}", file=sys.stderr, flush=True)
        return HARNESS_ERROR_EXIT
    if busy := in_use(args.out):  # a live run's directory is never removed (k3load.rundir_lock)
        print(f"k3load demo: {busy}", file=sys.stderr, flush=True)
        return HARNESS_ERROR_EXIT
    if args.out.exists():
        subprocess.run(["rm", "-rf", str(args.out)], check=True)
    args.out.mkdir(parents=True)
    sim_log = args.out / "evidence-sim.log"
    started = time.monotonic()
    try:
        code, printed = _run_with_sim(args, sims, sim_log, started)
    except RuntimeError as exc:  # the sim did not start
        print(f"k3load demo: {one_line(str(exc))[:1000]}", file=sys.stderr, flush=True)
        return HARNESS_ERROR_EXIT
    took = time.monotonic() - started
    error = harness_error(args.out, printed) if code == HARNESS_ERROR_EXIT else ""
    if error:
        print(f"k3load demo: stopped after {took:.0f} s without a verdict or report: {error}", file=sys.stderr,
              flush=True)
        return HARNESS_ERROR_EXIT
    report = args.out / "report.html"
    where = f"open {report}" if report.exists() else "no report was written (see the lines above)"
    print(f"k3load demo: finished in {took:.0f} s (exit code {code}); {where}", flush=True)
    return code
