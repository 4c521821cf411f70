"""Does the harness keep its memory flat over a long soak? RSS of the Locust process over time, against
a named reference measured in the same run.

Reference: "sim", the `k3load sim` process serving the same traffic. Its memory is bounded by design
(a KV block pool and a 100,000-entry body index), so its growth is what a bounded process shows on
this machine under this load; the harness's growth after the warm-up is printed next to it, with the
ratio. Issue 11 asks for under 50 MB of harness growth after the first minutes of an hour at about
50 requests/s (`--duration-s 3600`); shorter runs are rehearsals of the script, not that figure.

    .venv/bin/python bench/harness_soak.py [--duration-s 3600] [--users 4] [--warmup-s 120]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3load.evidence import lines, records_file  # noqa: E402
from k3load.sim.process import SimProcess  # noqa: E402

SIM_ARGS = ["--time-scale", "0.05", "--seed", "3", "--model", "tiny"]


def rss_mib(pid: int) -> float | None:
    """Resident memory of one process from /proc (None once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _plan(path: Path, duration_s: float, users: int) -> Path:
    stage = {"name": "soak", "kind": "soak", "duration_s": duration_s, "users": users,
             "mix": {"agent": 3, "shared_prefix": 2, "cold": 1}}
    path.write_text(yaml.safe_dump({"name": "harness-soak", "stages": [stage]}))
    return path


def _locust(url: str, out: Path, plan: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless", "--host", url,
           "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe", "recipes/local-dev.yaml", "--only-summary"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _sample(harness: subprocess.Popen[bytes], sim_pid: int, every_s: float) -> list[tuple[float, float, float]]:
    """(seconds since start, harness MiB, sim MiB) every `every_s` until the harness exits."""
    start, rows = time.monotonic(), []
    while harness.poll() is None:
        mine, sims = rss_mib(harness.pid), rss_mib(sim_pid)
        if mine is not None and sims is not None:
            rows.append((time.monotonic() - start, mine, sims))
        time.sleep(every_s)
    return rows


def _growth(rows: list[tuple[float, float, float]], warmup_s: float, load_end_s: float, column: int) -> float | None:
    """Growth over the load after the warm-up. Samples after the load's end are left out: the harness then
    judges the run (pandas reads every record), a one-off peak that is not a leak; it is printed apart."""
    during = [r[column] for r in rows if warmup_s <= r[0] <= load_end_s]
    return max(during) - during[0] if len(during) >= 2 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--every-s", type=float, default=10.0)
    parser.add_argument("--keep", type=Path, help="keep the run directory and the sim's log here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3load-soak-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        sim = SimProcess(SIM_ARGS, work / "sim.log").start()
        try:
            assert sim.proc is not None
            harness = _locust(sim.base_url, work / "run", _plan(work / "plan.yaml", args.duration_s, args.users))
            rows = _sample(harness, sim.proc.pid, args.every_s)
        finally:
            sim.stop()
        records = [line for line in lines(records_file(work / "run")) if line.endswith("\n")]
        verdict = json.loads((work / "run" / "verdict.json").read_text())["verdict"]
    mine, ref = (_growth(rows, args.warmup_s, args.duration_s, column) for column in (1, 2))
    judging = [r[1] for r in rows if r[0] > args.duration_s]
    rate = len(records) / args.duration_s
    print(f"soak of {args.duration_s:.0f} s, {args.users} users: {len(records)} attempts ({rate:.1f}/s), "
          f"verdict {verdict}, {len(rows)} samples")
    print(f"{'process':<10} {'start MiB':>10} {'end MiB':>10} {'growth after warm-up MiB':>26}")
    for name, column, growth in (("harness", 1, mine), ("sim (ref)", 2, ref)):
        print(f"{name:<10} {rows[0][column]:>10.1f} {rows[-1][column]:>10.1f} "
              f"{growth if growth is not None else float('nan'):>26.1f}")
    if mine is not None and ref:
        print(f"harness growth / sim growth: {mine / ref:.2f}")
    if judging:
        print(f"harness peak while judging the run after the load: {max(judging):.1f} MiB "
              f"({len(judging)} samples; a one-off, not growth)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
