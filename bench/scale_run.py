"""The hour-long run directory bench/analysis_scale.py judges, built from a real small run.

Why apart from bench/analysis_scale.py (which runs and compares the analyses): building a coherent hour
(records repeated with fresh ids and spread over the soak, the server's timeline stretched with them,
counters rising by the soak's own increase, events and stages moved) is one job; timing two trees' analyses
of it is another. How the directory is made: bench/analysis_scale.py's docstring.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
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

# What an analysis writes: never copied from the source run.
OUTPUTS = ("verdict.json", "report.md", "report.html", "alerts.yaml", "dashboard.json", "manifest.sha256",
           "report.png")
# Built here, never copied: records and metrics compressed as a run writes them (plain with `--plain`, or for a
# reference from before compact evidence); the source's files are read either way.
GENERATED = ("records.jsonl", "metrics.jsonl", "gpu.jsonl", "gpu.jsonl.gz", "events.jsonl", "plan.yaml", RECORDS,
             METRICS)
COUNTER_SUFFIXES = ("_total", "_sum", "_count", "_bucket")
SLOT = re.compile(r'"@K3SLOT:(\w+)@"')
ID_FIELDS = ("attempt_id", "chain_id", "user_id", "stream_pair", "session_id")
UUID_TAIL = re.compile(r"[0-9a-f]{32}\Z")
SPREAD = 0x9E3779B97F4A7C15F39CC0605CEDC835  # odd: each copy's ids a distinct 128-bit shift of the source's


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
        out.append(repr(value + shift) if isinstance(value, float) else json.dumps(copied_id(value, copy)))
        out.append(pieces[i + 1])
    return "".join(out)


def copied_id(value: str, copy: int) -> str:
    """A copy's id of the form a run writes: a uuid's hex (a session's `k3load-` and its first attempt's) stays
    32 hex digits, shifted per copy the same way wherever it appears; any other id gets the copy's number."""
    if UUID_TAIL.search(value):
        tail = (int(value[-32:], 16) + copy * SPREAD) % (1 << 128)
        return f"{value[:-32]}{tail:032x}"
    return f"{value}-{copy}"


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
