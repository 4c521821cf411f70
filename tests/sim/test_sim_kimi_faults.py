"""Kimi's known tool-call failures in the sim (issue 13), and the parallel calls they need, seen from a
client over real HTTP: each fault shows its wire symptom on the streamed path while the stream:false
twin of the same request stays right, and healthy twins at temperature 0 answer identically.
The clause rule of parallel calls and the draw order are checked without sockets."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from k3load.client import result as res
from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult
from k3load.sim.config import FaultProfile, ProfileError, load_profile
from k3load.sim.faults import FaultDecision, decide
from k3load.sim.generate import MAX_PARALLEL_CALLS, choose_tools, plan_output, truncate
from k3load.sim.protocol import piece_delta
from k3load.sim.stream_parser import apply_streaming

WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Retrieves the current weather conditions for a specified location.",
    "parameters": {"type": "object", "required": ["location"], "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
SNOW = {"type": "function", "function": {
    "name": "get_snow_report", "description": "Retrieves the latest snow report for a specified location, providing "
    "details about the snow conditions and weather.", "parameters": {"type": "object", "required": ["location"],
                                                                       "properties": {"location": {"type": "string"}}}}}
TWO_CITIES = "Could you tell me the current weather conditions for Boston, MA and also for San Francisco?"


def _body(question: str = TWO_CITIES, stream: bool = True, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": question}], "tools": [WEATHER, SNOW],
            "tool_choice": "auto", "parallel_tool_calls": True, "temperature": 0, "max_tokens": 200,
            "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _send(sim: Any, body: dict[str, Any]) -> StreamResult:
    with ChatClient(sim.base_url) as client:
        got = client.send(json.dumps(body).encode(), 30.0)
    assert got.status == res.STATUS_OK, got
    return got


def _twins(sim: Any, **extra: Any) -> tuple[StreamResult, StreamResult]:
    """The same request streamed and whole (the body differs only in stream and stream_options)."""
    return _send(sim, _body(stream=True, **extra)), _send(sim, _body(stream=False, **extra))


def _calls(got: StreamResult) -> list[tuple[str | None, str | None, str]]:
    return [(c.id, c.name, c.arguments) for c in got.tool_calls]


def _raw_stream(sim: Any, body: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """Every `data:` chunk with its arrival time (perf_counter), to see deltas the client merges."""
    out = []
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{sim.base_url}/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append((time.perf_counter(), json.loads(line[6:])))
    return out


def _tool_deltas(chunks: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, list[Any]]]:
    return [(t, c["choices"][0]["delta"]["tool_calls"]) for t, c in chunks
            if c.get("choices") and "tool_calls" in c["choices"][0]["delta"]]


# -- the clause rule and the draw order, no sockets ------------------------------------------------

def _names(question: str, **extra: Any) -> list[str]:
    return [t["function"]["name"] for t in choose_tools(_body(question, **extra))]


def test_parallel_clause_rule():
    assert _names(TWO_CITIES) == ["get_current_weather"] * 2
    assert _names("What's the snow like in the two cities of Paris and Bordeaux?") == ["get_snow_report"] * 2
    assert _names("Give me the snow report for Aspen, CO and the current weather in Denver, CO.") == \
        ["get_snow_report", "get_current_weather"]
    assert _names("What is the current weather in Paris? Thanks a lot.") == ["get_current_weather"]  # not joined
    assert _names("tell me a joke and also a riddle") == []  # auto without tool words: an answer
    assert _names(TWO_CITIES, parallel_tool_calls=False) == ["get_current_weather"]  # one call, as before
    body = _body(TWO_CITIES)
    del body["parallel_tool_calls"]
    assert [t["function"]["name"] for t in choose_tools(body)] == ["get_current_weather"]
    named = {"type": "function", "function": {"name": "get_snow_report"}}
    assert _names(TWO_CITIES, tool_choice=named) == ["get_snow_report"]  # a named tool is one call
    assert _names("tell me a joke", tool_choice="required") == ["get_current_weather"]  # falls back
    many = " and ".join(f"the current weather in city {i}" for i in range(12))
    assert len(_names(many)) == MAX_PARALLEL_CALLS


def test_profiles_without_the_new_faults_draw_as_before():
    """Nine draws, as before issue 13: the answer planned from the same generator stays the same."""
    for profile in (FaultProfile(), FaultProfile(http_error_rate=0.5, weak_answer_rate=0.0)):
        drawn, counted = random.Random(5), random.Random(5)
        decide(profile, drawn, 0.1)
        for _ in range(9):
            counted.random()
        assert drawn.random() == counted.random()
    drawn, counted = random.Random(5), random.Random(5)
    decide(FaultProfile(parallel_call_drop_rate=0.5, missing_think_transition_rate=0.5), drawn, 0.1)
    for _ in range(11):
        counted.random()
    assert drawn.random() == counted.random()  # the new draws come last, only when set


@pytest.mark.parametrize(("text", "field"), [
    ("stream_empty_tool_calls_rate: 1.5", "faults.stream_empty_tool_calls_rate"),
    ("stream_empty_tool_calls_min_running: -1", "faults.stream_empty_tool_calls_min_running"),
    ("stream_empty_tool_calls_min_running: 2.5", "stream_empty_tool_calls_min_running"),
    ("tool_args_burst_ms: -5", "faults.tool_args_burst_ms"),
    ("tool_args_burst_rate: -0.1", "faults.tool_args_burst_rate"),
    ("parallel_call_drop_rate: 2", "faults.parallel_call_drop_rate"),
    ("parallel_call_merge_rate: lots", "parallel_call_merge_rate"),
    ("parallel_call_duplicate_rate: 1.01", "faults.parallel_call_duplicate_rate"),
    ("missing_think_transition_rate: -1", "faults.missing_think_transition_rate"),
])
def test_bad_new_fault_settings_name_the_field(tmp_path: Path, text: str, field: str):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"faults:\n  {text}\n")
    with pytest.raises(ProfileError, match=field):
        load_profile(bad)
    good = tmp_path / "good.yaml"
    good.write_text("faults:\n  stream_empty_tool_calls_rate: 1\n  stream_empty_tool_calls_min_running: 6\n"
                    "  tool_args_burst_rate: 0.5\n  tool_args_burst_ms: 120000\n")
    faults = load_profile(good).faults
    assert faults.stream_empty_tool_calls_min_running == 6 and faults.tool_args_burst_ms == 120000.0


# -- healthy: parallel calls and temperature-0 twins -----------------------------------------------

@pytest.mark.parametrize("style", ["k2", "k3"])
def test_parallel_calls_streamed_and_whole_agree(start_sim, style):
    sim = start_sim("--tool-call-style", style)
    stream, whole = _twins(sim)
    assert _calls(stream) == _calls(whole) and stream.finish_reason == whole.finish_reason == "tool_calls"
    assert [c.id for c in stream.tool_calls] == ["functions.get_current_weather:0", "functions.get_current_weather:1"]
    for call in stream.tool_calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    deltas = _tool_deltas(_raw_stream(sim, _body()))
    headers = [d[0]["index"] for _, d in deltas if "id" in d[0]]
    assert headers == [0, 1]
    assert len(deltas) == 2 if style == "k3" else len(deltas) > 2  # K3 whole calls, K2 argument pieces
    mixed = _send(sim, _body("Give me the snow report for Aspen, CO and the current weather in Denver, CO."))
    assert [c.name for c in mixed.tool_calls] == ["get_snow_report", "get_current_weather"]
    single = _send(sim, _body(parallel_tool_calls=False))
    assert [c.id for c in single.tool_calls] == ["functions.get_current_weather:0"]


def test_temperature_zero_twins_and_retries_answer_identically(start_sim):
    sim = start_sim("--tool-call-style", "k2")
    for question in (TWO_CITIES, "Summarise the plan for the week"):
        stream, whole = _twins(sim, messages=[{"role": "user", "content": question}])
        again = _send(sim, _body(stream=True, messages=[{"role": "user", "content": question}]))
        for got in (whole, again):
            assert (got.content, got.reasoning, _calls(got), got.finish_reason) == \
                (stream.content, stream.reasoning, _calls(stream), stream.finish_reason)
            assert got.completion_tokens == stream.completion_tokens
    warm = [_send(sim, _body("Summarise the plan", stream=False, temperature=0.7)).content for _ in range(3)]
    assert len(set(warm)) > 1  # sampling: a repeat of the same body draws again


def test_a_weak_model_at_temperature_zero_fails_the_same_request_every_time(start_sim):
    """The weak answer is the model's: a control pair's warm twin (the cold one's bytes again) and a
    streamed/whole pair fail together, so a cache is never blamed for a weak model; sampled requests
    draw per attempt."""
    sim = start_sim("--weak-answer-rate", "0.5")

    def weak(got: StreamResult) -> bool:
        return not got.content and not got.tool_calls

    outcomes = []
    for salt in range(12):
        body = _body(f"Session {salt}. Summarise the plan for the week", tools=None, tool_choice=None)
        body = {k: v for k, v in body.items() if v is not None}
        cold, warm = _send(sim, body), _send(sim, body)
        whole = _send(sim, {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False})
        assert weak(cold) == weak(warm) == weak(whole), salt
        outcomes.append(weak(cold))
    assert 0 < sum(outcomes) < len(outcomes), outcomes  # the rate still applies across requests
    sampled = _body("Summarise the plan", tools=None, tool_choice=None, temperature=0.7)
    sampled = {k: v for k, v in sampled.items() if v is not None}
    assert len({weak(_send(sim, sampled)) for _ in range(12)}) == 2  # per attempt: 0.5**11 to fail by chance


# -- each fault: the streamed symptom, the whole twin right ----------------------------------------

def test_stream_empty_tool_calls(start_sim):
    sim = start_sim("--stream-empty-tool-calls-rate", "1", "--tool-call-style", "k2")
    healthy = start_sim("--tool-call-style", "k2")
    stream, whole = _twins(sim)
    assert stream.tool_calls == [] and stream.finish_reason == "tool_calls"
    assert len(whole.tool_calls) == 2 and _calls(whole) == _calls(_send(healthy, _body(stream=False)))
    chunks, right = _raw_stream(sim, _body()), _raw_stream(healthy, _body())
    assert len(chunks) == len(right)  # the same chunks, each tool-call delta emptied
    deltas = _tool_deltas(chunks)
    assert len(deltas) == len(_tool_deltas(right)) and all(d == [] for _, d in deltas)


def test_stream_empty_tool_calls_only_under_load(start_sim):
    sim = start_sim("--stream-empty-tool-calls-rate", "1", "--stream-empty-tool-calls-min-running", "4",
                    "--step-base-ms", "100")
    assert len(_send(sim, _body()).tool_calls) == 2  # alone in the engine: right

    def one(stream: bool) -> int:
        return len(_send(sim, _body(stream=stream)).tool_calls)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streamed = list(pool.map(one, [True] * 6))
    assert streamed.count(2) >= 3 and streamed.count(0) >= 1, streamed  # arrivals 1-3 saw fewer than 4
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, [False] * 6)) == [2] * 6  # the whole path never


def test_tool_args_burst_after_a_silence(start_sim):
    sim = start_sim("--tool-args-burst-rate", "1", "--tool-args-burst-ms", "6000", "--tool-call-style", "k2")
    chunks = _raw_stream(sim, _body())
    deltas = _tool_deltas(chunks)
    assert len(deltas) == 2 and all("id" in d[0] and json.loads(d[0]["function"]["arguments"]) for _, d in deltas)
    first = next(i for i, (_, c) in enumerate(chunks) if c.get("choices") and "tool_calls" in c["choices"][0]["delta"])
    assert chunks[first][0] - chunks[first - 1][0] >= 0.55  # 6,000 model ms at time scale 0.1
    stream, whole = _twins(sim)
    assert _calls(stream) == _calls(whole) and len(whole.tool_calls) == 2
    start = time.perf_counter()
    _send(sim, _body(stream=False))
    assert time.perf_counter() - start < 0.55  # the whole path has no silence


def test_parallel_call_dropped(start_sim):
    sim = start_sim("--parallel-call-drop-rate", "1")
    stream, whole = _twins(sim)
    assert _calls(stream) == _calls(whole)[:1] and stream.finish_reason == "tool_calls"
    assert len(whole.tool_calls) == 2
    single = _send(sim, _body(parallel_tool_calls=False))
    assert len(single.tool_calls) == 1  # one call: nothing to drop


@pytest.mark.parametrize("style", ["k2", "k3"])
def test_parallel_calls_merged(start_sim, style):
    sim = start_sim("--parallel-call-merge-rate", "1", "--tool-call-style", style)
    stream, whole = _twins(sim)
    (merged,) = stream.tool_calls  # the client reassembled it without a rename
    assert merged.id == whole.tool_calls[0].id and merged.name == whole.tool_calls[0].name
    assert merged.arguments == whole.tool_calls[0].arguments + whole.tool_calls[1].arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(merged.arguments)
    names = [d[0]["function"].get("name") for _, d in _tool_deltas(_raw_stream(sim, _body()))]
    assert [n for n in names if n] == ["get_current_weather"]  # no delta names a call twice


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_call_duplicated(start_sim, parallel):
    sim = start_sim("--parallel-call-duplicate-rate", "1")
    stream, whole = _twins(sim, parallel_tool_calls=parallel)
    *kept, again = stream.tool_calls
    assert [(c.id, c.name, c.arguments) for c in kept] == _calls(whole)
    assert (again.id, again.arguments) == (whole.tool_calls[-1].id, whole.tool_calls[-1].arguments)
    assert again.index == len(whole.tool_calls) and stream.finish_reason == "tool_calls"


@pytest.mark.parametrize("style", ["k2", "k3"])
def test_missing_think_transition_on_both_paths(start_sim, style):
    sim = start_sim("--missing-think-transition-rate", "1", "--tool-call-style", style)
    for got in _twins(sim):
        assert got.content == "" and got.tool_calls == [] and got.finish_reason == "stop"
        assert got.reasoning.startswith("Let me think") and '<|open|>call tool="get_current_weather"' in got.reasoning
    answer = _send(sim, _body("Summarise the plan", stream=False))
    assert answer.content == "" and "<|open|>response<|sep|>" in answer.reasoning
    plain = start_sim("--missing-think-transition-rate", "1", "--reasoning-tokens", "0")
    assert len(_send(plain, _body()).tool_calls) == 2  # no reasoning: nothing to stay in


def test_streaming_rewrites_keep_one_piece_per_token_and_k2_cuts_keep_their_call():
    """The streamed twin generated the same tokens: usage and timing stay the whole twin's. A K2 call
    cut by max_tokens keeps its header's call (it used to be dropped, and the header then had none)."""
    for style in ("k2", "k3"):
        plan = plan_output(_body(), random.Random(1), 5, 10, style)
        for fault in (FaultDecision(parallel_call_drop=True), FaultDecision(parallel_call_merge=True),
                      FaultDecision(parallel_call_duplicate=True), FaultDecision(tool_args_burst_s=1.0),
                      FaultDecision(stream_empty_tool_calls=True)):
            assert len(apply_streaming(plan, fault, True).pieces) == len(plan.pieces), (style, fault)
        assert apply_streaming(plan, FaultDecision(stream_empty_tool_calls=True), False) == plan  # not crowded
    k2 = plan_output(_body(), random.Random(1), 5, 10, "k2")
    cut = truncate(k2, 12, False, random.Random(1))
    assert cut.finish_reason == "length" and [c["id"] for c in cut.tool_calls] == [k2.tool_calls[0]["id"]]
    assert next(piece_delta(p, cut) for p in cut.pieces if p.kind == "tool_header")["tool_calls"][0]["id"]
