"""`k3load import`: an agent's log -> logged scenarios that send every request as logged (issue 28).

Unit and property tests here (no server); tests/sim/test_traffic_bfcl.py imports BFCL's real tool definitions
and plays them against the sim.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3load.cli import main
from k3load.traffic import sample, scenario_files
from k3load.traffic.exchanges import Exchange, read_exchanges
from k3load.traffic.threads import rebuild
from k3load.workload.scenario import load_scenario, load_scenarios
from k3load.workload.stored_requests import build_request, compact

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def conversation(system: str, questions: list[str], *, model: str = "gpt-agent", tools: bool = True,
                 order: str = "model-first") -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(body, answer message) per turn of one agent conversation: a call, its result, an answer, per question."""
    out: list[tuple[dict[str, Any], dict[str, Any]]] = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for q, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        for step in ("call", "answer"):
            body: dict[str, Any] = {"model": model, "messages": list(messages), "temperature": 0.3, "top_p": 0.9}
            if order == "messages-first":
                body = {"messages": body["messages"], "top_p": 0.9, "model": model, "temperature": 0.3}
            if tools:
                body["tools"] = TOOLS
            if step == "call" and tools:
                call = {"id": f"call_{q}", "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": question[-5:]})}}
                answer = {"role": "assistant", "content": None, "tool_calls": [call]}
                out.append((body, answer))
                messages += [answer, {"role": "tool", "tool_call_id": f"call_{q}", "content": f"sunny in {q}"}]
            else:
                answer = {"role": "assistant", "content": f"It is sunny ({q})."}
                out.append((body, answer))
                messages.append(answer)
                break
    return out


def write_log(path: Path, lines: list[Any]) -> Path:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def import_args(*args: str | Path) -> int:
    return main(["import", *map(str, args)])


def played_bodies(out: Path, model: str = "served") -> dict[str, list[dict[str, Any]]]:
    scenarios = load_scenarios(sorted(out.glob("*.yaml")))
    return {s.name: [json.loads(build_request(s, t.index, model).body) for t in s.turns] for s in scenarios}


def as_sent(body: dict[str, Any], model: str = "served") -> dict[str, Any]:
    return {k: (model if k == "model" else v) for k, v in body.items()}


def test_interleaved_conversations_are_rebuilt_and_sent_exactly_as_logged(tmp_path: Path) -> None:
    one = conversation("You help with trips.", ["Weather in Paris", "And in Osaka"])
    two = conversation("You help with trips.", ["Weather in Quito"], order="messages-first")
    lines = [one[0], two[0], one[1], two[1], one[2], one[3]]
    log = write_log(tmp_path / "agent.jsonl", [{"request": b, "response": {"choices": [{"message": a}]}}
                                               for b, a in lines])
    assert import_args(log, "--name", "Trips!", "--out", tmp_path / "out", "--no-redact") == 0
    bodies = played_bodies(tmp_path / "out")
    assert sorted(bodies) == ["trips_0001", "trips_0002"]
    assert bodies["trips_0001"] == [as_sent(b) for b, _ in one]
    assert bodies["trips_0002"] == [as_sent(b) for b, _ in two]
    # key order as logged, all the way down (compact bytes compare order too)
    assert [compact(b) for b in bodies["trips_0002"]] == [compact(as_sent(b)) for b, _ in two]
    assert list(bodies["trips_0002"][0]) == ["messages", "top_p", "model", "temperature", "tools"]
    first = load_scenario(tmp_path / "out" / "trips_0001.yaml")
    assert [t.kind for t in first.turns] == ["tool_call", "answer", "tool_call", "answer"]
    assert first.turns[0].expect == {"kind": "tool_call", "tools": ["get_weather"]}
    assert first.source["lines"] == [f"{log}:{n}" for n in (1, 3, 5, 6)]
    assert first.source["logged_model"] == "gpt-agent"
    assert first.executors["get_weather"]["table"][0] == {"match": {"city": "Paris"}, "result": "sunny in 0"}
    summary = json.loads((tmp_path / "out" / "import.json").read_text())
    assert summary["conversations"] == 2 and summary["turns"] == 6 and summary["redaction"] == {"enabled": False}


def test_answers_come_from_the_next_request_where_the_log_has_none(tmp_path: Path) -> None:
    turns = conversation("sys", ["Weather in Paris"])
    log = write_log(tmp_path / "bare.jsonl.gz", [b for b, _ in turns])
    assert import_args(log, "--name", "bare", "--out", tmp_path / "out", "--no-redact") == 0
    scenario = load_scenario(tmp_path / "out" / "bare_0001.yaml")
    assert scenario.turns[0].expect == {"kind": "tool_call", "tools": ["get_weather"]}  # echoed by turn 2
    assert scenario.turns[1].expect == {"kind": "any"}  # the last turn: nothing recorded
    assert scenario.source["turns_without_answer"] == [1]
    assert "turn index 1 (from 0) without a recorded answer: judged on validity alone" in scenario.description


def test_openai_batch_input_joined_with_its_output(tmp_path: Path) -> None:
    turns = conversation("sys", ["Weather in Paris"])
    inputs = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
              for i, (b, _) in enumerate(turns)]
    outputs = [{"id": f"b{i}", "custom_id": f"r{i}", "error": None,
                "response": {"status_code": 200, "body": {"object": "chat.completion", "choices": [{"message": a}]}}}
               for i, (_, a) in reversed(list(enumerate(turns)))]
    batch_in, batch_out = write_log(tmp_path / "in.jsonl", inputs), write_log(tmp_path / "out.jsonl", outputs)
    assert import_args(batch_in, batch_out, "--name", "nightly", "--out", tmp_path / "d", "--no-redact") == 0
    scenario = load_scenario(tmp_path / "d" / "nightly_0001.yaml")
    assert [t.kind for t in scenario.turns] == ["tool_call", "answer"]
    assert scenario.turns[1].recorded == {"content": "It is sunny (0)."}
    exchanges, problems = read_exchanges([batch_out])  # an output file alone: each answer is named
    assert not exchanges and len(problems) == 2 and "no input line has" in problems[0].reason


def test_bad_lines_are_named_and_strict_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = conversation("sys", ["hello"], tools=False)[0][0]
    log = write_log(tmp_path / "mixed.jsonl", [
        body, "{not json", {"prompt": "a completions request"}, "", [1, 2],
        {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}},
        {"messages": [{"content": "no role"}]}, '{"messages": [' * 100 + "]" * 100, "x" * 3000])
    problems = read_exchanges([log], max_line_bytes=2048)[1]
    assert [p.where for p in problems] == [f"{log}:{n}" for n in (2, 3, 5, 6, 7, 8, 9)]
    reasons = [p.reason for p in problems]
    assert reasons[0].startswith("not JSON") and "no `messages`" in reasons[1]
    assert "embeddings" in reasons[3] and "no `role`" in reasons[4] and "nested" in reasons[5]
    assert reasons[6] == "over the body cap of 2,048 bytes"
    assert import_args(log, "--name", "m", "--out", tmp_path / "strict", "--strict", "--max-line-bytes", "2048") == 2
    assert not (tmp_path / "strict").exists()
    assert f"--strict: 7 line(s) refused, first {log}:2: not JSON" in capsys.readouterr().err
    assert import_args(log, "--name", "m", "--out", tmp_path / "lax", "--max-line-bytes", "2048") == 0
    err = capsys.readouterr().err
    assert f"refused {log}:9: over the body cap" in err
    summary = json.loads((tmp_path / "lax" / "import.json").read_text())
    assert summary["refused_lines"] == 7 and summary["written"] == 1


@pytest.mark.parametrize("setup, said", [
    ("missing", "cannot read the log"), ("nonempty", "exists and is not an empty folder"),
    ("no_chat", "no chat request in"), ("bad_gzip", "cannot read the log"), ("bad_pattern", "--redact-pattern")])
def test_nothing_is_written_when_the_import_cannot_be_made(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           setup: str, said: str) -> None:
    log = write_log(tmp_path / "a.jsonl", [conversation("s", ["hi"], tools=False)[0][0]])
    out, extra = tmp_path / "out", []
    if setup == "missing":
        log = tmp_path / "nope.jsonl"
    elif setup == "nonempty":
        out.mkdir()
        (out / "old.yaml").write_text("x")
    elif setup == "no_chat":
        log = write_log(tmp_path / "b.jsonl", [{"prompt": "x"}])
    elif setup == "bad_gzip":
        log = tmp_path / "c.jsonl.gz"
        log.write_bytes(gzip.compress(b'{"messages": []}\n' * 50)[:40])
    else:
        extra = ["--redact-pattern", "(unclosed"]
    assert import_args(log, "--name", "n", "--out", out, *extra) == 2
    assert said in capsys.readouterr().err
    assert not out.exists() or [p.name for p in out.iterdir()] == (["old.yaml"] if setup == "nonempty" else [])


def test_sessions_that_open_alike_keep_their_own_turns() -> None:
    """Two sessions of one agent open with the same messages (a scheduled agent's prompt and question) but
    are other sessions (`user`): each continuation goes to its own session, not to the latest alike."""
    a = conversation("nightly report", ["Weather in Paris"])
    b = json.loads(json.dumps(a))
    for body, _ in a:
        body["user"] = "sess-A"
    for body, _ in b:
        body["user"] = "sess-B"
        body["messages"][-1]["content"] += " (B)" if body["messages"][-1]["role"] == "tool" else ""
    order = [a[0][0], b[0][0], a[1][0], b[1][0]]
    conversations, _ = rebuild([Exchange(f"l:{i}", body) for i, body in enumerate(order)])
    assert [[e.where for e in c.turns] for c in conversations] == [["l:0", "l:2"], ["l:1", "l:3"]]


def test_a_lone_surrogate_is_refused_by_its_line_not_sent(tmp_path: Path) -> None:
    log = write_log(tmp_path / "s.jsonl", ['{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
                                           '{"messages": [{"role": "user", "content": "ok \\ud83d\\ude00"}]}'])
    exchanges, problems = read_exchanges([log])
    assert [p.where for p in problems] == [f"{log}:1"] and "lone surrogate" in problems[0].reason
    assert exchanges[0].body["messages"][0]["content"] == "ok \U0001f600"


def test_a_refused_line_quotes_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A reason quotes the line (a Batch url, a custom_id, a duplicated key): redacted like the bodies."""
    key, mail = "sk-proj-abcdefghijklmnop1234567890", "alice@acme.io"
    body = conversation("s", ["hi"], tools=False)[0][0]
    log = write_log(tmp_path / "k.jsonl", [
        {"custom_id": "x", "method": "POST", "url": f"/v1/chat/completions?key={key}", "body": body},
        {"custom_id": mail, "response": {"status_code": 200, "body": {}}},
        '{"messages": [], "owner ' + mail + '": 1, "owner ' + mail + '": 2}', body])
    assert import_args(log, "--name", "k", "--out", tmp_path / "o") == 0
    shown = capsys.readouterr().err + "".join(p.read_text() for p in (tmp_path / "o").iterdir())
    assert "refused" in shown and key not in shown and mail not in shown


def test_identical_requests_are_counted_once_and_forks_keep_their_history(tmp_path: Path) -> None:
    turns = conversation("sys", ["Weather in Paris"])
    fork = json.loads(json.dumps(turns[1][0]))
    fork["messages"][-1]["content"] = "cloudy"  # another result for the same call: a second branch
    exchanges = [Exchange(f"l:{i}", b) for i, b in enumerate([turns[0][0], turns[0][0], turns[1][0], fork])]
    conversations, duplicates = rebuild(exchanges)
    assert duplicates == 1 and conversations[0].duplicates == 1
    assert [len(c.turns) for c in conversations] == [2, 1]
    assert conversations[1].added[0] == fork["messages"]  # the fork carries its whole history


def test_sample_is_representative_by_tool_set_and_length() -> None:
    many = [Exchange(f"l:{i}", {"messages": [{"role": "user", "content": f"short {i}"}]}) for i in range(40)]
    rare = [Exchange("l:tools", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}),
            Exchange("l:long", {"messages": [{"role": "user", "content": "y" * 50_000}]})]
    conversations, _ = rebuild(many + rare)
    picked = sample.representative(conversations, 6)
    assert len(picked) == 6
    assert {p.turns[0].where for p in picked} >= {"l:tools", "l:long"}  # the rare kinds are kept
    assert picked == sample.representative(conversations, 6)  # deterministic
    assert sample.quotas([5, 3, 1], 20) == [5, 3, 1] and sum(sample.quotas([50, 30, 1], 10)) == 10


JSON_LEAF = st.none() | st.booleans() | st.integers(-2**53, 2**53) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30)
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=4) |
                          st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(extra=st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in ("messages", "model")),
                             JSON_VALUE, max_size=5),
       contents=st.lists(st.text(max_size=40), min_size=1, max_size=4), data=st.data())
def test_any_logged_body_survives_the_scenario_file_as_logged(tmp_path_factory: pytest.TempPathFactory,
                                                              extra: dict[str, Any], contents: list[str],
                                                              data: st.DataObject) -> None:
    """Whatever keys, values and order an agent's body has, the file plays it back as logged (the model
    aside): strings YAML would misread, keys in any order, numbers, nesting, unicode."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    keys = data.draw(st.permutations(["model", "messages", *extra]))
    values = {"model": "m", "messages": messages, **extra}
    body = {k: values[k] for k in keys}
    conversations, _ = rebuild([Exchange("f:1", body)])
    text = scenario_files.to_yaml(scenario_files.scenario_of(conversations[0], "p_0001", "agent", "f"))
    path = tmp_path_factory.mktemp("rt") / "p_0001.yaml"
    path.write_text(text, encoding="utf-8")
    scenario = load_scenario(path)
    assert build_request(scenario, 0, "served").body == compact(as_sent(body))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 5), min_size=1, max_size=6), seed=st.integers(0, 10_000))
def test_interleaved_logs_rebuild_into_the_conversations_they_were(lengths: list[int], seed: int) -> None:
    """Conversations of any length, their requests interleaved in any order that keeps each one's own
    order, come back as they were: no turn lost, merged or moved."""
    convs = [conversation(f"system {i}", [f"question {i}-{q}" for q in range(n)]) for i, n in enumerate(lengths)]
    rng = random.Random(seed)
    queues = [list(c) for c in convs]
    order: list[tuple[int, dict[str, Any]]] = []
    while any(queues):
        i = rng.choice([k for k, q in enumerate(queues) if q])
        order.append((i, queues[i].pop(0)[0]))
    rebuilt, duplicates = rebuild([Exchange(f"c{i}", b) for i, b in order])
    assert duplicates == 0
    def key(bodies: list[dict[str, Any]]) -> str:
        return json.dumps(bodies)

    assert sorted(map(key, ([e.body for e in c.turns] for c in rebuilt))) == \
        sorted(map(key, ([b for b, _ in c] for c in convs)))


def test_every_written_file_loads_with_the_shipped_schema(tmp_path: Path) -> None:
    """The summary and scenarios together: DIR/*.yaml is exactly the scenarios, each strict-valid; a repeated
    tool list is written once (a YAML alias)."""
    turns = conversation("sys", ["Weather in Paris", "And Rome"])
    log = write_log(tmp_path / "a.jsonl", [b for b, _ in turns])
    assert import_args(log, "--name", "a", "--out", tmp_path / "o", "--no-redact") == 0
    text = (tmp_path / "o" / "a_0001.yaml").read_text()
    assert text.count("Weather of a city.") == 1  # the tool list once, then its alias
    assert "*id" in text
    assert yaml.safe_load(text)["mode"] == "logged"
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["a_0001.yaml", "import.json"]
    assert oct((tmp_path / "o" / "a_0001.yaml").stat().st_mode & 0o777) == "0o600"


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(st.binary(max_size=200) | JSON_VALUE.map(lambda v: json.dumps(v).encode()) |
                      st.fixed_dictionaries({"messages": st.lists(st.dictionaries(st.sampled_from(
                          ["role", "content", "tool_calls"]), JSON_VALUE, max_size=3), max_size=3)},
                          optional={"custom_id": JSON_VALUE, "body": JSON_VALUE, "request": JSON_VALUE,
                                    "response": JSON_VALUE}).map(lambda v: json.dumps(v).encode()),
                      max_size=8))
def test_any_bytes_in_a_log_are_read_or_named_never_raised(tmp_path_factory: pytest.TempPathFactory,
                                                           lines: list[bytes]) -> None:
    """Every line of arbitrary bytes is a usable request or a problem naming its file:line; nothing raises,
    and whatever was read rebuilds and writes as a scenario file that loads."""
    folder = tmp_path_factory.mktemp("fuzz")
    log = folder / "log.jsonl"
    log.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
    exchanges, problems = read_exchanges([log], max_line_bytes=150)
    assert all(re.fullmatch(re.escape(str(log)) + r":\d+", p.where) and p.reason for p in problems)
    non_blank = sum(1 for line in lines if line.replace(b"\n", b" ").strip())
    assert len(exchanges) + len(problems) >= non_blank - sum(1 for line in lines if b'"custom_id"' in line)
    conversations, _ = rebuild(exchanges)
    for i, c in enumerate(conversations):
        path = folder / f"f_{i}.yaml"
        path.write_text(scenario_files.to_yaml(scenario_files.scenario_of(c, f"f_{i}", "agent", "log.jsonl")))
        scenario = load_scenario(path)
        assert [json.loads(build_request(scenario, t.index, "m").body)["messages"] for t in scenario.turns] == \
            [as_sent(e.body, "m")["messages"] for e in c.turns]


def test_a_streamed_answer_as_a_proxy_logged_it_is_the_recorded_answer(tmp_path: Path) -> None:
    """The answer of a streamed request, kept as its chunks or as its raw SSE text: the deltas joined."""
    body = conversation("sys", ["Weather in Paris"])[0][0]
    chunks = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]} for delta in (
        {"role": "assistant", "reasoning_content": "Let me "}, {"reasoning_content": "check."},
        {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]})]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    log = write_log(tmp_path / "s.jsonl", [{"request": body, "response": chunks}, {"request": body | {"seed": 1},
                                                                                   "response": sse}])
    exchanges, problems = read_exchanges([log])
    assert not problems
    for exchange in exchanges:
        assert exchange.answer == {"role": "assistant", "content": None, "reasoning_content": "Let me check.",
                                   "tool_calls": [{"type": "function", "id": "call_9", "function": {
                                       "arguments": '{"city": "Paris"}', "name": "get_weather"}}]}


CALL_DELTA = st.dictionaries(st.sampled_from(["index", "id", "function", "type"]),
                             JSON_VALUE | st.dictionaries(st.sampled_from(["name", "arguments"]), JSON_VALUE))
CHUNK = st.fixed_dictionaries({"choices": st.lists(st.fixed_dictionaries({"delta": st.dictionaries(
    st.sampled_from(["content", "reasoning_content", "reasoning", "tool_calls", "role"]),
    JSON_VALUE | st.lists(CALL_DELTA, max_size=3))}), max_size=2)})


@settings(max_examples=200, deadline=None)
@example(response='data:{"choices":[{"delta":{"tool_calls":10}}]}')  # found by this test: not a list
@given(response=st.lists(CHUNK | JSON_VALUE, max_size=6) | st.text(max_size=300) | JSON_VALUE |
       st.lists(CHUNK, max_size=5).map(lambda cs: "".join(f"data: {json.dumps(c)}\n\n" for c in cs)))
def test_any_recorded_answer_is_read_or_ignored_never_raised(response: Any) -> None:
    from k3load.traffic.exchanges import answer_of
    from k3load.traffic.expectations import recorded_answer

    answer = answer_of(response)
    assert answer is None or isinstance(answer, dict)
    recorded = recorded_answer(answer)
    assert recorded is None or set(recorded) <= {"content", "reasoning", "tool_calls"}


@settings(max_examples=150, deadline=None)
@given(value=JSON_VALUE)
def test_libyaml_and_the_pure_parser_read_a_written_file_alike(value: Any) -> None:
    """k3load.yamlfile reads with libyaml first: for whatever an import writes, both parsers agree."""
    text = scenario_files.to_yaml({"value": value})
    assert yaml.load(text, Loader=yaml.CSafeLoader) == yaml.load(text, Loader=yaml.SafeLoader) == {"value": value}
