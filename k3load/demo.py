"""`k3load demo`: the full acceptance job against the embedded sim, start to verdict, in minutes.

Starts `k3load sim` (a stand-in: the report says so), runs `locust -f locustfiles/agent.py` headless
with the smoke plan and the local-dev recipe, shows each stage as it starts, and ends with the verdict
and where the report is. The sim runs at a twentieth of model time so the whole plan takes about
1.5 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from k3load.rundir_lock import in_use
from k3load.sim.process import SimProcess

ROOT = Path(__file__).resolve().parents[1]
SIM_ARGS = ["--time-scale", "0.05", "--prefill-ms-per-token", "0.2", "--seed", "1"]
PROGRESS = ("k3load: stage", "k3load verdict", "because:", "report:", "k3load precheck", "attempts recorded",
            "valid ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/demo"),
                        help="run directory (replaced; refused while a live run holds it)")
    parser.add_argument("--plan", default="smoke", help="stage plan (name under plans/ or a file)")
    parser.add_argument("--recipe", default="recipes/local-dev.yaml", help="compat recipe")
    parser.add_argument("--sim-profile", type=Path, help="a sim profile (faults) to rehearse against")


def _locust_command(args: argparse.Namespace, url: str, sim_log: Path) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
            "--host", url, "--k3-out", str(args.out), "--k3-plan", args.plan, "--k3-recipe", args.recipe,
            "--k3-startup-log", str(sim_log), "--only-summary", "--loglevel", "WARNING"]


def run(args: argparse.Namespace) -> int:
    if busy := in_use(args.out):  # a live run's directory is never removed (k3load.rundir_lock)
        print(f"k3load demo: {busy}", file=sys.stderr, flush=True)
        return 2
    if args.out.exists():
        subprocess.run(["rm", "-rf", str(args.out)], check=True)
    args.out.mkdir(parents=True)
    sim_log = args.out / "evidence-sim.log"
    sim_args = [*SIM_ARGS, *(["--profile", str(args.sim_profile)] if args.sim_profile else [])]
    started = time.monotonic()
    with SimProcess(sim_args, sim_log) as sim:
        print(f"k3load demo: sim at {sim.base_url} (a stand-in, never evidence); plan {args.plan}; "
              f"run directory {args.out}", flush=True)
        proc = subprocess.Popen(_locust_command(args, sim.base_url, sim_log), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        for line in proc.stdout:
            if any(marker in line for marker in PROGRESS) or "Traceback" in line or "Error" in line:
                print(f"[{time.monotonic() - started:5.0f}s] {line.rstrip()}", flush=True)
        code = proc.wait()
    print(f"k3load demo: finished in {time.monotonic() - started:.0f} s (exit code {code}); open "
          f"{args.out / 'report.html'}", flush=True)
    return code
