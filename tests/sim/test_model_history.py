"""`history: model` (issue 28, part 3): conversations the model drives, judged on what it did.

Against the real sim on loopback (one per module; its 'model' calls the tool a user message names, with
arguments drawn from the tool's schema, and answers a tool result in prose), through ScenarioPlay as a
Locust user plays it. The bodies sent are read from a client that hands each one to the real one. Then
what needs no server: the history without an answer, the plan's `history`, the records' new fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3load.analysis.run import rundata
from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult
from k3load.loadgen.inputs import as_played
from k3load.records import Attempt
from k3load.sim.process import SimProcess
from k3load.workload import model_history
from k3load.workload.conversation import RunContext, ScenarioPlay, StreamDrill, run_turn_both_ways
from k3load.workload.model_history import NO_RESULT, ModelHistory, drives
from k3load.workload.plan import load_plan
from k3load.workload.scenario import Scenario, execute_tool, load_scenario, parse_scenario
from k3load.workload.stored_requests import build_request
from tests.conftest import FAST_SIM

ROOT = Path(__file__).resolve().parents[2]
TRIP = load_scenario(ROOT / "scenarios" / "agent_weather_trip.yaml")
WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Retrieves the current weather for a city.",
    "parameters": {"type": "object", "required": ["location"],
                   "properties": {"location": {"type": "string", "enum": ["Paris"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "local_clock", "description": "Tells the local clock time of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
LOGGED_CALL = {"id": "call_1", "type": "function",
               "function": {"name": "get_current_weather", "arguments": '{"location":"Paris"}'}}
PARIS = '{"location":"Paris","temperature":11,"conditions":"rain"}'


class Recording:
    """The real client, keeping each body it sends (parsed), in order."""

    def __init__(self, client: ChatClient) -> None:
        self.client, self.transport = client, client.transport
        self.sent: list[dict[str, Any]] = []

    def send(self, body: bytes, deadline_s: float, *, headers: Mapping[str, str] | None = None) -> StreamResult:
        self.sent.append(json.loads(body))
        return self.client.send(body, deadline_s, headers=headers)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    with SimProcess(FAST_SIM, tmp_path_factory.mktemp("sim") / "sim.log") as started:
        yield started


def _play(sim: SimProcess, scenario: Scenario, ctx: RunContext | None = None
          ) -> tuple[list[Attempt], list[dict[str, Any]]]:
    records: list[Attempt] = []
    with ChatClient(sim.base_url) as real:
        client = Recording(real)
        play = ScenarioPlay(client, ctx or RunContext(run_id="r", model="tiny", user_id="u"), scenario)
        for _ in range(40):  # bounded: a playing sends at most len(turns) + MAX_SESSION_ROUNDS requests
            if play.done:
                break
            play.step(records.append)
        assert play.done
    return records, client.sent


def _scenario(data: dict[str, Any]) -> Scenario:
    return parse_scenario(yaml.safe_load(yaml.safe_dump(data)), Path(f"{data['name']}.yaml"))


def _logged() -> Scenario:
    request = {"model": "agent-model", "messages": None, "tools": [WEATHER, CLOCK], "tool_choice": "auto",
               "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 64}
    return _scenario({
        "name": "logged_paris", "family": "agent", "mode": "logged", "history": "model",
        "defaults": {"timeout_s": 30},
        "executors": {"get_current_weather": {"table": [{"match": {"location": "Paris"}, "result": PARIS}],
                                              "default": '{"temperature":20}'}},
        "turns": [
            {"request": request, "expect": {"kind": "tool_call", "tools": ["get_current_weather"]},
             "messages": [{"role": "system", "content": "You are a travel assistant."},
                          {"role": "user", "content": "What is the current weather in Paris?"}],
             "recorded": {"content": None, "tool_calls": [{"id": "call_1", "name": "get_current_weather",
                                                           "arguments": {"location": "Paris"}}]}},
            {"request": request, "expect": {"kind": "answer"},
             "messages": [{"role": "assistant", "content": None, "tool_calls": [LOGGED_CALL]},
                          {"role": "tool", "tool_call_id": "call_1", "content": PARIS}],
             "recorded": {"content": "It is 11 degrees and raining."}},
            {"request": request, "expect": {"kind": "answer"},
             "messages": [{"role": "assistant", "content": "It is 11 degrees and raining."},
                          {"role": "user", "content": "And the local clock time there?"}],
             "recorded": {"content": "It is 14:00 in Paris."}}]})


def _weather_desk(turns: list[dict[str, Any]]) -> Scenario:
    return _scenario({"name": "weather_desk", "family": "agent", "history": "model",
                      "system_prompt": "You are a weather desk.", "tools": [WEATHER],
                      "executors": {"get_current_weather": {"default": {"temperature": 20}}}, "turns": turns})


ASKS_PARIS = {"user": "What is the current weather in Paris?", "expect": {"kind": "tool_call"},
              "reply": {"tool_calls": [{"name": "get_current_weather", "arguments": {"location": "Paris"}}]}}


def test_the_models_own_calls_are_executed_and_fed_back(sim: SimProcess) -> None:
    scenario = replace(TRIP, history="model")
    records, sent = _play(sim, scenario)
    assert sent[0] == json.loads(build_request(scenario, 0, "tiny", "").body)  # the script's first request
    first = records[0]
    (call,) = first.tool_calls
    assert call["function"]["arguments"] != '{"location":"Mariposa, CA","unit":"celsius"}'  # the sim's own
    arguments = json.loads(call["function"]["arguments"])
    assert sent[1]["messages"][2:] == [  # the model's call as returned, then the executor's result for it
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"],
         "content": execute_tool(scenario, "get_current_weather", arguments)}]
    assert sent[2]["messages"][4] == {"role": "assistant", "content": records[1].content}  # its own answer
    assert [(r.history, r.turn, r.model_round, r.off_script_turn) for r in records] == \
        [("model", i, 0, 0) for i in range(5)]  # other arguments than the script's: off script at turn 0
    assert [r.turn_kind for r in records] == ["tool_call", "any", "any", "any", "any"]  # then judged on validity
    assert all(r.valid for r in records) and first.unanswered_calls == 0


def test_the_drill_plays_an_on_script_turn_with_the_models_history(sim: SimProcess) -> None:
    ctx = RunContext(run_id="r", model="tiny", user_id="u", drill=StreamDrill(share=1.0))
    records, sent = _play(sim, replace(TRIP, history="model"), ctx)
    streamed, whole = records[:2]  # turn 0, still on script, is a tool_call turn: drilled; later ones relaxed
    assert (streamed.stream_role, whole.stream_role, streamed.turn, whole.turn) == ("stream", "whole", 0, 0)
    assert sent[1] == {k: v for k, v in sent[0].items() if k != "stream_options"} | {"stream": False}
    assert sent[2]["messages"][2]["tool_calls"] == streamed.tool_calls  # the streamed twin's answer goes on
    assert [r.stream_role for r in records[2:]] == [None] * 4 and records[2].model_round == 0


def test_a_logged_conversation_answers_from_its_recorded_results(sim: SimProcess) -> None:
    scenario = _logged()
    records, sent = _play(sim, scenario)
    assert [(r.turn, r.model_round, r.off_script_turn, r.turn_kind) for r in records] == [
        (0, 0, None, "tool_call"),  # the logged call, made again: on script, its expectation kept
        (1, 0, None, "answer"),  # the logged turn that carried the call's result, sent with the model's own
        (2, 0, 2, "answer"),  # called the clock where the log answered: off script here, judged as logged
        (2, 1, 2, "any")]  # its result fed back, no next turn: an extra round, judged on validity
    (call,) = records[0].tool_calls
    assert sent[1]["messages"][2:] == [  # the model's call and the recorded result for its arguments, in place
        {"role": "assistant", "content": None, "tool_calls": [call]},  # of the log's own call and result
        {"role": "tool", "tool_call_id": call["id"], "content": PARIS}]
    assert sent[2]["messages"][4:] == [{"role": "assistant", "content": records[1].content},  # its own answer,
                                       {"role": "user", "content": "And the local clock time there?"}]  # the log's
    assert list(sent[2]) == list(scenario.turns[2].request) and sent[2]["model"] == "tiny"  # the body as logged
    (clock,) = records[2].tool_calls
    assert clock["function"]["name"] == "local_clock" and records[2].unanswered_calls == 1
    assert sent[3]["messages"][-1] == {"role": "tool", "tool_call_id": clock["id"], "content": NO_RESULT}
    assert "k3load" in json.loads(NO_RESULT)["error"]
    assert [r.valid for r in records] == [True, True, False, True] and not records[3].tool_calls


def test_extra_rounds_are_capped_per_turn_and_per_playing(sim: SimProcess, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    calls_always = {**ASKS_PARIS, "tool_choice": "required"}  # the sim calls again after every result
    scenario = _weather_desk([calls_always, {"user": "Thanks, that is all.", "expect": {"kind": "answer"}}])
    records, sent = _play(sim, scenario)
    cap = model_history.MAX_MODEL_ROUNDS
    assert [(r.turn, r.model_round) for r in records] == [(0, k) for k in range(cap + 1)] + [(1, 0)]
    assert [r.rounds_capped for r in records] == [None] * cap + [True, None]
    assert [m["role"] for m in sent[-1]["messages"][-3:]] == ["assistant", "tool", "user"]  # calls left, moved on
    monkeypatch.setattr(model_history, "MAX_SESSION_ROUNDS", 1)
    records, _ = _play(sim, scenario)
    assert [(r.turn, r.model_round, r.rounds_capped) for r in records] == [(0, 0, None), (0, 1, True), (1, 0, None)]


def test_a_tool_result_turn_the_model_made_moot_is_skipped(sim: SimProcess) -> None:
    scenario = _weather_desk([
        {**ASKS_PARIS, "user": "Hello there, good morning."},  # no tool named: the sim answers
        {"expect": {"kind": "answer"}, "reply": {"content": "It is 20 degrees."}},  # only the call's result
        {"user": "Goodbye for now.", "expect": {"kind": "answer"}}])
    records, sent = _play(sim, scenario)
    assert [(r.turn, r.skipped_turns, r.off_script_turn) for r in records] == [(0, 1, 0), (2, 0, 0)]
    assert [f.check for f in records[0].findings if not f.ok] == ["expect.tool_call"]  # on script: as expected
    assert [m["role"] for m in sent[1]["messages"]] == ["system", "user", "assistant", "user"]


def test_a_scripted_history_sends_the_scripts_bytes(sim: SimProcess) -> None:
    records, sent = _play(sim, TRIP)
    assert [json.dumps(b, separators=(",", ":"), ensure_ascii=False).encode() for b in sent] == \
        [build_request(TRIP, i, "tiny", "").body for i in range(len(TRIP.turns))]
    assert {(r.history, r.model_round, r.off_script_turn) for r in records} == {("scripted", None, None)}


def test_the_drills_whole_twin_of_a_logged_turn_is_not_streamed(sim: SimProcess) -> None:
    scenario = _logged()
    records: list[Attempt] = []
    with ChatClient(sim.base_url) as real:
        client = Recording(real)
        ctx = RunContext(run_id="r", model="tiny", user_id="u", drill=StreamDrill(share=1.0))
        run_turn_both_ways(client, ctx, scenario, scenario.turns[0], "", records.append)
    streamed, whole = sorted(client.sent, key=lambda b: not b["stream"])
    assert "stream_options" in streamed and whole["stream"] is False and "stream_options" not in whole
    assert [r.stream_role for r in records] == ["stream", "whole"] and records[0].valid and records[1].valid


def test_without_an_answer_the_history_takes_the_scripts() -> None:
    for scenario in (replace(TRIP, history="model"), _logged()):
        history = ModelHistory(scenario, "tiny")
        ask = history.next_ask()
        history.take(ask, None)  # the request brought no answer (a timeout, a refused connection)
        assert (history.turn_index, history.model_round, history.off_script_turn) == (1, 0, None)
        again = history.next_ask()
        assert again.body(scenario, again.turn, "").body == build_request(scenario, 1, "tiny", "").body


def test_the_plan_or_the_scenario_says_who_drives() -> None:
    plan = replace(load_plan(ROOT / "plans" / "smoke.yaml"), history="model")
    assert as_played(TRIP, plan).history == "model" and drives(as_played(TRIP, plan))
    assert as_played(replace(TRIP, history="scripted"), plan).history == "scripted"
    assert not drives(as_played(TRIP, replace(plan, history="scripted")))
    control = load_scenario(ROOT / "scenarios" / "shared_prefix_control.yaml")
    independent = load_scenario(ROOT / "scenarios" / "shared_prefix_support.yaml")
    assert not drives(as_played(control, plan)) and not drives(as_played(independent, plan))  # no history to drive


def test_the_records_fields_are_written_and_read_back(tmp_path: Path) -> None:
    attempt = Attempt(run_id="r", attempt_id="a", chain_id="c", attempt=1, stage="s", scenario="x", family="agent",
                      turn=2, turn_kind="any", user_id="u", request_sha256="h", prefix_sha256="p", transport="t",
                      status="ok", send_ts=1.0, end_ts=2.0, history="model", off_script_turn=1, model_round=2,
                      unanswered_calls=1, skipped_turns=0, rounds_capped=True)
    assert Attempt.from_dict(json.loads(attempt.to_json())) == attempt
    (tmp_path / "records.jsonl").write_text(attempt.to_json() + "\n" + replace(attempt, attempt_id="b").to_json())
    assert [a.attempt_id for a in rundata.read_attempts(tmp_path / "records.jsonl")] == ["a", "b"]  # read back
    assert rundata.load_run(tmp_path).columns.rows().key_texts("attempt_id") == ["a", "b"]  # and judged


def test_only_a_model_driven_conversations_first_request_is_a_designed_body() -> None:
    """analysis/pillars/cache/reuse_replay.py measures designed reuse from the scenarios' own bodies: a model-driven
    body
    after the first request carries the model's answers, so it is left out, not misjudged."""
    from types import SimpleNamespace

    from k3load.analysis.run.lean import designed_body

    def attempt(history: str | None, turn: int, model_round: int | None = None) -> SimpleNamespace:
        return SimpleNamespace(history=history, turn=turn, model_round=model_round)

    assert designed_body(attempt(None, 3)) and designed_body(attempt("scripted", 2, None))
    assert designed_body(attempt("model", 0, 0))
    assert not designed_body(attempt("model", 0, 1)) and not designed_body(attempt("model", 1, 0))
