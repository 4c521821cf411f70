"""`k3load analyze` at the scale of an hour's soak: wall time and peak memory, against today's code.

Reference: the analysis as committed at `--reference-commit` (by default the commit before the
analysis-at-scale work, issue 16 item 4), checked out into a temporary `git worktree` and run on a copy
of the same run directory in the same run of this script. Printed: both wall times, both peak RSS
(ru_maxrss of the child plus that of its own children: the process that draws the plots), the ratios
reference / this tree, and whether the two verdict.json files are byte-identical (a verdict is a pure
function of the run directory), or differ only in the reuse intervals that an hour's soak now draws from
the normal approximation (`_same_verdict`).

The run directory is built from a real small run (`make demo` writes runs/demo): its records are
repeated with fresh attempt, chain, user, session and stream-pair ids (a uuid's hex stays one, as runs write
them: `scale_run.copied_id`), relabelled to the soak stage and spread
over a soak stretched to an hour (`--soak-s`), about 100 requests/s at 360,000 records. The server's
timeline is stretched with them, so the directory stays coherent: metrics.jsonl and gpu.jsonl repeat
the soak's 1 Hz scrapes over the hour (cumulative counters keep rising by the soak's own increase per
repetition), and the stages, drain readings and run end after the soak move by the same amount.
Records and metrics are written as a run writes them (records.jsonl.gz and metrics.jsonl.gz, through the
run's own writer, k3load.rundir.JsonlLog); `--plain` writes records.jsonl and metrics.jsonl instead, as
runs before compact evidence did (chosen by itself for a reference commit that reads no compressed file).

Each analysis runs in a fresh Python process (imports included, as `k3load analyze DIR` runs) that
imports k3load from the tree under test only, so the two trees never mix.

    .venv/bin/python bench/analysis_scale.py [--records 360000 | --quick] [--source runs/demo]
        [--reference-commit REV [--overlay] | --no-reference] [--this-commit REV] [--keep DIR] [--profile]
        [--plain]
    .venv/bin/python bench/analysis_scale.py --hours 1,4,24 [--rate 100] [--cap-mib 4096] [--source DIR]

`--hours` builds a soak of each length at `--rate` records a second and judges it with the working tree alone:
wall time, peak memory (killed and said past `--cap-mib`), their growth per million records over the first
length's, and issue 31's targets (an hour in 3 s; a day in 60 s and 2 GiB) met or missed.

`--this-commit HEAD` measures the committed tree instead of the working tree (other work in progress in
the checkout then changes nothing); `--overlay` makes the reference the measured tree with only the
analysis-at-scale files (SCALE_FILES) put back as they were at the reference commit, so verdict changes
committed since by others are on both sides and the byte comparison still isolates this work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3load.evidence import records_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.* when run as `python bench/analysis_scale.py`

from bench.proc_memory import tree_pss_mib  # noqa: E402
from bench.scale_run import build_run, link_copy  # noqa: E402

# The last commit before the analysis-at-scale work: the reference the speed-up is measured against.
REFERENCE_COMMIT = "68d6d888d0f89b4a20ab21b8b1e083e91677623f"
# The files the analysis-at-scale work changed (put back for `--overlay`).
# Their paths from before analysis/ was laid out in rooms: an overlay needs a tree from before that too.
SCALE_FILES = ("analysis/lean.py", "analysis/rundata.py", "analysis/agreement.py", "analysis/pillar.py",
               "analysis/pillar_agent.py", "analysis/pillar_cache.py", "analysis/reuse.py", "analysis/stats.py",
               "analysis/timeline.py", "analysis/tool_calls.py", "analysis/analyze.py", "analysis/reuse_replay.py")

# A fresh interpreter that imports k3load (and k3load.analysis, the top-level analysis/ folder) from
# the tree named in argv[1] only, then runs `k3load analyze argv[2]` (under cProfile with argv[3]).
CHILD = r"""
import sys
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location
from pathlib import Path

root, run_dir = Path(sys.argv[1]), sys.argv[2]
roots = {"k3load": root / "k3load", "k3load.analysis": root / "analysis"}


class TreeFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname in roots:
            return spec_from_file_location(fullname, roots[fullname] / "__init__.py",
                                           submodule_search_locations=[str(roots[fullname])])
        parent = fullname.rpartition(".")[0]
        return PathFinder.find_spec(fullname, [str(roots[parent])]) if parent in roots else None


sys.meta_path.insert(0, TreeFinder)
from k3load.cli import main

if len(sys.argv) > 3:
    import cProfile
    cProfile.run("code = main(['analyze', run_dir])", sys.argv[3])
else:
    code = main(["analyze", run_dir])
import resource
print("K3PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""
PEAK = re.compile(r"^K3PEAK (\d+) (\d+)$", re.M)


# -- running the analysis ---------------------------------------------------------------------------

@dataclass
class Measured:
    wall_s: float
    cpu_s: float  # user + system CPU of the child: what a busy machine inflates least
    peak_mib: float
    code: int
    output: str
    capped: bool = False  # killed at the memory cap (`--cap-mib`): peak_mib is what it had reached


def analyze(tree: Path, run_dir: Path, profile: Path | None = None, cap_mib: float | None = None) -> Measured:
    """`k3load analyze run_dir` with the code of `tree`, in a fresh process: wall time and its peak RSS. With
    `cap_mib`, the analysis (its process and the plots' beside it) is killed once their RSS together passes the
    cap (`Measured.capped`): a day judged by code that holds every record would take the machine's memory."""
    with tempfile.TemporaryFile("w+") as log:
        argv = [sys.executable, "-c", CHILD, str(tree), str(run_dir), *([str(profile)] if profile else [])]
        began = time.perf_counter()
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tree,
                                 start_new_session=cap_mib is not None)
        watched, pid = Watched(), 0
        try:
            pid, status, usage = os.wait4(child.pid, 0 if cap_mib is None else os.WNOHANG)
            while pid == 0:  # watched (`cap_mib`): polled until it ends, killed past the cap
                _watch(child.pid, watched, cap_mib or 0.0)
                time.sleep(0.1)
                pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        finally:
            if pid == 0 and cap_mib is not None:  # interrupted while it ran (Ctrl-C): its session goes too
                os.killpg(child.pid, signal.SIGKILL)
                os.waitpid(child.pid, 0)
        wall = time.perf_counter() - began
        child.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    if watched.capped:
        return Measured(wall, usage.ru_utime + usage.ru_stime, watched.peak_mib, child.returncode, output,
                        capped=True)
    if not (run_dir / "verdict.json").exists():
        raise SystemExit(f"analyze with {tree} wrote no verdict (exit {child.returncode}):\n{output[-3000:]}")
    # Peak memory: the analysis's own peak plus its children's (the plots' process beside it), a bound on
    # what both held at once; the rusage's ru_maxrss alone would be the larger of the two.
    found = PEAK.search(output)
    peak = (int(found[1]) + int(found[2])) if found else usage.ru_maxrss
    return Measured(wall, usage.ru_utime + usage.ru_stime, peak / 1024, child.returncode, output)


@dataclass
class Watched:
    peak_mib: float = 0.0
    capped: bool = False


def _watch(pid: int, watched: Watched, cap_mib: float) -> None:
    """One look at the analysis's memory (its children's added, by PSS); past `cap_mib`, its session is killed (the
    analysis and the plots' child)."""
    watched.peak_mib = max(watched.peak_mib, tree_pss_mib(pid))
    if watched.peak_mib > cap_mib and not watched.capped:
        watched.capped = True
        os.killpg(pid, signal.SIGKILL)


@contextmanager
def worktree(commit: str, path: Path, overlay_from: str | None = None) -> Iterator[Path]:
    """A commit's code checked out into a temporary worktree (removed afterwards); with `overlay_from`,
    the SCALE_FILES replaced there by their content at that commit (absent there: removed)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                   capture_output=True)
    try:
        if overlay_from and not (path / "analysis" / "rundata.py").exists():
            raise SystemExit("--overlay puts back flat analysis/ files: the measured tree (--this-commit) must be from "
                             "before analysis/ was laid out in rooms")
        for name in SCALE_FILES if overlay_from else ():
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{overlay_from}:{name}"], capture_output=True)
            if shown.returncode == 0:
                (path / name).write_bytes(shown.stdout)
            else:
                (path / name).unlink(missing_ok=True)
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False,
                       capture_output=True)


def _reads_compressed(commit: str) -> bool:
    """Whether the tree at `commit` reads records.jsonl.gz (compact evidence, k3load/evidence.py)."""
    return subprocess.run(["git", "cat-file", "-e", f"{commit}:k3load/evidence.py"], cwd=ROOT,
                          capture_output=True).returncode == 0


def _rev(name: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", name], check=True, capture_output=True,
                          text=True).stdout.strip()


def _warm(run_dir: Path) -> None:
    """Read the inputs once so neither side pays for a cold page cache."""
    for path in (*run_dir.glob("*.jsonl"), *run_dir.glob("*.jsonl.gz")):
        with path.open("rb") as handle:
            while handle.read(1 << 24):
                pass


def _same(a: Path, b: Path, name: str) -> str:
    if not (a / name).exists() or not (b / name).exists():
        return "missing"
    return "identical" if (a / name).read_bytes() == (b / name).read_bytes() else "DIFFERENT"


INTERVAL_SLACK = 0.005  # half a percentage point: the reasons print reuse intervals in whole percents


def _differences(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, a's value, b's value) for each leaf where two JSON documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            yield from _differences(a.get(key), b.get(key), f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield path, a, b


def _same_verdict(a: Path, b: Path) -> str:
    """verdict.json byte for byte, or else the same judgment with only reuse intervals moved.

    Why the one allowance: from `NORMAL_RATIO_FROM` attempts a family's reuse interval is the normal
    one instead of the seeded bootstrap's (analysis/run/stats.py), so its endpoints move within the
    bootstrap's own resampling noise; every status, reason and other number must still be the same."""
    plain = _same(a, b, "verdict.json")
    if plain != "DIFFERENT":
        return plain
    moved = list(_differences(json.loads((b / "verdict.json").read_text()),
                              json.loads((a / "verdict.json").read_text())))
    others = [d for d in moved if not re.search(r"_ci95\[[01]\]$", d[0]) or not all(
        isinstance(v, float) for v in d[1:]) or abs(d[1] - d[2]) > INTERVAL_SLACK]
    if others:
        return "DIFFERENT: " + "; ".join(f"{p}: {x!r} -> {y!r}" for p, x, y in others[:5])
    return (f"the same judgment ({len(moved)} reuse interval endpoints moved, at most "
            f"{max(abs(x - y) for _, x, y in moved):.4f}: the normal interval at this size)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=360_000, help="records in the built run (default 360000)")
    parser.add_argument("--quick", action="store_true", help="30,000 records")
    parser.add_argument("--source", type=Path, default=ROOT / "runs" / "demo", help="the small run to repeat")
    parser.add_argument("--soak-s", type=float, default=3600.0, help="the stretched soak's length")
    parser.add_argument("--reference-commit", default=REFERENCE_COMMIT, help="the code measured against")
    parser.add_argument("--overlay", action="store_true",
                        help="reference: the measured tree with SCALE_FILES as at --reference-commit")
    parser.add_argument("--this-commit", help="measure this commit (default: the working tree)")
    parser.add_argument("--no-reference", action="store_true", help="measure this tree only")
    parser.add_argument("--keep", type=Path, help="build (and keep) the run directories here")
    parser.add_argument("--profile", action="store_true", help="also write cProfile stats next to each run dir")
    parser.add_argument("--plain", action="store_true",
                        help="write records and metrics plain (.jsonl), as runs before compact evidence did")
    parser.add_argument("--hours", help="soak lengths in hours, comma-separated (e.g. 1,4,24): each built at --rate "
                        "and judged by this tree alone; prints wall time and peak memory per length")
    parser.add_argument("--rate", type=float, default=100.0, help="records a second of soak for --hours (100)")
    parser.add_argument("--cap-mib", type=float, default=4096.0,
                        help="with --hours: an analysis past this RSS (its plots' child added) is killed and said")
    args = parser.parse_args(argv)
    if args.hours:
        hours = [float(h) for h in args.hours.split(",")]
        if not all(h > 0 for h in hours) or args.rate <= 0:
            parser.error("--hours and --rate: positive numbers (e.g. --hours 1,4,24)")
        return _by_hours(args, hours)
    total = 30_000 if args.quick else args.records
    work = args.keep or Path(tempfile.mkdtemp(prefix="k3load-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, total, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


# Issue 31's targets for the judgment of a long soak on this 2-core machine (wall s, peak MiB), by soak hours.
TARGETS = {1.0: (3.0, None), 24.0: (60.0, 2048.0)}


def _by_hours(args: argparse.Namespace, hours: list[float]) -> int:
    """Each soak length built and judged in turn (its directory removed after, unless --keep): the wall time, the
    peak memory, and their growth per million records over the first length's, against TARGETS."""
    work = args.keep or Path(tempfile.mkdtemp(prefix="k3load-hours-"))
    rows: list[tuple[float, int, float, Measured]] = []
    try:
        for length in hours:
            run_dir = work / f"{length:g}h" / "run"
            shutil.rmtree(run_dir.parent, ignore_errors=True)
            run_dir.parent.mkdir(parents=True)
            began = time.perf_counter()
            written = build_run(args.source.resolve(), run_dir, round(args.rate * 3600 * length), 3600 * length)
            built = time.perf_counter() - began
            _warm(run_dir)
            measured = analyze(ROOT, run_dir, cap_mib=args.cap_mib)
            rows.append((length, written, built, measured))
            _print_hours(rows, args.cap_mib)
            if args.keep is None:
                shutil.rmtree(run_dir.parent, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not m.capped and m.code in (0, 3, 4, 5) for *_, m in rows) else 1


def _print_hours(rows: list[tuple[float, int, float, Measured]], cap_mib: float) -> None:
    print(f"\n{'hours':>6}{'records':>11}{'built s':>9}{'wall s':>9}{'cpu s':>9}{'peak MiB':>10}"
          f"{'MiB/M rec':>11}{'s/M rec':>9}  target")
    first = rows[0]
    for length, written, built, m in rows:
        grow = ((m.peak_mib - first[3].peak_mib) / ((written - first[1]) / 1e6)
                if written > first[1] and not m.capped and not first[3].capped else None)
        pace = m.wall_s / (written / 1e6)
        wall_cap, memory_cap = TARGETS.get(length, (None, None))
        target = "; ".join(filter(None, [
            f"wall <= {wall_cap:g} s: {'met' if m.wall_s <= wall_cap and not m.capped else 'MISSED'}"
            if wall_cap else "",
            f"peak <= {memory_cap:g} MiB: {'met' if m.peak_mib <= memory_cap and not m.capped else 'MISSED'}"
            if memory_cap else ""]))
        peak = f">{cap_mib:.0f}" if m.capped else f"{m.peak_mib:.0f}"
        print(f"{length:>6g}{written:>11,}{built:>9.1f}{m.wall_s:>9.1f}{m.cpu_s:>9.1f}{peak:>10}"
              f"{(f'{grow:.0f}' if grow is not None else '-'):>11}{('-' if m.capped else f'{pace:.1f}'):>9}  {target}"
              + (f" (killed at the {cap_mib:.0f} MiB cap after {m.wall_s:.0f} s)" if m.capped else ""))


def _run(args: argparse.Namespace, total: int, work: Path) -> int:
    mine, theirs = work / "this" / "run", work / "reference" / "run"
    for path in (mine.parent, theirs.parent):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    began = time.perf_counter()
    plain = args.plain or (not args.no_reference and not args.overlay and not _reads_compressed(args.reference_commit))
    if plain and not args.plain:
        print(f"records and metrics written plain: {args.reference_commit[:10]} reads no compressed evidence")
    written = build_run(args.source.resolve(), mine, total, args.soak_s, plain)
    records = records_file(mine)
    size = records.stat().st_size
    print(f"built {mine}: {written} records in {records.name} ({size / written:.0f} B each, {size / 2**20:.0f} MiB),"
          f" {args.soak_s:.0f} s soak, in {time.perf_counter() - began:.1f} s")
    rows: list[tuple[str, Measured]] = []
    this = args.this_commit and _rev(args.this_commit)
    if not args.no_reference:
        link_copy(mine, theirs)
        base = this or "HEAD" if args.overlay else args.reference_commit
        with worktree(base, work / "reference-tree", args.reference_commit if args.overlay else None) as tree:
            _warm(theirs)
            name = f"reference {args.reference_commit[:10]}" + (" overlay" if args.overlay else "")
            rows.append((name, analyze(tree, theirs, work / "reference.prof" if args.profile else None)))
    _warm(mine)
    if this:
        with worktree(this, work / "this-tree") as tree:
            rows.append((f"this {this[:10]}", analyze(tree, mine, work / "this.prof" if args.profile else None)))
    else:
        rows.append(("this tree", analyze(ROOT, mine, work / "this.prof" if args.profile else None)))
    load = os.getloadavg()[0]
    print(f"\n{'code':<30}{'records':>9}{'wall s':>9}{'cpu s':>9}{'peak MiB':>10}{'exit':>6}")
    for name, m in rows:
        print(f"{name:<30}{written:>9}{m.wall_s:>9.2f}{m.cpu_s:>9.2f}{m.peak_mib:>10.0f}{m.code:>6}")
    print(f"load average at the end: {load:.1f} on {os.cpu_count()} CPUs (other work inflates wall time first)")
    print(f"verdict: {json.loads((mine / 'verdict.json').read_text())['verdict']}")
    if len(rows) == 2:
        ref, new = rows[0][1], rows[1][1]
        print(f"ratio reference / this tree: wall time {ref.wall_s / new.wall_s:.2f}x, CPU time "
              f"{ref.cpu_s / new.cpu_s:.2f}x, peak memory {ref.peak_mib / new.peak_mib:.2f}x")
        same = {name: _same(mine, theirs, name) for name in ("alerts.yaml", "dashboard.json")}
        print("byte for byte: " + ", ".join(f"{k} {v}" for k, v in same.items()))
        verdict = _same_verdict(mine, theirs)
        print(f"verdict.json: {verdict}")
        if verdict.startswith(("DIFFERENT", "missing")):
            print("verdict.json DIFFERS from the reference's: the change altered a judgment")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
