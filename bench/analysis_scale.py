"""`k3load analyze` at the scale of an hour's soak: wall time and peak memory, against today's code.

Reference: the analysis as committed at `--reference-commit` (by default the commit before the
analysis-at-scale work, issue 16 item 4), checked out into a temporary `git worktree` and run on a copy
of the same run directory in the same run of this script. Printed: both wall times, both peak RSS
(ru_maxrss of the child plus that of its own children: the process that draws the plots), the ratios
reference / this tree, and whether the two verdict.json files are byte-identical (a verdict is a pure
function of the run directory), or differ only in the reuse intervals that an hour's soak now draws from
the normal approximation (`_same_verdict`).

The run directory is built from a real small run (`make demo` writes runs/demo): its records are
repeated with fresh attempt, chain, user and stream-pair ids, relabelled to the soak stage and spread
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

`--this-commit HEAD` measures the committed tree instead of the working tree (other work in progress in
the checkout then changes nothing); `--overlay` makes the reference the measured tree with only the
analysis-at-scale files (SCALE_FILES) put back as they were at the reference commit, so verdict changes
committed since by others are on both sides and the byte comparison still isolates this work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from k3load import evidence
from k3load.evidence import LEGACY, METRICS, RECORDS, SeriesTable, metrics_file, records_file
from k3load.records import json_line
from k3load.rundir import JsonlLog
from k3load.sampler.prom import split_key
from k3load.sampler.vllm_metrics import VllmMetric

ROOT = Path(__file__).resolve().parents[1]
# The last commit before the analysis-at-scale work: the reference the speed-up is measured against.
REFERENCE_COMMIT = "68d6d888d0f89b4a20ab21b8b1e083e91677623f"
# The files the analysis-at-scale work changed (put back for `--overlay`).
# Their paths from before analysis/ was laid out in rooms: an overlay needs a tree from before that too.
SCALE_FILES = ("analysis/lean.py", "analysis/rundata.py", "analysis/agreement.py", "analysis/pillar.py",
               "analysis/pillar_agent.py", "analysis/pillar_cache.py", "analysis/reuse.py", "analysis/stats.py",
               "analysis/timeline.py", "analysis/tool_calls.py", "analysis/analyze.py", "analysis/reuse_replay.py")
OUTPUTS = ("verdict.json", "report.md", "report.html", "alerts.yaml", "dashboard.json", "manifest.sha256",
           "report.png")
# Built here, never copied: records and metrics compressed as a run writes them (plain with `--plain`, or for a
# reference from before compact evidence); the source's files are read either way.
GENERATED = ("records.jsonl", "metrics.jsonl", "gpu.jsonl", "gpu.jsonl.gz", "events.jsonl", "plan.yaml", RECORDS,
             METRICS)
COUNTER_SUFFIXES = ("_total", "_sum", "_count", "_bucket")
SLOT = re.compile(r'"@K3SLOT:(\w+)@"')
ID_FIELDS = ("attempt_id", "chain_id", "user_id", "stream_pair")

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


# -- building the run directory ---------------------------------------------------------------------

def _jsonl(path: Path, decode: Callable[[Any], Any] = lambda row: row) -> list[dict[str, Any]]:
    """The rows of a JSONL file, compressed or plain (k3load.evidence.lines)."""
    if not path.exists():
        return []
    return [decode(json.loads(line)) for line in evidence.lines(path) if line.strip()]


def _write_jsonl(path: Path, rows: list[dict[str, Any]], encode: Callable[[Any], Any] | None = None) -> None:
    with _log(path, encode) as log:
        for row in rows:
            log.append(row)


@contextmanager
def _log(path: Path, encode: Callable[[Any], Any] | None = None) -> Iterator[JsonlLog]:
    """The run's own writer (k3load.rundir.JsonlLog): a `.gz` path deflated and flushed as a run does it."""
    log = JsonlLog(path, encode)
    try:
        yield log
    finally:
        log.close()


def _gpu_rows(source: Path) -> list[dict[str, Any]]:
    """The source's gpu.jsonl, or its compressed copy (tests/data/scale-run stores it so): the analysis reads
    gpu.jsonl, so the built run gets it plain."""
    compressed = source / "gpu.jsonl.gz"
    return _jsonl(compressed if compressed.exists() else source / "gpu.jsonl")


@dataclass
class Layout:
    """Where the soak is in the source run and how far everything after it moves."""

    soak: str
    start: float  # soak start (its stage_start)
    end: float  # the next stage's start, or the run's end
    soak_s: float  # the stretched soak's length
    after: set[str]  # stages after the soak

    @property
    def cycle_s(self) -> float:
        return max(self.end - self.start, 1.0)

    @property
    def shift_s(self) -> float:
        return self.soak_s - (self.end - self.start)

    @property
    def repetitions(self) -> int:
        return math.ceil(self.soak_s / self.cycle_s)


def _layout(events: list[dict[str, Any]], records: list[dict[str, Any]], soak_s: float) -> Layout:
    starts = sorted((e for e in events if e.get("event") == "stage_start"), key=lambda e: e["ts"])
    if not starts:
        raise SystemExit("the source run has no stage_start events: not a run directory written by a run")
    soak = next((i for i, e in enumerate(starts) if e.get("kind") == "soak"), len(starts) - 1)
    ends = [e["ts"] for e in events if e.get("event") == "run_end"] or [max(r["end_ts"] for r in records)]
    end = starts[soak + 1]["ts"] if soak + 1 < len(starts) else max(ends)
    return Layout(starts[soak]["stage"], starts[soak]["ts"], end, soak_s, {e["stage"] for e in starts[soak + 1:]})


def _template(record: dict[str, Any], stage: str) -> tuple[list[str], dict[str, Any]]:
    """The record as a JSON line split around its per-copy fields (ids and timestamps), relabelled to
    `stage` and out of the cache control (a copy is a soak request, not a control pair)."""
    slotted = dict(record, stage=stage, control_pair=None, control_role=None)
    values: dict[str, Any] = {}
    for key, value in record.items():
        if (key in ID_FIELDS and isinstance(value, str)) or (key.endswith("_ts") and isinstance(value, float)):
            slotted[key] = f"@K3SLOT:{key}@"
            values[key] = value
    return SLOT.split(json_line(slotted)), values


def _copy_line(pieces: list[str], values: dict[str, Any], copy: int, shift: float) -> str:
    out = [pieces[0]]
    for i in range(1, len(pieces), 2):
        value = values[pieces[i]]
        out.append(repr(value + shift) if isinstance(value, float) else json.dumps(f"{value}-{copy}"))
        out.append(pieces[i + 1])
    return "".join(out)


def _shifted(record: dict[str, Any], shift: float) -> dict[str, Any]:
    """Every timestamp of a record, event or reading (`ts`, `*_ts`) moved by `shift` seconds."""
    return {k: v + shift if (k == "ts" or k.endswith("_ts")) and isinstance(v, float) else v
            for k, v in record.items()}


def build_records(source: Path, dest: Path, total: int, layout: Layout, name: str = RECORDS) -> int:
    """Copy 0 is the source run (the stages after the soak moved); copies 1.. fill the soak to `total`."""
    lines = [line.removesuffix("\n") for line in evidence.lines(records_file(source)) if line.strip()]
    records = [json.loads(line) for line in lines]
    t0 = min(r["send_ts"] for r in records)
    span = max(r["end_ts"] for r in records) - t0
    order = sorted(range(len(records)), key=lambda i: records[i]["send_ts"])
    templates = [_template(records[i], layout.soak) for i in order]
    extra = max(total - len(records), 0)
    copies = math.ceil(extra / len(records)) if records else 0
    room = max(layout.soak_s - span, 0.0)
    written = 0
    with _log(dest / name) as out:
        for line, record in zip(lines, records, strict=True):
            out.append_line(json_line(_shifted(record, layout.shift_s)) if record["stage"] in layout.after else line)
            written += 1
        for copy in range(1, copies + 1):
            shift = layout.start - t0 + (room * (copy - 1) / (copies - 1) if copies > 1 else 0.0)
            for pieces, values in templates[:min(len(templates), total - written)]:
                out.append_line(_copy_line(pieces, values, copy, shift))
                written += 1
    return written


def _counter(key: str) -> bool:
    return split_key(key)[0].endswith(COUNTER_SUFFIXES)


def _increase(lines: list[dict[str, Any]], layout: Layout) -> dict[tuple[str, str], float]:
    """Per (source, counter key): how much it rose over the soak (from the last scrape before it)."""
    first: dict[tuple[str, str], float] = {}
    last: dict[tuple[str, str], float] = {}
    for line in lines:
        if not line.get("ok") or line.get("ts", 0) >= layout.end:
            continue
        for key, value in (line.get("samples") or {}).items():
            if value is None or not _counter(key):
                continue
            ident = (str(line.get("source")), key)
            if line["ts"] < layout.start or ident not in first:
                first[ident] = value
            last[ident] = value
    return {k: max(last[k] - first[k], 0.0) for k in last}


def _with_counters(line: dict[str, Any], times: float, increase: dict[tuple[str, str], float]) -> dict[str, Any]:
    if not times or not line.get("samples"):
        return line
    source = str(line.get("source"))
    samples = {k: v + times * increase.get((source, k), 0.0) if v is not None else v
               for k, v in line["samples"].items()}
    return dict(line, samples=samples)


def stretch(rows: list[dict[str, Any]], layout: Layout, increase: dict[tuple[str, str], float] | None = None
            ) -> list[dict[str, Any]]:
    """A 1 Hz timeline (metrics or GPU rows) with the soak's rows repeated over the stretched soak."""
    out = []
    for row in sorted(rows, key=lambda r: r.get("ts", 0)):
        ts = row.get("ts", 0)
        if ts < layout.start:
            out.append(row)
        elif ts >= layout.end:
            out.append(_with_counters(dict(row, ts=ts + layout.shift_s), layout.repetitions - 1, increase or {}))
    soak = [r for r in rows if layout.start <= r.get("ts", 0) < layout.end]
    for rep in range(layout.repetitions):
        for row in soak:
            ts = row["ts"] + rep * layout.cycle_s
            if ts < layout.start + layout.soak_s:
                out.append(_with_counters(dict(row, ts=ts), rep, increase or {}))
    return sorted(out, key=lambda r: r.get("ts", 0))


def _offset(increase: dict[tuple[str, str], float], name: str, match: dict[str, str] | None = None) -> float:
    total = 0.0
    for (_, key), value in increase.items():
        series, labels = split_key(key)
        if series == name and (not match or match.items() <= labels.items()):
            total += value
    return total


def build_events(events: list[dict[str, Any]], layout: Layout, increase: dict[tuple[str, str], float],
                 total: int) -> list[dict[str, Any]]:
    """Events after the soak (and the soak's own drain) move with it; their counter readings rise."""
    reps = layout.repetitions - 1
    generated = reps * _offset(increase, VllmMetric.GENERATION_TOKENS_TOTAL)
    aborted = reps * _offset(increase, VllmMetric.REQUEST_SUCCESS_TOTAL, {"finished_reason": "abort"})
    out = []
    for event in events:
        moved = event.get("ts", 0) >= layout.end or (event.get("event") == "stage_drain"
                                                       and event.get("stage") == layout.soak)
        if not moved:
            out.append(event)
            continue
        event = _shifted(event, layout.shift_s)
        for side in ("first", "last"):
            if isinstance(event.get(side), dict):
                reading = _shifted(event[side], layout.shift_s)
                if reading.get("generation_tokens") is not None:
                    reading["generation_tokens"] += generated
                if reading.get("aborted") is not None:
                    reading["aborted"] += aborted
                event[side] = reading
        if event.get("event") == "run_end":
            event["attempts"] = total
        out.append(event)
    return sorted(out, key=lambda e: e.get("ts", 0))


def build_plan(source: Path, dest: Path, layout: Layout) -> None:
    if not (source / "plan.yaml").exists():
        return
    plan = yaml.safe_load((source / "plan.yaml").read_text())
    for stage in plan.get("stages") or []:
        if stage.get("name") == layout.soak:
            stage["duration_s"] = int(layout.soak_s)
    (dest / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))


def build_run(source: Path, dest: Path, total: int, soak_s: float, plain: bool = False) -> int:
    """A coherent run directory of `total` records from the small run at `source` (module doc); records and
    metrics compressed as a run writes them (metrics with their series names once: SeriesTable), or plain."""
    if not records_file(source).exists():
        raise SystemExit(f"{source}: no records.jsonl.gz (make a small run first: `make demo` writes runs/demo)")
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(*OUTPUTS, *GENERATED, "spool"))
    events = _jsonl(source / "events.jsonl")
    layout = _layout(events, _jsonl(records_file(source)), soak_s)
    metrics = _jsonl(metrics_file(source), SeriesTable().decode)
    increase = _increase(metrics, layout)
    stretched = stretch(metrics, layout, increase)
    if plain:
        _write_jsonl(dest / LEGACY[METRICS], stretched)
    else:  # the series names once per file, as the sampler writes them
        _write_jsonl(dest / METRICS, stretched, SeriesTable().encode)
    _write_jsonl(dest / "gpu.jsonl", stretch(_gpu_rows(source), layout))
    _write_jsonl(dest / "events.jsonl", build_events(events, layout, increase, total))
    build_plan(source, dest, layout)
    return build_records(source, dest, total, layout, LEGACY[RECORDS] if plain else RECORDS)


def link_copy(source: Path, dest: Path) -> None:
    """A second run directory with the same inputs: big files hard-linked (analyze replaces its outputs
    by temp file + rename and never writes an input in place), the rest copied."""
    def copy(src: str, dst: str) -> None:
        if Path(src).stat().st_size > 1 << 20:
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(source, dest, copy_function=copy)


# -- running the analysis ---------------------------------------------------------------------------

@dataclass
class Measured:
    wall_s: float
    cpu_s: float  # user + system CPU of the child: what a busy machine inflates least
    peak_mib: float
    code: int
    output: str


def analyze(tree: Path, run_dir: Path, profile: Path | None = None) -> Measured:
    """`k3load analyze run_dir` with the code of `tree`, in a fresh process: wall time and its peak RSS."""
    with tempfile.TemporaryFile("w+") as log:
        argv = [sys.executable, "-c", CHILD, str(tree), str(run_dir), *([str(profile)] if profile else [])]
        began = time.perf_counter()
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - began
        child.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    if not (run_dir / "verdict.json").exists():
        raise SystemExit(f"analyze with {tree} wrote no verdict (exit {child.returncode}):\n{output[-3000:]}")
    # Peak memory: the analysis's own peak plus its children's (the plots' process beside it), a bound on
    # what both held at once; the rusage's ru_maxrss alone would be the larger of the two.
    found = PEAK.search(output)
    peak = (int(found[1]) + int(found[2])) if found else usage.ru_maxrss
    return Measured(wall, usage.ru_utime + usage.ru_stime, peak / 1024, child.returncode, output)


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
    args = parser.parse_args(argv)
    total = 30_000 if args.quick else args.records
    work = args.keep or Path(tempfile.mkdtemp(prefix="k3load-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, total, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


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
