"""The agreement maths of `k3load diff` and `--k3-reference` on hand-built records (no sockets).

Why hand-built: the counts are known, so precision, recall, F1 and their intervals can be checked
against numbers worked out by hand and against published examples (Newcombe 1998 for the difference of
two proportions; the classic order-statistic interval of a median). The runs themselves are in
tests/sim/test_diff.py.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3load.analysis.diff import (
    CPU_WAIT,
    MEASURES,
    _figure,
    _stage_rules,
    changed,
    compare_stages,
    design_effect,
    poisson_interval,
    quantile_interval,
    spread_factor,
)
from k3load.analysis.pillars.agent.agreement import (
    REFERENCE_FILE,
    ReferenceRunError,
    agreement,
    drop,
    f1_interval,
    profile,
    read_reference,
    reference_record,
    reference_rules,
)
from k3load.analysis.pillars.pillar import percentile, thresholds
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.rundata import columns_of
from k3load.analysis.run.stats import wilson
from k3load.records import Attempt, Finding
from k3load.sim.config import FaultProfile
from k3load.sim.faults import FaultDecision, apply_to_plan, decide
from k3load.sim.generate import OutputPlan, Piece

CALL = [{"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]


def attempt(scenario: str, turn: int, called: bool, *, status: str = "ok", drill: bool = False,
            names: list[str] | None = None, bad_schema: bool = False, json_ok: bool | None = None,
            layer: str | None = None) -> Attempt:
    calls = [{**CALL[0], "function": {"name": n, "arguments": "{}"}} for n in names] if names else CALL
    findings = [Finding("tool_call.arguments_schema", not bad_schema, "model_output" if bad_schema else None)]
    if json_ok is not None:
        findings.append(Finding("expect.json", json_ok, None if json_ok else "model_output"))
    return Attempt(run_id="r", attempt_id=str(random.random()), chain_id="c", attempt=1, stage="load",
                   scenario=scenario, family="agent", turn=turn, turn_kind="tool_call", user_id="u",
                   request_sha256=f"x{random.random()}", prefix_sha256="p", transport="t", status=status,
                   send_ts=0.0, end_ts=1.0,
                   finish_reason=("tool_calls" if called else "stop") if status == "ok" else None,
                   tool_calls=calls if called and status == "ok" else [], findings=findings, primary_layer=layer,
                   drill=drill)


def rows_of(attempts: list[Attempt]) -> Rows:
    """The attempts as the agreement reads a run: its record columns."""
    return columns_of(attempts).rows()


def times(n: int, *args: Any, **kw: Any) -> list[Attempt]:
    """n answers alike, each its own attempt and request."""
    return [attempt(*args, **kw) for _ in range(n)]


def reference_attempts() -> list[Attempt]:
    """s#0: 3 of 4 called (label tool_call); s#1: 0 of 3 (label answer); s#2: 1 of 2 (no label); a timeout
    and a drill that say nothing about the model's choice."""
    return ([attempt("s", 0, True)] * 3 + [attempt("s", 0, False)] + [attempt("s", 1, False, json_ok=True)] * 3
            + [attempt("s", 2, True), attempt("s", 2, False), attempt("s", 0, False, status="timeout"),
               attempt("s", 1, True, drill=True)])


def test_profile_labels_each_turn_by_the_reference_majority():
    found = profile(rows_of(reference_attempts()))
    turns = {(t["scenario"], t["turn"]): t for t in found["turns"]}
    assert found["answers"] == 9  # the timeout and the drill left out
    assert (turns[("s", 0)]["label"], turns[("s", 0)]["triggered"], turns[("s", 0)]["answers"]) == ("tool_call", 3, 4)
    assert turns[("s", 0)]["tool_names"] == ["get_weather"]
    assert turns[("s", 1)]["label"] == "answer" and turns[("s", 2)]["label"] is None  # an even split: no label
    assert found["schema"] == {"k": 4, "n": 4} and found["structured_output"] == {"k": 3, "n": 3}
    assert found["finish_reasons"] == {"stop": 5, "tool_calls": 4}
    json.dumps(found)  # reference.json keeps it as it is


def test_trigger_precision_recall_f1_and_their_intervals():
    # each answer its own request (the run's intervals are over distinct requests)
    run = (times(6, "s", 0, True) + times(4, "s", 0, False, layer="model_output")  # tp 6, fn 4
           + [attempt("s", 1, True, names=["other"])] + times(9, "s", 1, False)  # fp 1, tn 9
           + times(5, "s", 2, True) + [attempt("t", 0, True)])  # no label, never answered: not comparable
    n = agreement(profile(rows_of(reference_attempts())), rows_of(run))
    trig = n["trigger"]
    assert (trig["tp"], trig["fp"], trig["fn"], trig["tn"]) == (6, 1, 4, 9)
    assert n["comparable"] == 20 and n["not_comparable"] == 6
    assert trig["precision"]["rate"] == pytest.approx(6 / 7) and trig["recall"]["rate"] == pytest.approx(0.6)
    assert trig["f1"] == pytest.approx(2 * 6 / (2 * 6 + 1 + 4))
    j = wilson(6, 11)  # F1 = 2J / (1 + J), J = TP / (TP + FP + FN): the interval maps through
    assert trig["f1_ci95"] == pytest.approx([2 * j.low / (1 + j.low), 2 * j.high / (1 + j.high)])
    assert trig["f1_ci95"][0] < trig["f1"] < trig["f1_ci95"][1]
    assert n["tool_name_agreement"]["k"] == 6 == n["tool_name_agreement"]["n"]  # the fp is not a name check
    assert n["disagreeing_by_layer"] == {"model_output": 5}
    rows = {(r["scenario"], r["turn"]): r for r in n["by_turn"]}
    assert rows[("s", 0)]["recall"]["rate"] == pytest.approx(0.6) and rows[("s", 1)]["recall"] is None
    assert f1_interval(0, 0, 0) == (None, None)  # nobody called a tool: F1 undefined, never 0 or 1


def test_newcombe_difference_and_order_statistic_intervals_match_published_examples():
    value, (low, high) = drop(wilson(56, 70), wilson(48, 80))  # Newcombe (1998), method 10: 0.0524 to 0.3339
    assert value == pytest.approx(0.2) and (round(low, 4), round(high, 4)) == (0.0524, 0.3339)
    assert drop(wilson(0, 0), wilson(3, 4)) == (None, None)
    assert quantile_interval([float(x) for x in range(1, 101)], 0.5) == (40.0, 61.0)  # x(40)..x(61), n = 100
    assert quantile_interval([1.0], 0.5) is None
    low, high = poisson_interval(100, 10.0)
    assert low < 10.0 < high and high - low == pytest.approx(2 * 1.96 * (100 + 1.96 ** 2 / 4) ** 0.5 / 10, rel=1e-3)
    a, b = {"value": 1.0, "ci95": [0.9, 1.1]}, {"value": 1.5, "ci95": [1.2, 1.8]}
    assert changed(a, b) == "higher" and changed(b, a) == "lower" and changed(a, a) is None
    assert changed(a, b, 0.25) == "higher" and changed(a, b, 0.6) is None  # a 50% move: flagged only past 25%
    # CI's healthy pair on the sim: TTFT p50 3.96 -> 5.16 ms, intervals apart, +30%: jitter, not a regression
    fast, slower = {"value": 3.96, "ci95": [3.79, 4.13]}, {"value": 5.16, "ci95": [4.87, 5.64]}
    assert changed(fast, slower, 0.25) == "higher" and changed(fast, slower, 0.25, 5.0) is None
    assert changed({"value": 40.0, "ci95": [38, 42]}, {"value": 52.0, "ci95": [50, 54]}, 0.25, 5.0) == "higher"


@given(st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 5)), min_size=1, max_size=60), st.floats(0.5, 600))
def test_a_rate_interval_is_the_count_interval_widened_by_how_its_sessions_cluster(items, duration):
    """Single answers of equal size: the count's interval times the size (what the diff gave before); any
    spread, of sizes or of answers into sessions, only widens it around the same centre, never narrows it."""
    values = np.array([float(v) for v, _ in items])
    sessions = np.array([g for _, g in items])
    total, n = float(values.sum()), len(values)
    factor = spread_factor(values, sessions)
    assert (factor >= 1.0 - 1e-9 and spread_factor(values, np.arange(n)) <= factor + 1e-9) or total == 0
    low, high = poisson_interval(n, duration, factor, total / n)
    plain_low, plain_high = poisson_interval(n, duration)
    assert low <= total / duration <= high or total == 0 == low == high
    assert low <= plain_low * total / n * (1 + 1e-9) and high >= plain_high * total / n * (1 - 1e-9)
    equal = np.full(n, 7.0)
    assert spread_factor(equal, np.arange(n)) == pytest.approx(1.0)
    assert spread_factor(np.ones(n), np.zeros(n, dtype=int)) == pytest.approx(math.sqrt(n))  # one session: n wide


def test_the_sessions_of_a_short_step_widen_its_rate_to_what_they_tell():
    """CI's healthy pair (stop 46), c2 of A and B: 34 answers in 13 sessions against 63 in 13, over 2 s. As
    independent answers the intervals lay apart; by sessions they overlap."""
    a = np.repeat(np.arange(13), [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 5, 7])
    b = np.repeat(np.arange(13), [1, 2, 3, 5, 5, 5, 5, 5, 5, 6, 6, 7, 8])
    assert poisson_interval(len(a), 2.0)[1] < poisson_interval(len(b), 2.0)[0]
    wide_a = poisson_interval(len(a), 2.0, spread_factor(np.ones(len(a)), a))
    wide_b = poisson_interval(len(b), 2.0, spread_factor(np.ones(len(b)), b))
    assert wide_a[1] > wide_b[0] and changed(_figure(17.0, wide_a), _figure(31.5, wide_b), 0.5) is None
    assert spread_factor(np.array([]), np.array([], dtype=int)) == 1.0
    assert poisson_interval(36, 0.0) is None and poisson_interval(3, 2.0, 1.0, 0.0) == (0.0, 0.0)


@given(st.lists(st.tuples(st.floats(0, 1e4, allow_nan=False), st.integers(0, 6)), min_size=2, max_size=80),
       st.sampled_from([0.5, 0.95]))
def test_a_latency_interval_widens_by_how_its_send_windows_cluster_and_only_then(items, q):
    """Never narrower than the interval of independent draws, which it is exactly where every value has a
    window of its own; it holds the percentile."""
    values = [v for v, _ in items]
    windows = np.array([w for _, w in items])
    plain = quantile_interval(values, q)
    assert quantile_interval(values, q, np.arange(len(values))) == plain
    assert design_effect(np.array(values), percentile(values, q), np.arange(len(values))) == pytest.approx(1.0)
    low, high = quantile_interval(values, q, windows)
    assert low <= plain[0] and high >= plain[1] and low <= percentile(values, q) <= high


# CI's healthy pair (stop 47), the 2-s c6 step of A and of B on the same sim: (TTFT ms, send window of a median answer)
C6_A = [(31.3, 0), (32.9, 0), (31.9, 0), (11.7, 0), (24.5, 0), (18.2, 0), (11.3, 1), (10.2, 1), (15.4, 1),
    (9.0, 1), (12.1, 3), (28.8, 2), (24.3, 2), (13.8, 3), (17.5, 3), (17.6, 3), (16.0, 3), (11.9, 3), (14.2, 4),
    (11.0, 4), (18.5, 5), (21.8, 5), (16.5, 5), (22.8, 5), (14.4, 5), (8.5, 6), (8.2, 6), (5.2, 6), (21.4, 6),
    (8.1, 7), (8.8, 7), (10.1, 8), (11.3, 7), (10.0, 8), (20.5, 8), (4.2, 8), (12.9, 8), (4.7, 9), (6.3, 9),
    (5.7, 9), (6.2, 9), (8.9, 9), (6.4, 9), (15.0, 10), (14.7, 10), (18.9, 10), (7.0, 10), (6.0, 11), (6.6, 11),
    (11.5, 11), (8.9, 11), (8.8, 11), (12.1, 12), (5.6, 12), (10.3, 13), (5.9, 12), (15.7, 13), (15.1, 13),
    (10.3, 13), (9.9, 13), (7.1, 14), (8.9, 14), (6.9, 14), (9.2, 14), (9.6, 14), (8.5, 14), (4.7, 14), (5.3, 15),
    (4.7, 14), (4.1, 14), (11.5, 15), (6.8, 15), (5.9, 15), (10.7, 15), (13.7, 15), (12.0, 16), (15.2, 15),
    (9.5, 16), (12.3, 16)]
C6_B = [(30.3, 0), (32.2, 0), (8.8, 0), (8.3, 0), (8.6, 0), (6.9, 0), (40.2, 1), (13.8, 1), (10.2, 1), (12.5, 1),
    (8.6, 2), (9.0, 2), (7.6, 3), (7.5, 3), (7.9, 3), (86.0, 4), (70.4, 4), (65.8, 4), (42.0, 4), (42.4, 4),
    (42.7, 4), (10.7, 5), (18.9, 5), (11.3, 6), (14.9, 6), (8.1, 6), (6.1, 7), (8.5, 7), (9.1, 7), (9.4, 7),
    (10.4, 7), (11.5, 7), (11.6, 8), (12.2, 8), (10.4, 8), (18.9, 8), (9.4, 7), (10.7, 8), (4.9, 8), (11.4, 8),
    (15.1, 9), (7.1, 9), (6.4, 9), (33.5, 9), (29.7, 9), (11.0, 10), (4.9, 9), (29.8, 9), (8.1, 10), (11.3, 10),
    (14.2, 11), (11.4, 12), (15.9, 11), (23.7, 12), (25.2, 12), (11.4, 12), (14.2, 13), (29.0, 13), (15.4, 13),
    (15.5, 13), (15.1, 13), (16.2, 14), (7.5, 14), (13.4, 14), (13.0, 14), (6.0, 16)]


def test_a_hiccup_that_slows_one_send_window_widens_the_p95_of_a_short_step():
    """B's six slow TTFTs (42-86 ms) were sent within 90 ms, one window: as independent draws the two p95
    intervals lay apart and the diff said B's TTFT p95 was higher beyond noise; by windows they overlap."""
    (a, wa), (b, wb) = (([v for v, _ in pairs], np.array([w for _, w in pairs])) for pairs in (C6_A, C6_B))
    assert quantile_interval(b, 0.95)[0] > quantile_interval(a, 0.95)[1]
    assert quantile_interval(b, 0.95, wb)[0] <= quantile_interval(a, 0.95, wa)[1]
    assert design_effect(np.array(b), percentile(b, 0.95), wb) > 2
    assert changed(_figure(percentile(a, 0.95), quantile_interval(a, 0.95, wa)),
                   _figure(percentile(b, 0.95), quantile_interval(b, 0.95, wb)), 0.5, 5.0) is None


def _stage(rps: float, wait: float | None) -> dict[str, Any]:
    """One stage's figures: every measure at `rps` with a tight interval, the load generator's wait."""
    return {"answers": 100, CPU_WAIT: wait, **{m: {"value": rps, "ci95": [rps * 0.95, rps * 1.05]} for m in MEASURES}}


def test_a_stage_whose_load_generator_waited_for_a_cpu_is_shown_but_not_judged():
    """B halved beyond noise and margin: fails when both load generators had their CPU, inconclusive (flags
    empty, one rule naming whose wait and how much) when either waited more than the limit; unknown wait (a run
    recorded before the meter) judges as before."""
    limits = {**thresholds(None)["diff"], "min_latency_change_ms": 0.0}
    most = limits["max_load_generator_cpu_wait"]
    for wait_a, wait_b, starved in ((5.0, 7.0, False), (None, None, False), (4.0, None, False),
                                    (5.0, most * 100 + 0.1, True), (60.0, None, True)):
        rows = compare_stages({"s": _stage(100.0, wait_a)}, {"s": _stage(50.0, wait_b)}, 0.25, 0.0, most)
        (row,) = rows
        assert row[CPU_WAIT] == {"a": wait_a, "b": wait_b}
        flags = {f["changed_beyond_noise"] for f in row["measures"].values()}
        rules = _stage_rules(rows, limits)
        if starved:
            assert flags == {None} and [r.status for r in rules] == ["inconclusive"]
            (rule,) = rules
            assert rule.id == "diff.stage.s" and "short of CPU" in rule.reason and rule.limit == most * 100
            assert rule.measured == max(w for w in (wait_a, wait_b) if w is not None)
            assert f"{max(w for w in (wait_a, wait_b) if w is not None):g}%" in rule.reason
        else:
            assert flags == {"lower"} and row["starved"] is None
            assert {r.status for r in rules if ".throughput." in r.id} == {"fail"}


def test_reference_rules_fail_on_skipped_calls_and_are_inconclusive_on_too_little():
    record = {"run_id": "ref-1", "manifest_sha256": "ab" * 32, "path": "/r",
              "profile": profile(rows_of(reference_attempts()))}
    limits = thresholds(None)["agent_api"]
    skipping = times(10, "s", 0, True) + times(20, "s", 0, False) + times(10, "s", 1, False)
    numbers, rules = reference_rules(record, rows_of(skipping), limits)
    by_id = {r.id: r for r in rules}
    assert numbers["run_id"] == "ref-1" and by_id["agent.reference_trigger_f1"].status == "fail"
    assert by_id["agent.reference_trigger_f1"].reason.startswith("model_output: against reference ref-1: trigger F1")
    assert by_id["agent.reference_schema_accuracy"].status in ("pass", "inconclusive")
    _, few = reference_rules(record, rows_of(skipping[:5]), limits)
    assert [(r.id, r.status) for r in few] == [("agent.reference_agreement", "inconclusive")]
    assert "inconclusive, because only 5 answers were comparable" in few[0].reason


def test_reference_record_refuses_what_cannot_be_named(tmp_path: Path):
    with pytest.raises(ReferenceRunError, match="not a directory"):
        reference_record(tmp_path / "missing")
    (tmp_path / "records.jsonl").write_text(attempt("s", 0, True).to_json() + "\n")
    (tmp_path / "run.json").write_text('{"run_id": "ref-2"}')
    with pytest.raises(ReferenceRunError, match=r"missing manifest\.sha256"):
        reference_record(tmp_path)
    (tmp_path / "manifest.sha256").write_text("00  records.jsonl\n")
    record = reference_record(tmp_path)
    assert record["run_id"] == "ref-2" and len(record["manifest_sha256"]) == 64
    run = tmp_path / "run"
    run.mkdir()
    assert read_reference(run) is None
    (run / REFERENCE_FILE).write_text("{not json")
    problems: list[str] = []
    assert read_reference(run, problems) is None and problems == ["reference.json: unreadable, the reference was "
                                                                  "not judged"]


def test_sim_skip_tool_call_draws_last_and_answers_in_prose():
    """Profiles without the fault draw exactly as before; with it, a call becomes prose (finish stop)."""
    base, skip = FaultProfile(http_error_rate=0.3), FaultProfile(http_error_rate=0.3, skip_tool_call_rate=1.0)
    for seed in range(5):
        plain, with_skip = decide(base, random.Random(seed), 1.0), decide(skip, random.Random(seed), 1.0)
        assert plain.http_error == with_skip.http_error and not plain.skip_tool_call and with_skip.skip_tool_call
    plan = OutputPlan([Piece("reasoning", "hm"), Piece("tool_whole", "{}"), Piece("none")], "tool_calls",
                      [{"id": "functions.f:0", "name": "f", "arguments": "{}"}])
    prose = apply_to_plan(plan, FaultDecision(skip_tool_call=True))
    assert prose.finish_reason == "stop" and prose.tool_calls == []
    assert {p.kind for p in prose.pieces} == {"reasoning", "content"}
    answer = OutputPlan([Piece("content", "hi"), Piece("content", "")], "stop")
    assert apply_to_plan(answer, FaultDecision(skip_tool_call=True)) == answer  # nothing to skip


def test_plans_carry_the_diff_and_reference_thresholds_and_reject_unknown_ones():
    from k3load.workload.plan import PlanError, parse_plan

    stages = [{"name": "load", "kind": "load", "duration_s": 1, "users": 1, "mix": {"agent": 1}}]
    plan = parse_plan({"name": "p", "stages": stages, "thresholds": {
        "diff": {"min_trigger_f1": 0.8, "max_latency_p95_increase": 1.0, "min_latency_change_ms": 2},
        "agent_api": {"min_reference_trigger_f1": 0.95, "min_reference_attempts": 50}}}, "p.yaml", "")
    limits = thresholds(plan.thresholds)
    assert limits["diff"]["min_trigger_f1"] == 0.8 and limits["diff"]["max_throughput_drop"] == 0.3
    assert limits["diff"]["min_latency_change_ms"] == 2 and thresholds(None)["diff"]["min_latency_change_ms"] == 5.0
    assert limits["agent_api"]["min_reference_trigger_f1"] == 0.95
    with pytest.raises(PlanError, match="min_trigger_recall"):
        parse_plan({"name": "p", "stages": stages, "thresholds": {"diff": {"min_trigger_recall": 0.9}}}, "p.yaml", "")
