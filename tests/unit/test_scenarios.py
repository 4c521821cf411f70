"""Scenario and plan files: every shipped file loads, bad files fail naming file and field, samples
are current (bytes as sent, keys in declared order), and a warm request's shared prefix is
byte-identical to the cold one's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from k3load.analysis.pillars.agent.pillar_agent import tool_turns_reason
from k3load.workload.long_input import document, estimate_tokens, long_context_for, size_document
from k3load.workload.plan import PlanError, load_plan, parse_plan
from k3load.workload.scenario import (
    ScenarioError,
    execute_tool,
    load_scenario,
    load_scenarios,
    parse_scenario,
    with_tool_turns,
)
from k3load.workload.stored_requests import build_request, check_stored_requests, compact

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))
PLANS = sorted((ROOT / "plans").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_every_shipped_scenario_loads(path):
    scenario = load_scenario(path)
    assert scenario.name == path.stem and scenario.turns


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_every_shipped_plan_loads(path):
    plan = load_plan(path)
    kinds = [s.kind for s in plan.stages]
    # a capacity plan (a search stage) is for sizing, not acceptance: its load and its search are enough; so are a
    # replay plan's load and its production trace
    required = {"load", "search"} if "search" in kinds else {"load", "replay"} if "replay" in kinds else \
        {"load", "long_input", "concurrency", "soak", "restart"}
    assert required <= set(kinds)
    assert plan.families() <= {s.family for s in load_scenarios(SCENARIOS)}


def test_shipped_scenarios_cover_the_required_behaviours():
    scenarios = load_scenarios(SCENARIOS)
    families = {s.family for s in scenarios}
    assert families == {"agent", "shared_prefix", "cold", "long_input"}
    turns = [(s, t) for s in scenarios for t in s.turns]
    assert any(t.kind == "tool_call" and len(s.tools) >= 3 for s, t in turns)  # a choice among tools
    assert any(t.kind == "json" and "response_format" in t.settings for _, t in turns)
    assert any(t.retry.get("first_timeout_s") and t.retry["max_attempts"] > 1 for _, t in turns)
    multi = [s for s in scenarios if s.family == "agent" and len(s.turns) >= 2]
    assert any(t.user is None and t.kind == "answer" for s in multi for t in s.turns)  # answer a tool result
    assert any(t.kind == "answer" and t.settings.get("tool_choice") == "none" for s in multi for t in s.turns)
    schemas = [tool["function"]["parameters"] for s in scenarios for tool in s.tools]
    assert any(set(sch.get("properties", {})) - set(sch.get("required", [])) for sch in schemas)  # optional args


def test_repository_samples_are_current():
    scenarios = load_scenarios(SCENARIOS)
    count = estimate_tokens()
    problems = check_stored_requests(scenarios, ROOT / "samples" / "requests", "kimi-k3",
                             lambda s: long_context_for(s, 32768, count))
    assert problems == [], "run `k3load samples` and commit samples/requests"


def _minimal() -> dict:
    return {"name": "t", "family": "agent", "system_prompt": "sys",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}],
            "executors": {"f": {"table": [{"match": {"a": 1}, "result": {"one": True}}], "default": "other"}},
            "turns": [{"user": "call f", "expect": {"kind": "tool_call", "tools": ["f"]},
                       "reply": {"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}},
                      {"expect": {"kind": "answer"}}]}


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda d: d.update(colour="red"), "(top level)"),
    (lambda d: d["turns"][0]["expect"].update(kind="maybe"), "turns[0].expect.kind"),
    (lambda d: d["turns"][0]["expect"].update(tools=["g"]), "turns[0].expect.tools"),
    (lambda d: d["turns"][0]["reply"]["tool_calls"][0].update(arguments={"a": "x"}), "reply.tool_calls[0].arguments"),
    (lambda d: d["tools"][0]["function"]["parameters"].update(type="dict"), "tools[0].function.parameters"),
    (lambda d: d["executors"].update(g={"default": 1}), "executors.g"),
    (lambda d: d["turns"][0].pop("reply"), "turns[0].reply"),
    (lambda d: d["turns"][0].update(retry={"max_attempts": 0}), "turns[0].retry.max_attempts"),
])
def test_bad_scenarios_name_file_and_field(mutate, field):
    data = _minimal()
    mutate(data)
    with pytest.raises(ScenarioError) as info:
        parse_scenario(data, Path("scenarios/bad.yaml"))
    assert "scenarios/bad.yaml" in str(info.value) and field in str(info.value)


def test_unreadable_scenario_file(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError) as err:
        load_scenario(bad)
    assert str(err.value) == (f"{bad}:2:1: YAML error: expected ',' or ']', but got '<stream end>' "
                              "(while parsing a flow sequence started at 1:7)")  # one line: file, line, column
    with pytest.raises(ScenarioError, match=r"nope\.yaml: cannot read scenario: No such file or directory$"):
        load_scenario(tmp_path / "nope.yaml")


def test_executor_table_then_default():
    scenario = parse_scenario(_minimal(), Path("t.yaml"))
    assert execute_tool(scenario, "f", {"a": 1}) == '{"one":true}'
    assert execute_tool(scenario, "f", {"a": 2}) == "other"


def test_conversation_history_is_scripted_and_in_declared_order():
    data = _minimal()
    data["tools"][0]["function"]["parameters"]["properties"] = {"z": {"type": "integer"}, "a": {"type": "integer"}}
    data["turns"][0]["reply"]["tool_calls"][0]["arguments"] = {"z": 2, "a": 1}
    scenario = parse_scenario(data, Path("t.yaml"))
    second = build_request(scenario, 1, "m")
    body = json.loads(second.body)
    assert second.body == compact(body)  # compact bytes, nothing reordered on the way
    assert list(body["tools"][0]["function"]) == ["name", "parameters"]
    assert list(body["tools"][0]["function"]["parameters"]) == ["type", "properties", "required"]
    assert list(body["tools"][0]["function"]["parameters"]["properties"]) == ["z", "a"]
    assert body["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"z":2,"a":1}'
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    call = body["messages"][2]["tool_calls"][0]
    assert call["id"] == "functions.f:0" and body["messages"][3]["tool_call_id"] == "functions.f:0"
    assert build_request(scenario, 1, "m").sha256 == second.sha256


def test_warm_requests_share_the_cold_prefix_byte_for_byte():
    shared = load_scenario(ROOT / "scenarios" / "shared_prefix_support.yaml")
    requests = [build_request(shared, i, "m", salt="run-1") for i in range(len(shared.turns))]
    assert len({r.prefix_sha256 for r in requests}) == 1 and len({r.sha256 for r in requests}) == len(requests)
    bodies = [json.loads(r.body) for r in requests]
    fixed = [b["messages"][:-1] for b in bodies]
    assert all(compact(f) == compact(fixed[0]) for f in fixed)
    assert all(compact(b["tools"]) == compact(bodies[0]["tools"]) for b in bodies)
    other_run = build_request(shared, 0, "m", salt="run-2")
    assert other_run.prefix_sha256 != requests[0].prefix_sha256  # a new run starts cold


def test_cold_family_differs_per_request_salt():
    cold = load_scenario(ROOT / "scenarios" / "cold_support.yaml")
    a, b = build_request(cold, 0, "m", salt="r/u/1"), build_request(cold, 0, "m", salt="r/u/2")
    assert a.prefix_sha256 != b.prefix_sha256


def test_long_input_is_sized_from_max_model_len():
    scenario = load_scenario(ROOT / "scenarios" / "long_input_policy.yaml")
    count = estimate_tokens()
    for max_len in (2048, 32768):
        text = long_context_for(scenario, max_len, count)
        prompt = count(json.dumps(json.loads(build_request(scenario, 1, "m", long_context=text).body)["messages"]))
        assert 0.45 * max_len < prompt < 0.9 * max_len, (max_len, prompt)
    assert size_document(50, count) == document(size_document(50, count).count("## "))


def test_plan_expands_concurrency_steps_and_rejects_bad_plans(tmp_path):
    plan = parse_plan({"name": "p", "stages": [
        {"name": "warm", "kind": "load", "duration_s": 5, "users": 2, "mix": {"agent": 1}},
        {"name": "ramp", "kind": "concurrency", "duration_s": 3, "steps": [1, 4], "mix": {"agent": 1, "cold": 0}}]},
        "p.yaml")
    assert [s.name for s in plan.stages] == ["warm", "ramp-c1", "ramp-c4"]
    assert plan.stages[2].start_s == 8 and plan.stage_at(9).users == 4 and plan.stage_at(11) is None
    assert plan.stages[1].mix == {"agent": 1}
    with pytest.raises(PlanError, match=r"stages\[0\]"):
        parse_plan({"name": "p", "stages": [{"name": "x", "kind": "nap", "duration_s": 1, "users": 1,
                                             "mix": {"agent": 1}}]}, "p.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "p", "stages": []}))
    with pytest.raises(PlanError, match=r"bad\.yaml"):
        load_plan(bad)


@pytest.mark.parametrize(("tool_turns", "first", "fourth"), [
    ("auto", "auto", "auto"),
    ("required", "required", "required"),
    ("named", {"type": "function", "function": {"name": "get_current_weather"}},
     {"type": "function", "function": {"name": "uber.ride"}}),
])
def test_a_plans_tool_turns_steer_only_the_tool_call_turns(tool_turns, first, fourth):
    """The weather trip: turns 0 and 2 expect a call (set no choice), 1 and 3 an answer, 4 sets none."""
    scenario = load_scenario(ROOT / "scenarios" / "agent_weather_trip.yaml")
    steered = with_tool_turns(scenario, tool_turns)
    choices = [json.loads(build_request(steered, i, "m").body)["tool_choice"] for i in range(len(steered.turns))]
    assert [t.kind for t in steered.turns] == ["tool_call", "answer", "tool_call", "answer", "answer"]
    assert choices == [first, "auto", fourth, "auto", "none"]
    assert [t.expect for t in steered.turns] == [t.expect for t in scenario.turns]  # expectations unchanged
    plan = parse_plan({"name": "p", "tool_turns": tool_turns, "stages": [
        {"name": "a", "kind": "load", "duration_s": 1, "users": 1, "mix": {"agent": 1}}]}, "p.yaml")
    assert plan.tool_turns == tool_turns
    reason = tool_turns_reason(tool_turns)
    assert (reason is None) == (tool_turns == "auto")
    assert reason is None or ("auto" in reason and "was not tested" in reason)


def test_named_tool_turns_fall_back_to_required_where_a_turn_allows_several_tools():
    data = _minimal()
    data["turns"][0]["expect"] = {"kind": "tool_call", "tools": ["f", "g"]}
    data["tools"].append({"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}})
    steered = with_tool_turns(parse_scenario(data, Path("t.yaml")), "named")
    assert steered.turns[0].settings["tool_choice"] == "required"
    with pytest.raises(PlanError, match="tool_turns"):
        parse_plan({"name": "p", "tool_turns": "sometimes", "stages": [
            {"name": "a", "kind": "load", "duration_s": 1, "users": 1, "mix": {"agent": 1}}]}, "p.yaml")
