"""Manual ramping and the live counts the web UI shows.

    ManualStages  no plan shape drives the users (`--k3-manual`, or the web UI's class picker set to
                  the Default shape): every user count set from the UI is a new stage `manual-N` of kind
                  `concurrency`, and the run's `plan.yaml` is rewritten to the stages as they ran, with
                  the chosen plan's thresholds and settings, so the ramp report, its knee and "what ran
                  out first" read a ramp done by hand like a planned one.
    LiveCounts    attempts and failures by primary layer as records are written (cheap, per run).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import yaml

from k3load.workload.plan import Plan, Stage
from k3load.workload.stage_kind import StageKind

MANUAL_PLAN_NAME = "manual"


@dataclass
class ManualStages:
    active: bool = False
    stages: list[Stage] = field(default_factory=list)
    started: list[float] = field(default_factory=list)  # monotonic start of each stage
    ended_s: float | None = None  # the last stage's end (offset), once the run stopped

    def next(self, users: int, spawn_rate: float, mix: dict[str, int],
             clock: Callable[[], float] = time.monotonic) -> Stage:
        now = clock()
        t0 = self.started[0] if self.started else now
        stage = Stage(name=f"manual-{len(self.stages) + 1}", kind=StageKind.CONCURRENCY, start_s=now - t0,
                      duration_s=0.0, users=int(users), spawn_rate=float(spawn_rate),
                      mix={k: v for k, v in sorted(mix.items()) if v > 0})
        self.stages.append(stage)
        self.started.append(now)
        return stage

    def stop(self, clock: Callable[[], float] = time.monotonic) -> None:
        if self.started:
            self.ended_s = clock() - self.started[0]

    def plan_source(self, plan: Plan, clock: Callable[[], float] = time.monotonic) -> str:
        """The plan as run: the chosen plan's settings (thresholds, tool turns, the drill) with the
        manual stages so far (the running one up to now, a stage of 0 users left out: a plan stage
        has at least one). Before the first stage, one placeholder stage of the plan's first mix."""
        raw = yaml.safe_load(plan.source) if plan.source else {}
        raw = raw if isinstance(raw, dict) else {}
        raw.pop("description", None)
        raw["name"] = MANUAL_PLAN_NAME
        raw["description"] = f"manual ramp from the web UI (settings from plan {plan.name})"
        end = self.ended_s if self.ended_s is not None else (clock() - self.started[0] if self.started else 0.0)
        stages = []
        for i, stage in enumerate(self.stages):
            stop = self.stages[i + 1].start_s if i + 1 < len(self.stages) else end
            if stage.users > 0:
                stages.append({"name": stage.name, "kind": StageKind.CONCURRENCY.value, "users": stage.users,
                               "spawn_rate": stage.spawn_rate, "duration_s": round(max(stop - stage.start_s, 0.001), 3),
                               "mix": stage.mix or {"agent": 1}})
        if not stages:
            mix = dict(plan.stages[0].mix) if plan.stages else {"agent": 1}
            stages = [{"name": "manual-1", "kind": StageKind.CONCURRENCY.value, "users": 1, "duration_s": 0.001,
                       "mix": mix}]
        raw["stages"] = stages
        return yaml.safe_dump(raw, sort_keys=False)


@dataclass
class LiveCounts:
    attempts: int = 0
    valid: int = 0
    failed_by_layer: Counter[str] = field(default_factory=Counter)

    def add(self, line: str) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if record.get("drill"):
            return
        self.attempts += 1
        if record.get("valid"):
            self.valid += 1
        else:
            self.failed_by_layer[record.get("primary_layer") or "unknown"] += 1
