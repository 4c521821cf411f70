"""A turn's `fallback:` (issue 33, item 4): parsed and checked once at load, applied to the body and nothing else,
sent once after the exhausted retries in the same chain, each record saying its path; the checklist's "Retry and
API fallback behaviour" line ticked only when a retry and a fallback each ended in a valid answer."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from k3load.analysis.pillars.agent.retry_paths import checklist_line, path_counts
from k3load.analysis.run.rundata import RunData
from k3load.client.result import STATUS_OK, STATUS_TIMEOUT, StreamResult, ToolCall
from k3load.evidence import records_file
from k3load.records import Attempt, read_records
from k3load.workload.conversation import RunContext, run_turn
from k3load.workload.retry_policy import (
    AttemptPath,
    Fallback,
    drill_deadline_s,
    fallback_body,
    fallback_turn,
    judged_expectation,
)
from k3load.workload.scenario import ScenarioError, parse_scenario
from k3load.workload.stored_requests import build_request

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "scenarios" / "agent_timeout_retry.yaml"
RETRY_LINE = "Retry and API fallback behaviour"


def _data() -> dict[str, Any]:
    return yaml.safe_load(SHIPPED.read_text())


def _parse(data: dict[str, Any], tmp_path: Path) -> Any:
    return parse_scenario(data, tmp_path / "edited.yaml")


# --- the schema and the typed model ---------------------------------------------------------------------------

def test_the_shipped_drill_declares_its_fallback(tmp_path: Path) -> None:
    scenario = _parse(_data(), tmp_path)
    first, second = scenario.turns
    assert first.fallback is None and second.fallback == Fallback(max_tokens=100, tool_choice="none")
    assert second.retry["max_attempts"] == second.retry["first_timeout_attempts"] == 2
    assert [drill_deadline_s(second.retry, n) for n in (1, 2, 3)] == [0.001, 0.001, None]
    assert [drill_deadline_s(first.retry, n) for n in (1, 2)] == [0.001, None]


@pytest.mark.parametrize(("turn", "fallback", "said"), [
    (1, {"max_tokens": 0}, "turns[1].fallback.max_tokens: 0 is less than the minimum of 1"),
    (1, {"max_tokens": 2.5}, "turns[1].fallback.max_tokens: 2.5 is not of type 'integer'"),
    (1, {"temperature": 0.5}, "turns[1].fallback: Additional properties are not allowed ('temperature'"),
    (1, {}, "turns[1].fallback: {} should be non-empty"),
    (1, {"tool_choice": "maybe"}, "turns[1].fallback.tool_choice: 'maybe' is not valid"),
    (0, {"tool_choice": {"type": "function"}}, "turns[0].fallback.tool_choice: {'type': 'function'} is not valid"),
    (1, {"response_format": {"type": "text"}}, "turns[1].fallback.response_format: {'type': 'text'} is not of type "
                                               "'null'"),
    (1, {"model": 3}, "turns[1].fallback.model: 3 is not of type 'string'"),
    (1, {"tool_choice": "required"}, "turns[1].fallback.tool_choice: 'required' forces a call, but the turn expects "
                                     "'answer'"),
    (0, {"tool_choice": {"type": "function", "function": {"name": "calendar"}}},
     "turns[0].fallback.tool_choice.function.name: unknown tool 'calendar'"),
    (1, {"response_format": None}, "turns[1].fallback.response_format: the turn sends no response_format to drop"),
    (0, {"max_tokens": 120}, "turns[0].fallback: changes nothing the turn sends (its max_tokens 120, tool_choice "
                             "'auto')"),
])
def test_a_bad_fallback_is_a_scenario_error_naming_the_file_and_the_turn(tmp_path: Path, turn: int, fallback: dict,
                                                                         said: str) -> None:
    data = _data()
    data["turns"][turn]["fallback"] = fallback
    with pytest.raises(ScenarioError) as raised:
        _parse(data, tmp_path)
    assert str(raised.value).startswith(f"{tmp_path / 'edited.yaml'}: ") and said in str(raised.value), raised.value


def test_a_fallback_choice_needs_tools_and_the_drill_its_short_deadline(tmp_path: Path) -> None:
    data = _data()
    del data["tools"], data["executors"]
    data["turns"] = [{"user": "hi", "expect": {"kind": "answer"}, "fallback": {"tool_choice": "none"}}]
    with pytest.raises(ScenarioError, match=r"turns\[0\]\.fallback\.tool_choice: the scenario has no tools"):
        _parse(data, tmp_path)
    data["turns"][0] = {"user": "hi", "expect": {"kind": "answer"}, "retry": {"first_timeout_attempts": 2}}
    with pytest.raises(ScenarioError, match=r"turns\[0\]\.retry\.first_timeout_attempts: needs first_timeout_s"):
        _parse(data, tmp_path)
    data["turns"][0]["retry"] = {"max_attempts": 2, "first_timeout_s": 0.01, "first_timeout_attempts": 3}
    with pytest.raises(ScenarioError, match="first_timeout_attempts: 3 is more than max_attempts 2"):
        _parse(data, tmp_path)


def test_a_logged_turn_takes_no_fallback(tmp_path: Path) -> None:
    data = {"name": "logged_one", "family": "agent", "mode": "logged",
            "turns": [{"messages": [{"role": "user", "content": "hi"}],
                       "request": {"model": "x", "messages": None, "max_tokens": 50},
                       "expect": {"kind": "answer"}, "fallback": {"max_tokens": 10}}]}
    with pytest.raises(ScenarioError, match=r"turns\[0\]\.fallback: a logged turn takes its settings"):
        _parse(data, tmp_path)


def test_dropping_a_response_format_and_another_model_parse(tmp_path: Path) -> None:
    data = _data()
    data["turns"][1]["response_format"] = {"type": "json_object"}
    data["turns"][1]["expect"] = {"kind": "json", "schema": {"type": "object"}}
    data["turns"][1]["fallback"] = {"response_format": None, "model": "kimi-k3-small"}
    turn = _parse(data, tmp_path).turns[1]
    assert turn.fallback == Fallback(drop_response_format=True, model="kimi-k3-small")
    judged = fallback_turn(turn, turn.fallback)
    assert "response_format" not in judged.settings and judged.kind == "answer"
    assert judged.settings["max_tokens"] == turn.settings["max_tokens"]


# --- the body and the expectation ---------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=8)
BODY_KEYS = ("model", "messages", "max_tokens", "temperature", "stream", "tools", "tool_choice", "response_format")
bodies = st.dictionaries(st.sampled_from(BODY_KEYS) | st.text(max_size=6), json_values, max_size=10)
choices = st.sampled_from(["none", "auto", "required"]) | st.builds(
    lambda name: {"type": "function", "function": {"name": name}}, st.text(min_size=1, max_size=6))
fallbacks = st.builds(Fallback, max_tokens=st.none() | st.integers(1, 4096), tool_choice=st.none() | choices,
                      drop_response_format=st.booleans(), model=st.none() | st.text(min_size=1, max_size=8))


@given(body=bodies, fallback=fallbacks)
def test_the_fallback_body_has_exactly_the_fallbacks_changes(body: dict[str, Any], fallback: Fallback) -> None:
    before = copy.deepcopy(body)
    out = fallback_body(body, fallback)
    assert body == before  # the first try's body is left as it was
    sets = {k: v for k, v in (("model", fallback.model), ("max_tokens", fallback.max_tokens),
                              ("tool_choice", fallback.tool_choice)) if v is not None}
    dropped = {"response_format"} if fallback.drop_response_format else set()
    kept = [k for k in body if k not in dropped]
    assert list(out)[:len(kept)] == kept  # every kept key in its place, what the body lacked after them
    assert set(out) == set(kept) | set(sets)
    for key, value in out.items():
        assert value == (sets[key] if key in sets else body[key]), key
    if not sets and not (dropped & set(body)):
        assert json.dumps(out) == json.dumps(body)  # a fallback with nothing to change sends the same bytes


@pytest.mark.parametrize(("expect", "fallback", "kind"), [
    ({"kind": "tool_call", "tools": ["todo"]}, Fallback(tool_choice="none"), "answer"),
    ({"kind": "tool_call", "tools": ["todo"]}, Fallback(max_tokens=10), "tool_call"),
    ({"kind": "tool_call"}, Fallback(tool_choice="required"), "tool_call"),
    ({"kind": "json", "schema": {"type": "object"}}, Fallback(drop_response_format=True), "answer"),
    ({"kind": "json"}, Fallback(model="other"), "json"),
    ({"kind": "answer"}, Fallback(tool_choice="none"), "answer"),
])
def test_a_fallback_is_judged_by_the_expectation_minus_what_it_took_away(expect: dict, fallback: Fallback,
                                                                         kind: str) -> None:
    assert judged_expectation(expect, fallback)["kind"] == kind
    if kind == expect["kind"]:
        assert judged_expectation(expect, fallback) == expect


# --- the chain: retries, then the one fallback --------------------------------------------------------------

class DrillClient:
    """Times out every attempt sent with a deadline under `short_s` (the drill's), answers the others."""

    transport = "fake"

    def __init__(self, short_s: float = 0.01) -> None:
        self.short_s, self.sent = short_s, []

    def send(self, body: bytes, deadline_s: float, *, headers: Any = None) -> StreamResult:
        self.sent.append((json.loads(body), deadline_s))
        if deadline_s < self.short_s:
            return StreamResult(status=STATUS_TIMEOUT, transport="fake", send_ts=1.0, end_ts=1.0 + deadline_s)
        data = json.loads(body)
        calls = [] if data.get("tool_choice") == "none" else [ToolCall(index=0, id="functions.todo:0", name="todo",
                                                                       arguments='{"type":"add","content":"x"}')]
        return StreamResult(status=STATUS_OK, transport="fake", send_ts=1.0, end_ts=1.5, content="" if calls else
                            "Done.", tool_calls=calls, finish_reason="tool_calls" if calls else "stop",
                            first_token_ts=1.1, chunk_ts=[1.1, 1.2])


def _play(tmp_path: Path, turn: int, edit: Any = None) -> tuple[list[Attempt], DrillClient, Any]:
    data = _data()
    if edit:
        edit(data)
    scenario = _parse(data, tmp_path)
    client, sink = DrillClient(), []
    attempts = run_turn(client, RunContext(run_id="r", model="tiny", user_id="u", sleep=lambda s: None), scenario,
                        scenario.turns[turn], "", sink.append)
    assert attempts == sink
    return attempts, client, scenario


def test_exhausted_retries_fall_back_once_in_the_same_chain(tmp_path: Path) -> None:
    attempts, client, scenario = _play(tmp_path, 1)
    assert [a.path for a in attempts] == ["first_try", "retry", "fallback"]
    assert [a.attempt for a in attempts] == [1, 2, 3] and len({a.chain_id for a in attempts}) == 1
    assert [a.will_retry for a in attempts] == [True, True, False]  # a later attempt of the chain followed each
    assert [a.drill for a in attempts] == [True, True, False] and [a.status for a in attempts] == [
        STATUS_TIMEOUT, STATUS_TIMEOUT, STATUS_OK]
    (first, _), (retry, _), (fallback, deadline) = client.sent
    assert first == retry and deadline == 60  # the fallback gets the turn's own deadline
    assert {k: v for k, v in fallback.items() if first.get(k) != v} == {"max_tokens": 100, "tool_choice": "none"}
    assert list(fallback) == list(first)  # nothing else changed, not even the keys' order
    last = attempts[-1]
    assert last.valid and last.turn_kind == "answer" and last.max_tokens == 100  # judged without the tool call
    assert last.request_sha256 != attempts[0].request_sha256 == attempts[1].request_sha256
    assert last.prefix_sha256 == attempts[0].prefix_sha256
    assert attempts[0].request_sha256 == build_request(scenario, 1, "tiny", "").sha256


def test_a_tool_call_turn_falling_back_without_tools_is_judged_as_an_answer(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["turns"][0]["retry"] |= {"max_attempts": 1}
        data["turns"][0]["fallback"] = {"tool_choice": "none", "max_tokens": 50}

    attempts, _client, _ = _play(tmp_path, 0, edit)
    assert [(a.path, a.turn_kind, a.valid) for a in attempts] == [("first_try", "tool_call", False),
                                                                  ("fallback", "answer", True)]


def test_no_fallback_where_a_retry_recovered_or_none_is_declared(tmp_path: Path) -> None:
    recovered, _, _ = _play(tmp_path, 0)  # the shipped turn 0: recovered by its retry, declares no fallback
    assert [(a.path, a.status) for a in recovered] == [("first_try", STATUS_TIMEOUT), ("retry", STATUS_OK)]

    def no_fallback(data: dict[str, Any]) -> None:
        del data["turns"][1]["fallback"]

    # every attempt drilled and no fallback: the turn could never be answered, a scenario error at load
    with pytest.raises(ScenarioError, match=r"turns\[1\]\.retry\.first_timeout_attempts: every one of the 2 "
                                            r"attempts gets the short deadline.*declare `fallback:`"):
        _play(tmp_path, 1, no_fallback)

    def real_timeout(data: dict[str, Any]) -> None:  # a deadline the server really misses, not a drill's
        del data["turns"][1]["fallback"]
        data["turns"][1]["retry"] = {"max_attempts": 2, "backoff_s": 0.1}
        data["turns"][1]["timeout_s"] = 0.001

    exhausted, _, _ = _play(tmp_path, 1, real_timeout)
    assert [(a.path, a.will_retry) for a in exhausted] == [("first_try", True), ("retry", False)]


# --- the checklist line and the report's counts -------------------------------------------------------------

def _attempt(chain: str, number: int, valid: bool, sha: str = "a", path: str | None = None, **kw: Any) -> Attempt:
    return Attempt(run_id="r", attempt_id=f"{chain}-{number}", chain_id=chain, attempt=number, stage="load",
                   scenario="s", family="agent", turn=0, turn_kind="answer", user_id="u", request_sha256=sha,
                   prefix_sha256="p", transport="fake", status="ok" if valid else "timeout", send_ts=1.0,
                   end_ts=2.0, valid=valid, path=path, **kw)


def _counts(attempts: list[Attempt]) -> dict[str, Any]:
    return path_counts(RunData(path=Path("."), attempts=attempts))


def test_paths_are_read_from_the_chain_where_the_record_does_not_say_them() -> None:
    chain = [_attempt("c", 1, False, will_retry=True), _attempt("c", 2, False, will_retry=True),
             _attempt("c", 3, True, sha="b")]
    counts = _counts([*chain, _attempt("d", 1, True)])
    assert {p: counts[p] for p in ("first_try", "retry", "fallback")} == {
        "first_try": {"attempts": 2, "valid": 1, "drill": 0}, "retry": {"attempts": 1, "valid": 0, "drill": 0},
        "fallback": {"attempts": 1, "valid": 1, "drill": 0}}
    recorded = [_attempt("e", 1, False, will_retry=True), _attempt("e", 2, True, path=AttemptPath.FALLBACK.value)]
    assert _counts(recorded)["fallback"]["attempts"] == 1  # a record's own path wins (the same bytes here)


@pytest.mark.parametrize(("attempts", "why"), [
    ([_attempt("a", 1, True)], "inconclusive, because no request was retried, so neither a retry nor a fallback"),
    ([_attempt("a", 1, False, will_retry=True), _attempt("a", 2, True)],
     "inconclusive, because no turn exhausted its retries, so the fallback was never exercised"),
    ([_attempt("a", 1, False, will_retry=True), _attempt("a", 2, True), _attempt("b", 1, False, will_retry=True),
      _attempt("b", 2, False)],
     "inconclusive, because no fallback was sent: 1 retried request(s) ended without a valid answer and none fell"),
    ([_attempt("a", 1, False, will_retry=True), _attempt("a", 2, True), _attempt("b", 1, False, will_retry=True),
      _attempt("b", 2, False, will_retry=True), _attempt("b", 3, False, sha="x")],
     "not proven, because none of the 1 fallbacks ended in a valid answer"),
    ([_attempt("a", 1, False, will_retry=True), _attempt("a", 2, False, will_retry=True),
      _attempt("a", 3, True, sha="x")], "not proven, because none of the 1 retries ended in a valid answer"),
])
def test_the_line_stays_open_saying_why(attempts: list[Attempt], why: str) -> None:
    ticked, detail = checklist_line(_counts(attempts), {"timed_out": 1, "recovered": 1})
    assert not ticked and detail.startswith(why), detail
    assert detail.endswith("timeout drill: 1 timed out, 1 recovered")


def test_the_line_is_ticked_when_a_retry_and_a_fallback_each_ended_valid() -> None:
    attempts = [_attempt("a", 1, False, will_retry=True), _attempt("a", 2, True),
                _attempt("b", 1, False, will_retry=True), _attempt("b", 2, False, will_retry=True),
                _attempt("b", 3, True, sha="x")]
    ticked, detail = checklist_line(_counts(attempts), {})
    assert ticked and detail == ("first tries 2 (0 valid), retries 2 (1 valid), fallbacks 1 (1 valid); timeout "
                                 "drill: 0 timed out, 0 recovered")


# --- a whole run against the sim ------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_sim_run_falls_back_after_the_drills_exhausted_retries(start_sim: Any, tmp_path: Path) -> None:
    """One short stage of the shipped drill: turn 1's first try and retry time out on purpose, its fallback is
    answered; the checklist line is ticked and the report shows the counts. The same records without the
    fallback's turn leave the line open, saying the fallback never ran."""
    sim = start_sim("--time-scale", "0.05")
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    shutil.copy(SHIPPED, scenarios / SHIPPED.name)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "fallback", "stages": [
        {"name": "load", "kind": "load", "duration_s": 2, "users": 2, "mix": {"agent": 1}}]}))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless", "--host",
           sim.base_url, "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe", "recipes/local-dev.yaml",
           "--k3-scenarios", str(scenarios / "*.yaml"), "--stop-timeout", "10", "--only-summary"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert (out / "verdict.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    attempts = read_records(records_file(out))
    chains: dict[str, list[Attempt]] = {}
    for attempt in attempts:
        chains.setdefault(attempt.chain_id, []).append(attempt)
    fell_back = [sorted(c, key=lambda a: a.attempt) for c in chains.values() if c[0].turn == 1 and len(c) == 3]
    assert fell_back, [(a.turn, a.attempt, a.path, a.status) for a in attempts]
    for chain in fell_back:
        assert [(a.attempt, a.path, a.drill) for a in chain] == [(1, "first_try", True), (2, "retry", True),
                                                                 (3, "fallback", False)]
        assert chain[2].valid and chain[2].max_tokens == 100 and chain[2].turn_kind == "answer"
        assert chain[2].request_sha256 != chain[0].request_sha256
    verdict = json.loads((out / "verdict.json").read_text())
    line = next(i for i in verdict["checklist"] if i["item"] == RETRY_LINE)
    assert line["status"] == "ok", line
    assert "## Retries and fallbacks" in (out / "report.md").read_text()

    without = [a for a in attempts if a.turn != 1]  # turn 0 only: recovered by retry, never fell back
    ticked, detail = checklist_line(_counts(without), {})
    assert not ticked and "no turn exhausted its retries, so the fallback was never exercised" in detail
