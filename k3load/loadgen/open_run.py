"""What exists once the master or local runner has opened a run: its directory, its logs, its plan, its target.

Why a frozen record: before a run starts the session has none of these, and once it has started it has all of
them. Held as Optional fields on the session, every observer that runs during a run had to assert each one back
into existence; handed an `OpenRun`, the precheck, the sampler, the drain, the restart drill and the workers'
delivery read only what they need and cannot be built before the run is open. It outlives the run's end: the
judgment and the web UI's links still read its directory, while its logs are closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3load.analysis.pillars.pillar import thresholds
from k3load.loadgen.target import TargetApi
from k3load.rundir import JsonlLog, WriteGuard
from k3load.workload.plan import Plan


@dataclass(frozen=True)
class OpenRun:
    run_id: str
    run_dir: Path
    plan: Plan
    records: JsonlLog  # records.jsonl.gz, one line per attempt
    events: JsonlLog  # events.jsonl, shared with the sampler and every observer
    guard: WriteGuard  # every writer's first failed write stops the run (k3load.loadgen.hold)
    target: TargetApi  # the host and options the run was started for

    @property
    def limits(self) -> dict[str, dict[str, float]]:
        """The plan's thresholds over the defaults."""
        return thresholds(self.plan.thresholds)
