"""Does the harness stay flat over a day? RSS of the Locust process and the run's files on disk over a soak,
per hour and per million attempts, against a named reference measured in the same run, and the budget a
user plans a day-long soak with.

Reference: "sim", the `k3load sim` process serving the same traffic. Its memory is bounded by design (a KV
block pool and a 100,000-entry body index), so its growth is what a bounded process shows on this machine
under this load; the harness's growth after the warm-up is printed next to it, with the ratio.

A day compressed: the sim answers at `--time-scale` of model time (0.02: a 10 s answer in 0.2 s), and the
users send with no think time, so an hour of this soak carries as many attempts as a long stretch of real
traffic. What is measured is per attempt and per hour of wall time: the harness's RSS growth (least
squares over the samples after the warm-up, against the attempts answered by then and against the hours),
records.jsonl.gz per million attempts, and metrics.jsonl.gz per hour (one scrape a second whatever the rate;
per series, since a real vLLM serves more series than the sim). The budget for 24 hours at 10, 50 and 100
attempts/s is printed from those slopes; issue 11 asked under 50 MB of harness growth after the warm-up of
an hour at about 50 requests/s, issue 31 a day flat.

    .venv/bin/python bench/harness_soak.py [--duration-s 3600] [--users 8] [--warmup-s 120] [--time-scale 0.02]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.proc_memory import rss_mib  # noqa: E402
from k3load.evidence import lines, metrics_file, records_file  # noqa: E402
from k3load.sim.process import SimProcess  # noqa: E402

DAY_RATES = (10.0, 50.0, 100.0)  # attempts a second the printed day budget is worked out for
MIB = 1024 * 1024


@dataclass(frozen=True)
class Sample:
    """One reading: wall clock, both processes' RSS and the run's files' sizes."""

    ts: float
    harness_mib: float
    sim_mib: float
    records_bytes: int
    metrics_bytes: int
    gpu_bytes: int


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _plan(path: Path, duration_s: float, users: int) -> Path:
    stage = {"name": "soak", "kind": "soak", "duration_s": duration_s, "users": users,
             "mix": {"agent": 3, "shared_prefix": 2, "cold": 1}}
    path.write_text(yaml.safe_dump({"name": "harness-soak", "stages": [stage]}))
    return path


def _locust(url: str, out: Path, plan: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless", "--host", url,
           "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe", "recipes/local-dev.yaml", "--only-summary"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _sample(harness: subprocess.Popen[bytes], sim_pid: int, run: Path, every_s: float) -> list[Sample]:
    """A reading every `every_s` until the harness exits."""
    rows: list[Sample] = []
    while harness.poll() is None:
        mine, sims = rss_mib(harness.pid), rss_mib(sim_pid)
        if mine is not None and sims is not None:
            rows.append(Sample(time.time(), mine, sims, _size(run / "records.jsonl.gz"),
                               _size(run / "metrics.jsonl.gz"), _size(run / "gpu.jsonl")))
        time.sleep(every_s)
    return rows


def _ends(run: Path) -> list[float]:
    """Every attempt's end, sorted: the attempts answered by a sample's time."""
    ends = []
    for line in lines(records_file(run)):
        if line.endswith("\n"):
            ends.append(float(json.loads(line)["end_ts"]))
    return sorted(ends)


def _series(run: Path) -> int:
    """The series a scrape of the reference served (the metrics file's first readable row)."""
    for line in lines(metrics_file(run)):
        row = json.loads(line) if line.endswith("\n") else {}
        if row.get("vllm_series"):
            return int(row["vllm_series"])
    return 0


def _slope(x: list[float], y: list[float]) -> float | None:
    """Least-squares slope of y on x (None: fewer than three points or no spread in x)."""
    if len(x) < 3 or max(x) - min(x) <= 0:
        return None
    return float(np.polyfit(np.asarray(x), np.asarray(y), 1)[0])


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{unit}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--every-s", type=float, default=10.0)
    parser.add_argument("--time-scale", type=float, default=0.02, help="the sim's wall seconds per model second")
    parser.add_argument("--keep", type=Path, help="keep the run directory and the sim's log here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3load-soak-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        sim = SimProcess(["--time-scale", str(args.time_scale), "--seed", "3", "--model", "tiny"],
                         work / "sim.log").start()
        try:
            assert sim.proc is not None
            harness = _locust(sim.base_url, work / "run", _plan(work / "plan.yaml", args.duration_s, args.users))
            rows = _sample(harness, sim.proc.pid, work / "run", args.every_s)
        finally:
            sim.stop()
        ends = _ends(work / "run")
        series = _series(work / "run")
        verdict = json.loads((work / "run" / "verdict.json").read_text())["verdict"]
        run_start = json.loads((work / "run" / "run.json").read_text()).get("started_ts") or rows[0].ts
    load_end = rows[0].ts + args.duration_s
    during = [r for r in rows if rows[0].ts + args.warmup_s <= r.ts <= load_end]
    attempts_by = [bisect_right(ends, r.ts) / 1e6 for r in during]
    hours = [(r.ts - run_start) / 3600 for r in during]
    per_million = _slope(attempts_by, [r.harness_mib for r in during])
    per_hour = _slope(hours, [r.harness_mib for r in during])
    sim_per_hour = _slope(hours, [r.sim_mib for r in during])
    records_per_million = _slope(attempts_by, [r.records_bytes / MIB for r in during])
    metrics_per_hour = _slope(hours, [r.metrics_bytes / MIB for r in during])
    gpu_per_hour = _slope(hours, [r.gpu_bytes / MIB for r in during])
    rate = len(ends) / args.duration_s
    growth = max(r.harness_mib for r in during) - during[0].harness_mib if len(during) >= 2 else None
    sim_growth = max(r.sim_mib for r in during) - during[0].sim_mib if len(during) >= 2 else None
    judging = [r.harness_mib for r in rows if r.ts > load_end]

    print(f"soak of {args.duration_s:.0f} s, {args.users} users, sim time scale {args.time_scale}: {len(ends):,} "
          f"attempts ({rate:.1f}/s), verdict {verdict}, {len(rows)} samples ({len(during)} after the warm-up)")
    print(f"{'process':<10} {'after warm-up':>13} {'end MiB':>10} {'growth MiB':>11} {'MiB/hour':>9} "
          f"{'MiB/M attempts':>15}")
    first, last = (during[0], during[-1]) if during else (rows[0], rows[-1])  # after the warm-up
    print(f"{'harness':<10} {first.harness_mib:>13.1f} {last.harness_mib:>10.1f} "
          f"{_fmt(growth):>11} {_fmt(per_hour):>9} {_fmt(per_million):>15}")
    print(f"{'sim (ref)':<10} {first.sim_mib:>13.1f} {last.sim_mib:>10.1f} "
          f"{_fmt(sim_growth):>11} {_fmt(sim_per_hour):>9} {'':>15}")
    if growth is not None and sim_growth:
        print(f"harness growth / sim growth: {growth / sim_growth:.2f}")
    print(f"records.jsonl.gz: {_fmt(records_per_million, ' MiB', 1)} per million attempts; metrics.jsonl.gz: "
          f"{_fmt(metrics_per_hour, ' MiB', 2)} per hour ({series} series a scrape"
          + (f", {metrics_per_hour * 1024 / series:.2f} KiB per series-hour" if metrics_per_hour and series else "")
          + f"); gpu.jsonl: {_fmt(gpu_per_hour, ' MiB', 2)} per hour (the sim's GPUs, one row each a second)")
    if judging:
        print(f"harness peak while judging the run after the load: {max(judging):.1f} MiB "
              f"({len(judging)} samples; a one-off, not growth)")
    print("budget for 24 hours (from the slopes above; metrics for this many series):")
    for day_rate in DAY_RATES:
        millions = day_rate * 86400 / 1e6
        print(f"  {day_rate:>5.0f} attempts/s = {millions:,.2f} M attempts: harness RSS "
              f"+{_fmt(None if per_million is None else max(per_million, 0.0) * millions)} MiB, records "
              f"{_fmt(None if records_per_million is None else records_per_million * millions, ' MiB', 0)}, "
              f"metrics {_fmt(None if metrics_per_hour is None else metrics_per_hour * 24, ' MiB', 0)}, "
              f"gpu {_fmt(None if gpu_per_hour is None else gpu_per_hour * 24, ' MiB', 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
