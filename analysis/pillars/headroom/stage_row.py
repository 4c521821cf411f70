"""One stage's row of the stage table, typed: the figures `stages.stage_stats` measures and the limits it broke.

Why typed: the pillar, the ramp, the capacity plan and the verdict read a stage's figures by name; a typo in a
dict key reads as `None` ("unknown") and passes silently, an attribute does not. The row is plain data in one
place only, `to_dict()`, exactly as the stage table has always carried it in verdict.json and the reports: the
same keys in the same order, the groups that exist for some stages only (goodput when the SLOs are known, the
arrival lag of an open-loop stage, a search step's search, a replay's figures, the server's histograms of a
buffered stream) present only where they were measured. Units are in the field names, as in the keys.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

from k3load.analysis.pillars.headroom.buffering import ServerLatency
from k3load.analysis.pillars.headroom.goodput import Goodput
from k3load.analysis.pillars.rules import Breach

# Fields said only when measured: None is "not this kind of stage", and the key is then absent from the row.
OPTIONAL = ("sessions_per_s", "search", "replay", "server_side_latency", "latency_unjudged",
            "load_generator_cpu_wait_pct_by_process")
# What `StageRow.of` gives a figure a test does not name (the rest: None, "unknown" or "not measured").
_BRIEF: dict[str, Any] = {
    "stage": "load", "kind": "load", "start_ts": 0.0, "duration_s": 0.0, "attempts": 0, "errors": 0,
    "error_rate_ci95": (None, None), "error_rate_distinct_requests": 0, "sent_while_down": 0, "errors_by_layer": {},
    "error_kinds": {}, "requests_per_s": 0.0, "output_tokens_per_s": 0.0, "kv_usage_max_by_source": {},
    "load_generator_cpu_max_pct_by_process": {}, "server_down_events": 0, "health_flaps": 0, "metrics_present": False,
}


@dataclass(frozen=True)
class ArrivalLag:
    """An open-loop stage's scheduled turns and how late they went out (arrival_lag.arrival_lag)."""

    scheduled_turns: int
    late_turns: int
    late_share: float | None
    late_share_ci95: list[float | None]
    send_lag_p50_ms: float | None
    send_lag_p95_ms: float | None
    send_lag_max_ms: float | None
    sessions_arrived: int | None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class StageRow:
    """A stage's figures, in the stage table's order. `problems`: the limits it broke, in the order the rules are
    declared (stages.stage_breaches); empty: within limits."""

    stage: str
    kind: str  # a StageKind
    users: int | None
    start_ts: float
    duration_s: float
    attempts: int
    # errors (stages._errors): load errors only, the requests sent while the server was down said beside them
    errors: int
    error_rate: float | None
    error_rate_ci95: tuple[float | None, float | None]
    error_rate_distinct_requests: int
    sent_while_down: int
    errors_by_layer: dict[str, int]
    error_kinds: dict[str, int]
    requests_per_s: float
    output_tokens_per_s: float
    max_prompt_tokens_ok: int | None
    # latencies of the answered requests (stages._latency); None: unknown
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    ttfa_p50_ms: float | None
    ttfa_p95_ms: float | None
    ttfa_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p95_ms: float | None
    e2e_p99_ms: float | None
    # the server's gauges and counters over the stage
    kv_usage_mean: float | None
    kv_usage_max: float | None
    kv_usage_max_by_source: dict[str, float]
    waiting_max: float | None
    waiting_sustained_s: float | None
    running_max: float | None
    load_generator_cpu_max_pct: float | None
    load_generator_cpu_max_pct_by_process: dict[str, float]
    # each process's mean share of the stage's wall time waiting for a CPU (k3load.sampler.cpu_wait): a host
    # short of CPU starves the load generator without saturating it; None (absent): not recorded
    load_generator_cpu_wait_pct_by_process: dict[str, float] | None
    preemptions: float | None
    preemptions_per_min: float | None
    server_down_events: int
    health_flaps: int
    metrics_present: bool
    # GPU memory (gpu_growth.stage_figures); None: no GPU telemetry in the stage
    gpu_memory_peak_mib: float | None
    gpu_headroom_min_pct: float | None
    gpu_baseline_headroom_min_pct: float | None
    gpu_growth_max_mib: float | None
    gpu_growth_max_pct: float | None
    gpu_growth_gpu: str | None
    gpu_free_min_mib: float | None
    gpu_free_min_gpu: str | None
    gpu_largest_jump_mib: float | None
    gpu_simulated: bool | None
    # capacity figures (stages._capacity_figures)
    goodput: Goodput | None  # None: the SLOs not given, goodput not computed
    arrival: ArrivalLag | None  # None: a closed-loop stage
    sessions_per_s: float | None  # the arrival rate offered; None: closed-loop
    search: str | None  # the plan's search stage this step belongs to; None: not a search step
    full_batch_scrapes: int | None
    full_batch_queued_scrapes: int | None
    full_batch_cap: int | None
    full_batch_cap_from: str | None
    past_capacity: bool | None
    replay: dict[str, Any] | None  # arrival_lag.replay_figures; None: not a replay stage
    problems: tuple[Breach, ...] = ()
    server_side_latency: tuple[ServerLatency, ...] | None = None  # None: the stream was not buffered
    latency_unjudged: tuple[str, ...] | None = None

    @classmethod
    def of(cls, **figures: Any) -> StageRow:
        """A row with only the figures a test cares about: the others empty, zero or unknown (None)."""
        brief: dict[str, Any] = {f.name: _BRIEF.get(f.name) for f in fields(cls) if f.default is MISSING}
        return cls(**(brief | figures))

    def to_dict(self) -> dict[str, Any]:
        """The row as the stage table carries it (verdict.json, the reports): byte for byte as before it was typed."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in OPTIONAL and value is None:
                continue
            if f.name in ("goodput", "arrival"):
                out |= value.to_dict() if value is not None else {}
            elif f.name == "error_rate_ci95":
                out[f.name] = list(value)
            elif f.name in ("problems", "server_side_latency"):
                out[f.name] = [item.to_dict() for item in value]
            elif f.name == "latency_unjudged":
                out[f.name] = list(value)
            else:
                out[f.name] = value
        return out
