"""Tool-call arguments drawn from real schemas, then mutated, through the validators (issue 37, item 4).

The schemas are the shipped scenarios' tools and the BFCL live tool definitions (../shared/data/bfcl/,
written by others: defaults, enums, nested objects, non-standard type names normalised as a gateway would).
Arguments drawn from a schema (hypothesis-jsonschema) must be judged valid; the same text mutated (cut,
nested deeper, a key given twice, NaN, a 5,000-digit number, bytes changed) must be judged in words with a
declared layer, never raise. Deterministic in `make test`; `make fuzz SECONDS=N` draws more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis_jsonschema import from_schema

from k3load.client.result import StreamResult, ToolCall
from k3load.outcomes import LAYERS
from k3load.workload.scenario import Scenario, load_scenario
from k3load.workload.validate import check_tool_calls

ROOT = Path(__file__).resolve().parents[2]
BFCL = ROOT.parent / "shared" / "data" / "bfcl" / "BFCL_v4_live_simple.json"
BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}  # the bfcl README's note


def _normalised(schema: Any) -> Any:
    """BFCL's own type names as JSON Schema's (an `any` type dropped); other keys as they are."""
    if isinstance(schema, list):
        return [_normalised(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _normalised(v) for k, v in schema.items() if k not in ("type", "properties")}
    if isinstance(schema.get("properties"), dict):  # property names, not keywords: `type` may be one
        out["properties"] = {name: _normalised(sub) for name, sub in schema["properties"].items()}
    kind = schema.get("type")
    if isinstance(kind, str) and BFCL_TYPES.get(kind, kind) is not None:
        out["type"] = BFCL_TYPES.get(kind, kind)
    return out


def _bfcl_tools(limit: int = 40) -> list[dict[str, Any]]:
    tools = []
    if not BFCL.exists():
        return tools
    for line in BFCL.read_text(encoding="utf-8").splitlines()[:limit]:
        for function in json.loads(line)["function"]:
            tools.append({"type": "function", "function": {"name": function["name"],
                                                           "parameters": _normalised(function["parameters"])}})
    return tools


def _shipped_tools() -> list[dict[str, Any]]:
    return [tool for path in sorted((ROOT / "scenarios").glob("*.yaml")) for tool in load_scenario(path).tools]


def _drawable(tool: dict[str, Any]) -> bool:
    """A schema hypothesis-jsonschema can draw from (not one with a keyword or format it does not know)."""
    try:
        from_schema(tool["function"]["parameters"]).validate()
    except (InvalidArgument, ValueError, TypeError):
        return False
    return True


TOOLS = [t for t in _shipped_tools() + _bfcl_tools() if _drawable(t)]
SCENARIO = Scenario(name="fuzz", family="agent", system_prompt="", turns=(), path=ROOT / "scenarios" / "fuzz",
                    tools=tuple({t["function"]["name"]: t for t in TOOLS}.values()))


def _call(name: str, arguments: str) -> list:
    result = StreamResult(status="ok", transport="none", send_ts=0.0, end_ts=0.0, finish_reason="tool_calls",
                          tool_calls=[ToolCall(index=0, id="call-0", name=name, arguments=arguments)])
    return check_tool_calls(result, SCENARIO)


@st.composite
def drawn_arguments(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    tool = draw(st.sampled_from(list(SCENARIO.tools)))
    value = draw(from_schema(tool["function"]["parameters"]))
    return tool["function"]["name"], value


def test_the_schemas_come_from_the_scenarios_and_from_bfcl() -> None:
    shipped, bfcl = {t["function"]["name"] for t in _shipped_tools()}, {t["function"]["name"] for t in _bfcl_tools()}
    names = {t["function"]["name"] for t in SCENARIO.tools}
    assert names & shipped and (names & bfcl or not BFCL.exists()), (sorted(names)[:10], BFCL)


@given(drawn_arguments())
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_arguments_drawn_from_a_tools_schema_are_judged_valid(drawn: tuple[str, dict[str, Any]]) -> None:
    name, value = drawn
    findings = _call(name, json.dumps(value, ensure_ascii=False))
    assert [f.ok for f in findings] == [True], [(f.check, f.detail[:200]) for f in findings]


MUTATIONS = ("cut", "deep", "duplicate", "nan", "long_int", "bytes", "not_object")


def _mutate(text: str, how: str, data: st.DataObject) -> str:
    if how == "cut":
        return text[: data.draw(st.integers(0, max(len(text) - 1, 0)))]
    if how == "deep":
        depth = data.draw(st.sampled_from([65, 1_000, 60_000]))
        return '{"x": ' + "[" * depth + "]" * depth + "}"
    if how == "duplicate":
        return text[:-1] + (', ' if text != "{}" else "") + '"k": 1, "k": 2}'
    if how == "nan":
        return text[:-1] + (', ' if text != "{}" else "") + '"n": ' + data.draw(st.sampled_from(
            ["NaN", "-Infinity", "Infinity"])) + "}"
    if how == "long_int":
        digits = "7" * data.draw(st.sampled_from([5_000, 100_000]))
        return text[:-1] + (', ' if text != "{}" else "") + '"i": ' + digits + "}"
    if how == "bytes":
        spot = data.draw(st.integers(0, len(text)))
        return text[:spot] + data.draw(st.text(max_size=8)) + text[spot:]
    return data.draw(st.sampled_from(["[]", "1", '"s"', "null", "true"]))


@given(drawn_arguments(), st.sampled_from(MUTATIONS), st.data())
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_mutated_arguments_are_judged_in_words_with_a_layer_never_raised(
        drawn: tuple[str, dict[str, Any]], how: str, data: st.DataObject) -> None:
    name, value = drawn
    text = _mutate(json.dumps(value, ensure_ascii=False), how, data)
    findings = _call(name, text)
    assert len(findings) == 1
    (finding,) = findings
    if not finding.ok:
        assert finding.layer in LAYERS and finding.detail and len(finding.detail) < 5_000, finding
    if how in ("deep", "duplicate", "nan", "long_int", "not_object"):
        assert not finding.ok and finding.layer == "model_output", (how, finding)


@pytest.mark.parametrize("how, words", [("deep", "nested"), ("duplicate", "twice"), ("long_int", "digits")])
def test_each_strict_refusal_says_what_was_wrong(how: str, words: str) -> None:
    name = SCENARIO.tools[0]["function"]["name"]
    text = {"deep": '{"a": ' + "[" * 60_000 + "]" * 60_000 + "}", "duplicate": '{"k": 1, "k": 2}',
            "long_int": '{"i": ' + "9" * 5_000 + "}"}[how]
    (finding,) = _call(name, text)
    assert not finding.ok and words in finding.detail, finding.detail[:300]


def _json_turns() -> list[tuple[Any, dict[str, Any]]]:
    """The shipped scenarios' structured-output turns, each with the schema the validator reads."""
    turns = []
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        for turn in load_scenario(path).turns:
            schema = turn.expect.get("schema") or \
                (turn.settings.get("response_format") or {}).get("json_schema", {}).get("schema")
            if turn.kind == "json" and schema:
                turns.append((turn, schema))
    return turns


JSON_TURNS = _json_turns()


@given(st.sampled_from(range(len(JSON_TURNS))) if JSON_TURNS else st.nothing(), st.data())
@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_structured_outputs_drawn_from_their_schema_pass_and_mutated_ones_are_judged(i: int,
                                                                                    data: st.DataObject) -> None:
    from k3load.workload.validate import _check_json

    turn, schema = JSON_TURNS[i]
    value = data.draw(from_schema(schema))
    text = json.dumps(value, ensure_ascii=False)
    result = StreamResult(status="ok", transport="none", send_ts=0.0, end_ts=0.0, finish_reason="stop", content=text)
    assert _check_json(result, turn).ok, _check_json(result, turn).detail[:300]
    how = data.draw(st.sampled_from(MUTATIONS))
    result.content = _mutate(text if text.startswith("{") else "{}", how, data)
    finding = _check_json(result, turn)
    assert finding.ok or (finding.layer in LAYERS and finding.detail)
    if how in ("deep", "duplicate", "nan", "long_int"):
        assert not finding.ok and finding.layer == "model_output", (how, finding)


def test_the_shipped_scenarios_have_structured_output_turns_to_draw_for() -> None:
    assert JSON_TURNS, "no kind: json turn with a schema under scenarios/"
