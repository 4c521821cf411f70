"""The ramp: per concurrency step throughput, latency, queue, KV and memory; the knee and what ran out.

Why for capacity planners: "how many concurrent agents can this deployment take, and what breaks
first" is the sizing question. The knee is the largest step still within the SLOs and resource
limits; the resource that ran out first is read from the first step past the knee.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile
from typing import Any

from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.limit_rules import ran_out_first
from k3load.workload.stage_kind import StageKind

RAMP_COLUMNS = ("stage", "users", "attempts", "requests_per_s", "output_tokens_per_s", "ttft_p50_ms",
                "ttft_p95_ms", "ttft_p99_ms", "ttfa_p50_ms", "ttfa_p95_ms", "ttfa_p99_ms", "itl_p50_ms", "itl_p95_ms",
                "itl_p99_ms", "e2e_p50_ms", "e2e_p95_ms", "e2e_p99_ms", "error_rate", "waiting_max",
                "waiting_sustained_s", "kv_usage_max", "preemptions", "gpu_memory_peak_mib", "gpu_headroom_min_pct",
                "gpu_growth_max_mib", "gpu_growth_max_pct", "goodput", "goodput_ci95", "goodput_requests_per_s",
                "goodput_output_tokens_per_s", "goodput_sessions_per_s", "session_goodput", "past_capacity",
                "full_batch_scrapes", "full_batch_queued_scrapes", "full_batch_cap", "sessions_per_s")


def load_steps(stage_table: list[StageRow], on_rate: bool | None = None) -> tuple[str | None, list[StageRow]]:
    """The load steps the ramp and the capacity plan read: the plan's last search's (a plan may search on users,
    then on rate), else the concurrency ramp's. `on_rate`: only a search on rate (True), or only steps of users
    (False: the last users search, else the ramp); None: whichever came last."""
    searches = [s for s in stage_table if s.kind == StageKind.SEARCH and s.users]
    if on_rate is not None:
        searches = [s for s in searches if (s.sessions_per_s is not None) == on_rate]
    if searches:
        last = searches[-1].search
        return StageKind.SEARCH, [s for s in searches if s.search == last]
    ramp_rows = [s for s in stage_table if s.kind == StageKind.CONCURRENCY and s.users]
    return (StageKind.CONCURRENCY, ramp_rows) if ramp_rows and not on_rate else (None, [])


@dataclass(frozen=True)
class RampMarks:
    """What the ramp's plots mark: the SLO lines, the goodput bound, the GPUs a replica has, whether the steps'
    load is a rate search's arrival rate, and the capacity point (analysis/analyze.py, from the stage table)."""

    slo: dict[str, float]
    min_goodput: float
    gpus: int | None
    on_rate: bool
    capacity_load: float | None


@dataclass(frozen=True)
class Ramp:
    """The ramp as judged: its steps (plain rows of RAMP_COLUMNS, as the reports and the plots show them), the
    knee and what ran out, and what its plots mark once the capacity point is known."""

    steps: tuple[dict[str, Any], ...]
    knee_users: int | None
    knee_sessions_per_s: float | None
    knee_stage: str | None
    ran_out_first: str | None
    first_step_past_knee: str | None
    largest_step_users: int | None
    largest_step_sessions_per_s: float | None
    marks: RampMarks | None = None  # None: not marked yet (the capacity point unknown)


def ramp_of(stage_table: list[StageRow]) -> Ramp:
    """The ramp over the load steps (`load_steps`), by their load; its steps are plain rows of RAMP_COLUMNS, as
    the reports and the plots take them (a column a step did not measure: None)."""
    steps = sorted(load_steps(stage_table)[1],  # by the load: a rate search's, else its users
                   key=lambda s: (s.sessions_per_s or s.users or 0, s.start_ts or 0.0))
    on_rate = bool(steps) and all(s.sessions_per_s is not None for s in steps)
    rows: list[dict[str, Any]] = []
    for step in steps:
        plain = step.to_dict()
        rows.append({c: plain.get(c) for c in RAMP_COLUMNS} | {"within_limits": not step.problems,
                                                               "problems": plain["problems"]})
    within = list(takewhile(lambda s: not s.problems, steps))  # the knee: the last step before the first breach
    knee = within[-1] if within else None
    first_bad = next((s for s in steps if s.problems), None)
    last = steps[-1] if steps else None
    return Ramp(steps=tuple(rows), knee_users=knee.users if knee and not on_rate else None,
                knee_sessions_per_s=knee.sessions_per_s if knee and on_rate else None,
                knee_stage=knee.stage if knee else None,
                ran_out_first=ran_out_first({p.id for p in first_bad.problems}) if first_bad else None,
                first_step_past_knee=first_bad.stage if first_bad else None,
                largest_step_users=last.users if last else None,
                largest_step_sessions_per_s=last.sessions_per_s if last and on_rate else None)
