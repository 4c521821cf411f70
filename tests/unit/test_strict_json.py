"""Strict JSON for what a model writes (k3load.workload.strict_json): each hostile shape refused in words,
without recursion or Python's digit-limit error, and everything else read as `json.loads` reads it; then the
same shapes through validation (layer model_output, the words an operator reads)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from k3load.client.result import StreamResult, ToolCall
from k3load.workload import strict_json
from k3load.workload.scenario import parse_scenario
from k3load.workload.stream_equivalence import answer_shape
from k3load.workload.strict_json import (
    DUPLICATE_KEY,
    MAX_DEPTH,
    NOT_JSON_NUMBER,
    NUMBER_TOO_LARGE,
    NUMBER_TOO_LONG,
    SYNTAX,
    TOO_DEEP,
    Parsed,
    Refused,
    depth,
    parse,
)
from k3load.workload.validate import validate, vllm_error

DEEP = 60_000


def _refused(text: str) -> Refused:
    got = parse(text)
    assert isinstance(got, Refused), got
    return got


@pytest.mark.parametrize(("text", "kind", "words"), [
    ("[" * DEEP + "]" * DEEP, TOO_DEEP, "nested 60,000 deep; at most 64 are read"),
    ('{"a":' * DEEP + "1" + "}" * DEEP, TOO_DEEP, "nested 60,000 deep; at most 64 are read"),
    ("[" * DEEP, TOO_DEEP, "nested 60,000 deep"),  # never closed: still measured, still refused
    ('{"n": ' + "9" * 5000 + "}", NUMBER_TOO_LONG, "an integer of 5,000 digits; at most 4,300 are read"),
    ("[-" + "1" * 100_000 + "]", NUMBER_TOO_LONG, "an integer of 100,000 digits; at most 4,300 are read"),
    ('{"x": NaN}', NOT_JSON_NUMBER, "with NaN, which is not JSON"),
    ("[-Infinity]", NOT_JSON_NUMBER, "with -Infinity, which is not JSON"),
    ("Infinity", NOT_JSON_NUMBER, "with Infinity"),
    ('{"city": "Paris", "n": 1, "city": "Rome"}', DUPLICATE_KEY, 'the key "city" twice in one object'),
    ('{"a": {"k": 1, "k": 2, "k": 3}}', DUPLICATE_KEY, 'the key "k" 3 times'),
    ("[1e400]", NUMBER_TOO_LARGE, "the number 1e400, beyond a double's range"),
    ("[" + "9" * 400 + ".5]", NUMBER_TOO_LARGE, "(402 characters)"),
    ('{"id": 1', SYNTAX, "Expecting"),
    ("", SYNTAX, "Expecting value"),
])
def test_each_hostile_shape_is_refused_in_words(text, kind, words):
    got = _refused(text)
    assert got.kind == kind and words in got.reason, got
    assert got.strict == (kind != SYNTAX)


def test_deep_but_allowed_and_brackets_inside_strings_are_read():
    allowed = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse(allowed) == Parsed(json.loads(allowed))
    assert _refused("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)).kind == TOO_DEEP
    # brackets inside strings (escaped quotes and backslashes too) are text, not nesting
    text = json.dumps({"s": "[" * 1000 + "{" * 1000, "t": ['\\"[[[', "\\\\", "]]]}}}"], "u": {"v": [1, [2, [3]]]}})
    assert depth(text) == 5 and parse(text) == Parsed(json.loads(text))
    assert parse('"' + "[" * DEEP + '"') == Parsed("[" * DEEP)


def test_long_numbers_within_the_limit_are_exact_and_a_lower_process_limit_holds():
    assert parse("9" * 4300) == Parsed(int("9" * 4300))
    assert parse("[" + "0." + "1" * 5000 + "]") == Parsed([float("0." + "1" * 5000)])
    before = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(1000)
        assert "at most 1,000 are read" in _refused("1" * 1001).reason
    finally:
        sys.set_int_max_str_digits(before)


def test_depth_is_measured_without_recursion_and_in_linear_time():
    assert depth("[" * 2_000_000) == 2_000_000  # far past any recursion limit
    assert depth('"unterminated [[[') == 0 and depth("]]][") == 0 and depth("1") == 0


# -- properties (the conftest's profile: derandomised in `make test`, searched longer by `make fuzz`) ------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30)


@given(text=st.text(max_size=400) | st.text(alphabet='[]{}":,\\ 0123456789-.eENaIfinty', max_size=400))
@example(text="[" * 70)
@example(text='{"a":1,"a":1}')
@example(text="-Infinity")
@example(text='"\\ud800"')
@example(text="\ufeff{}")
def test_any_text_gives_parsed_or_refused_never_an_exception(text):
    got = parse(text)
    assert isinstance(got, Parsed | Refused)
    if isinstance(got, Refused):
        assert got.kind in strict_json.KINDS and got.reason


@given(value=json_values, indent=st.sampled_from([None, 1]))
def test_valid_json_within_the_limits_reads_as_json_loads_does(value, indent):
    text = json.dumps(value, indent=indent)
    got = parse(text)
    assert got == Parsed(json.loads(text)), got
    assert depth(text) <= MAX_DEPTH


@given(value=json_values)
def test_a_model_json_value_nested_past_the_limit_is_refused(value):
    text = "[" * MAX_DEPTH + json.dumps([value]) + "]" * MAX_DEPTH
    got = parse(text)
    assert isinstance(got, Refused) and got.kind == TOO_DEEP


def test_not_text_is_refused_not_raised():
    assert parse(None).kind == SYNTAX  # type: ignore[arg-type,union-attr]
    assert strict_json.loads_or_none(None) is None and strict_json.loads_or_none('{"a": 1}') == {"a": 1}


# -- through validation ----------------------------------------------------------------------------
SCENARIO = parse_scenario({
    "name": "v", "family": "agent", "system_prompt": "s",
    "tools": [{"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer"}}}}}],
    "executors": {"get": {"default": "ok"}},
    "turns": [
        {"user": "get 1", "expect": {"kind": "tool_call", "tools": ["get"]},
         "reply": {"tool_calls": [{"name": "get", "arguments": {"id": 1}}]}},
        {"user": "json", "expect": {"kind": "json"}, "response_format": {"type": "json_schema", "json_schema": {
            "name": "o", "schema": {"type": "object"}}}},
    ]}, Path("v.yaml"))
CALL, JSON_TURN = SCENARIO.turns
HOSTILE = {
    "deep": ('{"id": ' + "[" * (DEEP - 1) + "]" * (DEEP - 1) + "}",
             "arguments nested 60,000 deep; at most 64 are read"),
    "long_int": ('{"id": ' + "7" * 5000 + "}", "arguments with an integer of 5,000 digits; at most 4,300 are read"),
    "nan": ('{"id": NaN}', "arguments with NaN, which is not JSON"),
    "duplicate": ('{"id": 1, "id": 2}', 'arguments with the key "id" twice in one object'),
}


def _answer(**kw) -> StreamResult:
    return StreamResult(**{"status": "ok", "transport": "test", "send_ts": 1.0, "end_ts": 2.0, **kw})


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_hostile_arguments_are_a_model_output_finding_in_words(shape):
    text, words = HOSTILE[shape]
    result = _answer(tool_calls=[ToolCall(0, "c0", "get", text)], finish_reason="tool_calls")
    failed = [f for f in validate(result, SCENARIO, CALL) if not f.ok]
    assert [(f.check, f.layer) for f in failed] == [("tool_call.arguments_json", "model_output")]
    assert failed[0].detail.startswith(f"call 0 (get): {words}") and len(failed[0].detail) <= 500


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_hostile_structured_output_is_a_model_output_finding(shape):
    text, words = HOSTILE[shape]
    failed = [f for f in validate(_answer(content=text, finish_reason="stop"), SCENARIO, JSON_TURN) if not f.ok]
    assert [(f.check, f.layer) for f in failed] == [("expect.json", "model_output")]
    assert failed[0].detail.startswith(words.replace("arguments", "content", 1))


def test_hostile_error_bodies_and_twins_are_read_without_raising():
    assert vllm_error("[" * DEEP + "]" * DEEP) is None and vllm_error('{"error": {"message": NaN}}') is None
    shape = answer_shape(_answer(tool_calls=[ToolCall(0, "c0", "get", HOSTILE["deep"][0])]))
    assert shape["tool_calls"][0]["arguments"] == HOSTILE["deep"][0]  # compared as text
    assert not math.isnan(parse("1.5").value)  # type: ignore[union-attr]
