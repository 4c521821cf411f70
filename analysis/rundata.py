"""Load a run directory into typed tables: the only input of every judgment.

Why one loader: `k3load analyze DIR` must judge a directory copied from a GPU cluster exactly as the
run that wrote it did, so nothing downstream reads files or the clock on its own. Missing files are
empty tables (a pillar then says `not_run` or `inconclusive`, with the reason), never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from k3load.plan import Plan, PlanError, parse_plan
from k3load.records import Attempt, read_records
from k3load.validate import primary_layer

RECORD_COLUMNS = ("attempt_id", "chain_id", "attempt", "stage", "scenario", "family", "turn", "turn_kind",
                  "status", "send_ts", "first_token_ts", "end_ts", "ttft_ms", "itl_mean_ms", "e2e_ms",
                  "prompt_tokens", "completion_tokens", "cached_tokens", "max_tokens", "valid", "drill",
                  "will_retry", "prefix_sha256", "request_sha256", "request_bytes", "http_status", "error", "user_id",
                  "primary_layer", "control_pair", "control_role")


@dataclass
class StageWindow:
    name: str
    kind: str
    start_ts: float
    end_ts: float
    users: int | None = None


@dataclass
class RunData:
    path: Path
    run: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None
    attempts: list[Attempt] = field(default_factory=list)
    records: pd.DataFrame = field(default_factory=pd.DataFrame)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    gpu: pd.DataFrame = field(default_factory=pd.DataFrame)
    events: list[dict[str, Any]] = field(default_factory=list)
    compat: dict[str, Any] | None = None
    reuse_design: dict[str, Any] | None = None  # reuse_design.json: designed prefix reuse (None: not measured)
    stages: list[StageWindow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unreadable lines or files, reported not hidden

    def events_named(self, *names: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in names]

    def stage_of(self, ts: float) -> StageWindow | None:
        for stage in self.stages:
            if stage.start_ts <= ts < stage.end_ts:
                return stage
        return None


def _jsonl(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):  # a torn last line is expected after a crash
                problems.append(f"{path.name}:{number}: unreadable line skipped")
    return rows


def _with_primary_layer(attempts: list[Attempt]) -> None:
    """Records written before `primary_layer` existed: the same rule, from the findings they carry."""
    for attempt in attempts:
        if attempt.primary_layer is None and not attempt.valid:
            attempt.primary_layer = primary_layer(attempt.findings)


def _records_frame(attempts: list[Attempt]) -> pd.DataFrame:
    rows = [{c: getattr(a, c) for c in RECORD_COLUMNS} | {"failed_layers": list(a.failed_layers)}
            for a in attempts]
    frame = pd.DataFrame(rows, columns=[*RECORD_COLUMNS, "failed_layers"])
    return frame.sort_values(["send_ts", "attempt_id"], kind="mergesort").reset_index(drop=True)


def _stage_windows(events: list[dict[str, Any]], attempts: list[Attempt]) -> list[StageWindow]:
    starts = sorted((e for e in events if e.get("event") == "stage_start"), key=lambda e: e["ts"])
    ends = [e["ts"] for e in events if e.get("event") == "run_end"]
    last = max([*ends, *(a.end_ts for a in attempts)], default=None)
    windows = []
    for i, event in enumerate(starts):
        end = starts[i + 1]["ts"] if i + 1 < len(starts) else (last if last is not None else event["ts"])
        windows.append(StageWindow(event["stage"], event.get("kind", ""), event["ts"], max(end, event["ts"]),
                                   event.get("users")))
    return windows


def load_run(path: Path) -> RunData:
    data = RunData(path=path)
    problems = data.problems
    if (path / "run.json").exists():
        data.run = json.loads((path / "run.json").read_text())
    if (path / "plan.yaml").exists():
        text = (path / "plan.yaml").read_text()
        try:
            data.plan = parse_plan(yaml.safe_load(text), str(path / "plan.yaml"), text)
        except (PlanError, yaml.YAMLError) as exc:
            problems.append(f"plan.yaml: {exc}")
    if (path / "records.jsonl").exists():
        data.attempts = read_records(path / "records.jsonl")
        _with_primary_layer(data.attempts)
    data.records = _records_frame(data.attempts)
    data.metrics = sorted(_jsonl(path / "metrics.jsonl", problems), key=lambda r: r.get("ts", 0))
    data.gpu = pd.DataFrame(_jsonl(path / "gpu.jsonl", problems))
    data.events = sorted(_jsonl(path / "events.jsonl", problems), key=lambda r: r.get("ts", 0))
    for event in data.events_named("worker_spools"):  # the master gave up waiting for a worker's records
        problems += [f"{worker} did not report its users stopped: its last turns may be missing"
                     for worker in event.get("not_final") or []]
    if (path / "compat.json").exists():
        data.compat = json.loads((path / "compat.json").read_text())
    if (path / "reuse_design.json").exists():
        data.reuse_design = json.loads((path / "reuse_design.json").read_text())
    data.stages = _stage_windows(data.events, data.attempts)
    return data
