"""A stage's row typed (analysis/pillars/headroom/stage_row.py): its one `to_dict()` is the stage table's dict as
verdict.json and the reports have always carried it: the same keys, in the same order, the same ones present."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from k3load.analysis.pillars.headroom.buffering import ServerLatency
from k3load.analysis.pillars.headroom.full_batch import engine_cap
from k3load.analysis.pillars.headroom.goodput import Slo
from k3load.analysis.pillars.headroom.gpu_growth import gpu_growth
from k3load.analysis.pillars.headroom.proxy_rejudge import proxy_judged
from k3load.analysis.pillars.headroom.stage_row import ArrivalLag, StageRow
from k3load.analysis.pillars.headroom.stages import stage_breaches, stage_stats
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS, rounded, thresholds
from k3load.analysis.pillars.rules import Breach
from k3load.analysis.run.down_spells import down_spells
from k3load.analysis.run.record_columns import RecordColumns
from k3load.analysis.run.rundata import load_run
from k3load.analysis.run.timeline import MetricIndex
from k3load.outcomes import Signal
from tests.unit.test_buffering import ITL, empty, histogram

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "data" / "scale-run"
JUDGED = ROOT / "tests" / "data" / "scale-run-judged" / "verdict.json"

# The stage table's keys in their order, as the dict-building code wrote them before the row was typed.
HEAD = ["stage", "kind", "users", "start_ts", "duration_s", "attempts", "errors", "error_rate", "error_rate_ci95",
        "error_rate_distinct_requests", "sent_while_down", "errors_by_layer", "error_kinds", "requests_per_s",
        "output_tokens_per_s", "max_prompt_tokens_ok", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "ttfa_p50_ms",
        "ttfa_p95_ms", "ttfa_p99_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p95_ms",
        "e2e_p99_ms", "kv_usage_mean", "kv_usage_max", "kv_usage_max_by_source", "waiting_max", "waiting_sustained_s",
        "running_max", "load_generator_cpu_max_pct", "load_generator_cpu_max_pct_by_process", "preemptions",
        "preemptions_per_min", "server_down_events", "health_flaps", "metrics_present", "gpu_memory_peak_mib",
        "gpu_headroom_min_pct", "gpu_baseline_headroom_min_pct", "gpu_growth_max_mib", "gpu_growth_max_pct",
        "gpu_growth_gpu", "gpu_free_min_mib", "gpu_free_min_gpu", "gpu_largest_jump_mib", "gpu_simulated"]
GOODPUT = ["goodput", "goodput_ci95", "goodput_requests", "goodput_good_requests", "goodput_sessions",
           "goodput_good_sessions", "session_goodput", "session_goodput_ci95", "goodput_requests_per_s",
           "goodput_output_tokens_per_s", "goodput_sessions_per_s", "goodput_misses"]
ARRIVAL = ["scheduled_turns", "late_turns", "late_share", "late_share_ci95", "send_lag_p50_ms", "send_lag_p95_ms",
           "send_lag_max_ms", "sessions_arrived"]
FULL_BATCH = ["full_batch_scrapes", "full_batch_queued_scrapes", "full_batch_cap", "full_batch_cap_from",
              "past_capacity"]


@pytest.fixture(scope="module")
def rows() -> list[StageRow]:
    data = load_run(RUN)
    index, limits = MetricIndex(data.metrics), thresholds(data.plan.thresholds if data.plan else None)
    spells = down_spells(data)
    growth, slo, cap = gpu_growth(data, spells), Slo.from_limits(limits), engine_cap(data.path)
    out = []
    for stage in data.stages:
        row = stage_stats(data, index, stage, spells, growth, slo, cap)
        out.append(replace(row, problems=tuple(stage_breaches(row, limits))))
    return out


def test_every_stage_of_the_stored_run_is_its_stored_row(rows: list[StageRow]) -> None:
    stored = json.loads(JUDGED.read_text())["pillars"]["resources"]["numbers"]["stages"]
    assert [r.stage for r in rows] == [s["stage"] for s in stored]
    for row, was in zip(rows, stored, strict=True):
        plain = row.to_dict()
        assert list(plain) == HEAD + GOODPUT + FULL_BATCH + ["problems"]
        assert json.loads(json.dumps(rounded(plain))) == was


def test_the_groups_measured_for_some_stages_only_are_present_only_there(rows: list[StageRow]) -> None:
    row = replace(rows[0], goodput=None)
    assert list(row.to_dict()) == HEAD + FULL_BATCH + ["problems"]
    lag = ArrivalLag(scheduled_turns=40, late_turns=5, late_share=0.125, late_share_ci95=[0.05, 0.26],
                     send_lag_p50_ms=10.0, send_lag_p95_ms=1500.0, send_lag_max_ms=2000.0, sessions_arrived=9)
    full = replace(rows[0], arrival=lag, sessions_per_s=0.5, search="find", replay={"rows_due": 3},
                   server_side_latency=(ServerLatency("slo.ttft_p95", "within", "fine"),),
                   latency_unjudged=("TTFA p95 not judged",))
    plain = full.to_dict()
    assert list(plain) == (HEAD + GOODPUT + ARRIVAL + ["sessions_per_s", "search"] + FULL_BATCH
                           + ["replay", "problems", "server_side_latency", "latency_unjudged"])
    assert plain["late_share_ci95"] == [0.05, 0.26] and plain["replay"] == {"rows_due": 3}
    assert plain["server_side_latency"] == [{"id": "slo.ttft_p95", "status": "within", "text": "fine"}]
    assert plain["latency_unjudged"] == ["TTFA p95 not judged"]


def test_a_rows_problems_are_typed_breaches_and_plain_data_in_its_dict(rows: list[StageRow]) -> None:
    over = Breach("resources.kv_usage", Signal.RESOURCE, 0.99, 0.95, "KV", ("metrics.jsonl stage=load",))
    row = replace(rows[1], problems=(over,))
    assert all(isinstance(p, Breach) for p in row.problems)
    (plain,) = row.to_dict()["problems"]
    assert plain == over.to_dict() and type(plain["signal"]) is str
    assert type(row.to_dict()["error_rate_ci95"]) is list and isinstance(row.error_rate_ci95, tuple)


@pytest.mark.parametrize("waiting_s", [0.0, 30.0])
def test_a_buffered_streams_rows_are_rejudged_as_the_plain_rows_were(rows: list[StageRow], waiting_s: float) -> None:
    """The re-judging on the server's histograms keeps the row's keys in their order, adds the server's judgments
    last, and keeps the stage's other breaches first (as the plain re-judging did, key for key)."""
    limits = {"slo": {**DEFAULT_THRESHOLDS["slo"], "ttft_p95_ms": 40.0, "itl_p95_ms": 40.0}}
    index = MetricIndex([empty(99.0), empty(99.0, ITL), histogram(199.0, [0, 50, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
                         histogram(199.0, [0, 0, 0, 0, 0, 0, 40, 0, 0, 0, 0], ITL)])
    latency = [Breach(rule, Signal.LATENCY, 90.0, 40.0, f"{rule} over (client)", ("records.jsonl stage=load",))
               for rule in ("slo.ttft_p95", "slo.itl_p95", "slo.ttfa_p95")]
    kv = Breach("resources.kv_usage", Signal.RESOURCE, 0.99, 0.95, "KV", ())
    row = replace(rows[1], start_ts=100.0, duration_s=100.0, waiting_sustained_s=waiting_s,
                  problems=(latency[0], kv, *latency[1:]))
    judged = proxy_judged(row, index, limits)
    plain = judged.to_dict()
    assert list(plain) == [*row.to_dict(), "server_side_latency", "latency_unjudged"]
    assert {k: v for k, v in plain.items() if k not in ("problems", "server_side_latency", "latency_unjudged")} \
        == {k: v for k, v in row.to_dict().items() if k != "problems"}
    assert plain["problems"][0] == kv.to_dict() and plain["problems"][1]["evidence"] == ["metrics.jsonl stage=load"]
    assert [p.id for p in judged.problems] == ["resources.kv_usage", "slo.itl_p95"]
    assert [s.status for s in judged.server_side_latency or ()] == ["within", "over", "unjudged"]
    untouched = replace(rows[1], problems=(kv,))
    assert proxy_judged(untouched, index, limits) is untouched


def test_a_steps_sessions_are_its_first_turns_whenever_they_ended() -> None:
    """The sessions an open-loop step started (what the live search counts at its decision, from its schedule): its
    first turns sent by the decision, a drill's included and a first turn still answering at the decision too; a
    session that began in an earlier step and goes on in this one, a retry, a stream pair's whole twin, a
    closed-loop turn, one sent after the decision are not."""
    from k3load.analysis.pillars.headroom.arrival_lag import sessions_started

    def row(stage: str = "s1", turn: int = 0, attempt: int = 1, drill: bool = False, role: str | None = None,
            intended: float | None = 10.0, end: float = 11.0, sent: float = 10.0) -> dict:
        return {"stage": stage, "turn": turn, "attempt": attempt, "drill": drill, "stream_role": role,
                "intended_send_ts": intended, "end_ts": end, "send_ts": sent}

    rows = [row(), row(drill=True), row(end=99.0),  # started: 3 (one answered after the decision at 20)
            row(turn=1), row(attempt=2), row(role="whole"), row(intended=None), row(stage="s2"),
            row(sent=20.5)]  # sent after the decision, before the users moved on: not counted by the search
    assert sessions_started(RecordColumns.of(rows).rows("s1"), 20.0) == 3
    assert sessions_started(RecordColumns().rows(), 20.0) == 0


def test_a_step_whose_first_answers_all_ended_after_its_decision_still_says_its_sessions() -> None:
    """No scheduled turn of the step ended by its decision (answers slower than the step): the sessions it started
    are still said, never read as none (which would call it short of its rate)."""
    from k3load.analysis.pillars.headroom.arrival_lag import arrival_lag

    nothing = RecordColumns.of([{"send_ts": 1.0, "intended_send_ts": None}]).rows()  # a closed-loop turn only
    said = arrival_lag(nothing, started=12)
    assert said["sessions_arrived"] == 12 and said["scheduled_turns"] == 0 and said["late_share"] is None
    assert ArrivalLag(**said).sessions_arrived == 12
    assert arrival_lag(nothing) == {} and arrival_lag(RecordColumns().rows(), started=3)["sessions_arrived"] == 3
