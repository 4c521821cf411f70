"""Kimi's known tool-calling failures, judged on hand-made answers (no sockets): the streaming-equivalence
comparison, parallel-call expectations, repeated ids, answers left in the reasoning, tool-call silences
and stalls, and the agent pillar's rules over them (rates with intervals, per stage, one layer each)."""

from __future__ import annotations

import json
from pathlib import Path

from k3load.analysis.pillars.agent.pillar_agent import judge_agent_api
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
from k3load.client.result import StreamResult, ToolCall
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.records import Attempt, Finding
from k3load.workload.plan import parse_plan
from k3load.workload.scenario import parse_scenario
from k3load.workload.stream_equivalence import BOTH_VALID, NOT_COMPARED, SAME, VALUES_WRONG, WHOLE_WRONG, compare_twins
from k3load.workload.validate import primary_layer, validate

LIMITS = DEFAULT_THRESHOLDS["agent_api"]
WEATHER = {"type": "function", "function": {"name": "get_current_weather", "parameters": {
    "type": "object", "required": ["location"], "properties": {"location": {"type": "string"}}}}}
RIDE = {"type": "function", "function": {"name": "uber.ride", "parameters": {
    "type": "object", "required": ["loc"], "properties": {"loc": {"type": "string"}}}}}
SCENARIO = parse_scenario({
    "name": "parallel", "family": "agent", "system_prompt": "s", "tools": [WEATHER, RIDE],
    "executors": {"get_current_weather": {"default": {"t": 1}}, "uber.ride": {"default": {"ok": True}}},
    "turns": [
        {"user": "weather in Boston and in San Francisco", "parallel_tool_calls": True,
         "expect": {"kind": "tool_call", "tools": ["get_current_weather"],
                    "calls": ["get_current_weather", "get_current_weather"]},
         "reply": {"tool_calls": [{"name": "get_current_weather", "arguments": {"location": "Boston, MA"}},
                                  {"name": "get_current_weather", "arguments": {"location": "San Francisco, CA"}}]}},
        {"expect": {"kind": "answer"}}]}, Path("parallel.yaml"))
CALL_TURN, ANSWER_TURN = SCENARIO.turns


def _call(index: int, location: str, call_id: str | None = None, name: str = "get_current_weather") -> ToolCall:
    return ToolCall(index, call_id or f"functions.{name}:{index}", name, json.dumps({"location": location}))


def _result(calls: list[ToolCall] | None = None, finish: str | None = "tool_calls", status: str = "ok",
            **kw) -> StreamResult:
    return StreamResult(status=status, transport="t", send_ts=0.0, end_ts=1.0, tool_calls=calls or [],
                        finish_reason=finish, **kw)


TWO = [_call(0, "Boston, MA"), _call(1, "San Francisco, CA")]


def _failed(findings: list[Finding]) -> dict[str, str | None]:
    return {f.check: f.layer for f in findings if not f.ok}


# -- one answer ------------------------------------------------------------------------------------
def test_parallel_calls_pass_in_any_order_and_a_short_answer_names_what_is_missing():
    assert not _failed(validate(_result(list(reversed(TWO))), SCENARIO, CALL_TURN))
    short = validate(_result(TWO[:1]), SCENARIO, CALL_TURN)
    assert _failed(short) == {"expect.calls": "model_output"}
    detail = next(f.detail for f in short if f.check == "expect.calls")
    assert "1 calls" in detail and "missing ['get_current_weather']" in detail
    extra = validate(_result([*TWO, _call(2, "Paris")]), SCENARIO, CALL_TURN)
    assert "extra" in next(f.detail for f in extra if f.check == "expect.calls")


def test_a_call_emitted_twice_with_one_id_is_the_parsers():
    duplicated = [*TWO, _call(2, "Boston, MA", call_id=TWO[0].id)]
    findings = validate(_result(duplicated), SCENARIO, CALL_TURN)
    assert _failed(findings)["tool_call.unique_ids"] == "parser"
    assert primary_layer(findings) == "parser"  # the extra call is the parser's doing, not the model's


def test_merged_arguments_are_the_parsers():
    merged = [ToolCall(0, "functions.get_current_weather:0", "get_current_weather",
                       '{"location":"Boston, MA"}{"location":"San Francisco, CA"}')]
    findings = validate(_result(merged), SCENARIO, CALL_TURN)
    assert primary_layer(findings) == "parser" and "tool_call.arguments_json" in _failed(findings)


def test_an_answer_left_in_the_reasoning_is_the_parsers_only_with_the_markup_in_it():
    swallowed = _result(finish="stop", reasoning="Let me check. <|tool_calls_section_begin|><|tool_call_begin|>"
                        "functions.get_current_weather:0<|tool_call_argument_begin|>{}")
    findings = validate(swallowed, SCENARIO, CALL_TURN)
    assert _failed(findings)["reasoning.no_transition"] == "parser" and primary_layer(findings) == "parser"
    assert "vllm#53246" in next(f.detail for f in findings if f.check == "reasoning.no_transition")
    thought_only = validate(_result(finish="stop", reasoning="Let me think about the weather."), SCENARIO, CALL_TURN)
    assert _failed(thought_only)["reasoning.no_transition"] == "model_output"
    assert primary_layer(thought_only) == "model_output"
    answered = validate(_result(finish="stop", reasoning="thinking", content="It is sunny."), SCENARIO, ANSWER_TURN)
    assert not _failed(answered)


def test_a_silence_inside_a_tool_call_past_the_limit_is_a_finding_of_its_own():
    timing = {"tool_call_max_gap_ms": 45_000.0, "tool_call_deltas": 1, "last_silence_ms": 5.0}
    findings = validate(_result(TWO), SCENARIO, CALL_TURN, timing, max_tool_call_gap_ms=30_000)
    assert _failed(findings) == {"tool_call.cadence": "parser"}
    assert "45.0 s" in next(f.detail for f in findings if f.check == "tool_call.cadence")
    calm = {"tool_call_max_gap_ms": 120.0, "tool_call_deltas": 1}
    assert not _failed(validate(_result(TWO), SCENARIO, CALL_TURN, calm, max_tool_call_gap_ms=30_000))


def test_silences_as_long_outside_the_call_are_a_buffering_proxys_not_the_parsers():
    """A proxy that flushes the stream in lumps: reasoning chunks 40 s apart as well as the call's."""
    lumps = _result(TWO, chunk_ts=[1.0, 41.0, 81.0], tool_chunk_idx=[2], first_event_ts=1.0)
    timing = {"tool_call_max_gap_ms": 40_000.0, "tool_call_deltas": 1}
    findings = validate(lumps, SCENARIO, CALL_TURN, timing, max_tool_call_gap_ms=30_000)
    assert _failed(findings) == {"tool_call.cadence": "gateway"}
    assert "buffering proxy" in next(f.detail for f in findings if f.check == "tool_call.cadence")
    held = _result(TWO, chunk_ts=[1.0, 1.05, 41.0], tool_chunk_idx=[2], first_event_ts=1.0)  # only the call waited
    assert _failed(validate(held, SCENARIO, CALL_TURN, timing, max_tool_call_gap_ms=30_000)) == \
        {"tool_call.cadence": "parser"}


def test_a_stall_cut_by_our_deadline_is_told_apart_from_a_short_deadline():
    stalled = _result(status="timeout", finish=None, first_event_ts=0.2, chunk_ts=[0.2, 0.3])
    long_silence = {"last_silence_ms": 40_000.0}
    findings = validate(stalled, SCENARIO, CALL_TURN, long_silence, max_tool_call_gap_ms=30_000)
    assert _failed(findings) == {"stream.stall": "parser"}  # a tool turn: a call held back looks like this
    assert _failed(validate(stalled, SCENARIO, ANSWER_TURN, long_silence, 30_000)) == {"stream.stall": "server"}
    # a drill's short first deadline: the silence is at most the deadline, under the limit: our timeout
    short = validate(stalled, SCENARIO, CALL_TURN, {"last_silence_ms": 80.0}, max_tool_call_gap_ms=30_000)
    assert _failed(short) == {"transport": "client"}
    # nothing came at all (a queue, a prefill): not a stall inside an answer
    queued = _result(status="timeout", finish=None)
    assert _failed(validate(queued, SCENARIO, CALL_TURN, long_silence, 30_000)) == {"transport": "client"}


# -- two answers to one request ---------------------------------------------------------------------
def _judged(result: StreamResult) -> list[Finding]:
    return validate(result, SCENARIO, CALL_TURN)


def test_twins_compared():
    whole = _result(TWO)
    same = compare_twins(_result(TWO), _judged(_result(TWO)), whole, _judged(whole))
    assert same.ok and same.detail == SAME
    dropped = _result(TWO[:1])
    lost = compare_twins(dropped, _judged(dropped), whole, _judged(whole))
    assert not lost.ok and lost.layer == "parser" and "vllm#54701" in lost.detail
    empty = _result([])  # finish_reason tool_calls, no calls: what #54701 streams
    assert compare_twins(empty, _judged(empty), whole, _judged(whole)).layer == "parser"


def test_twins_that_differ_as_a_model_can_are_not_the_parsers():
    whole = _result(TWO)
    other = _result([_call(0, "Boston"), _call(1, "SF")])
    assert compare_twins(other, _judged(other), whole, _judged(whole)).detail == BOTH_VALID
    bad_value = _result([ToolCall(0, "functions.get_current_weather:0", "get_current_weather", '{"location": 3}'),
                         TWO[1]])
    judged = _judged(bad_value)
    assert primary_layer(judged) == "model_output"
    assert compare_twins(bad_value, judged, whole, _judged(whole)).detail == VALUES_WRONG
    assert compare_twins(whole, _judged(whole), bad_value, judged).detail == WHOLE_WRONG
    cut = _result(TWO, status="truncated")
    assert compare_twins(cut, _judged(cut), whole, _judged(whole)).detail == NOT_COMPARED


# -- the pillar --------------------------------------------------------------------------------------
PLAN = parse_plan({"name": "p", "stream_equivalence": {"share": 1.0}, "stages": [
    {"name": "load", "kind": "load", "duration_s": 5, "users": 2, "mix": {"agent": 1}},
    {"name": "conc", "kind": "concurrency", "duration_s": 5, "steps": [4, 12], "mix": {"agent": 1}}]}, "p")


def _attempt(i: int, stage: str, findings: list[Finding], **kw) -> Attempt:
    failed = [f for f in findings if not f.ok]
    return Attempt(run_id="r", attempt_id=f"a{i}", chain_id=f"c{i}", attempt=1, stage=stage, scenario="parallel",
                   family="agent", turn=0, turn_kind="tool_call", user_id="u", request_sha256=f"q{i}",
                   prefix_sha256="p", transport="t", status="ok", send_ts=float(i), end_ts=i + 0.5,
                   findings=findings, valid=not failed, primary_layer=primary_layer(findings), **kw)


def _pairs(stage: str, good: int, lost: int, start: int) -> list[Attempt]:
    out = []
    for i in range(good + lost):
        ok = i < good
        compared = Finding("stream.equivalence", True, None, SAME) if ok else \
            Finding("stream.equivalence", False, "parser", "the streamed answer is wrong ...")
        stream = [Finding("transport", True), compared] + ([] if ok else [
            Finding("tool_call.present", False, "parser", "finish_reason tool_calls with no tool_calls")])
        pair = f"{stage}-{i}"
        out += [_attempt(start + 2 * i, stage, stream, stream_pair=pair, stream_role="stream"),
                _attempt(start + 2 * i + 1, stage, [Finding("transport", True)], stream_pair=pair,
                         stream_role="whole", stream=False)]
    return out


def test_the_streaming_path_failing_only_under_concurrency_is_named_per_stage():
    attempts = _pairs("load", 20, 0, 0) + _pairs("conc-c4", 20, 0, 100) + _pairs("conc-c12", 14, 6, 200)
    result = judge_agent_api(attempts, LIMITS, PLAN)
    assert result.status == FAIL
    reason = next(r for r in result.reasons if r.startswith("parser (streaming path)"))
    assert "6 of 60" in reason and "conc-c12 (12 users) 6 of 20" in reason and "load (2 users) 0 of 20" in reason
    by_stage = result.numbers["stream_equivalence"]["by_stage"]
    assert by_stage["conc-c12"]["stream_path_failure_rate"]["k"] == 6
    assert by_stage["conc-c12"]["stream_path_failure_rate"]["ci95"][0] > 0.1
    rules = {r["id"]: r for r in result.numbers["rules"]}
    assert rules["agent.stream_equivalence"]["status"] == FAIL and rules["agent.stream_equivalence"]["interval"]


def test_too_few_pairs_is_inconclusive_and_a_clean_drill_passes():
    few = judge_agent_api(_pairs("load", 4, 0, 0) + [_attempt(1000 + i, "load", [Finding("transport", True)])
                                                     for i in range(100)], LIMITS, PLAN)
    assert few.status == INCONCLUSIVE
    assert any("only 4 streamed/whole pairs" in r for r in few.reasons)
    clean = judge_agent_api(_pairs("load", 40, 0, 0) + _pairs("conc-c12", 40, 0, 200), LIMITS, PLAN)
    assert clean.status == PASS and any("agreed" in r for r in clean.reasons)


def test_cadence_and_no_transition_rules():
    held = [_attempt(i, "load", [Finding("transport", True), Finding("tool_call.cadence", True)],
                     tool_call_max_gap_ms=80.0, tool_call_span_ms=40.0, tool_call_deltas=6) for i in range(60)]
    held.append(_attempt(99, "load", [Finding("transport", True), Finding(
        "tool_call.cadence", False, "parser", "...")], tool_call_max_gap_ms=95_000.0, tool_call_span_ms=0.0,
        tool_call_deltas=1))
    result = judge_agent_api(held, LIMITS)
    assert result.status == FAIL
    reason = next(r for r in result.reasons if r.startswith("tool-call cadence"))
    assert "95.0 s" in reason and "vllm#50604" in reason
    numbers = result.numbers["tool_call_cadence"]
    assert numbers["max_gap_ms"]["max"] == 95_000.0 and numbers["over_limit"] == 1
    swallowed = [_attempt(i, "load", [Finding("transport", True)]) for i in range(60)] + [
        _attempt(100 + i, "load", [Finding("reasoning.no_transition", False, "parser", "...")]) for i in range(3)]
    result = judge_agent_api(swallowed, LIMITS)
    assert any("never left the reasoning" in r for r in result.reasons)
    assert result.numbers["no_transition"]["by_layer"] == {"parser": 3}
