"""One record per request sent, whatever happens next (issue 37 items 1 and 7), on a fake client (no sockets):
an exception of ours while reading, timing, validating, comparing or recording an answer leaves exactly one
record with a `harness.error` finding; the agent pillar says "inconclusive, because the harness could not judge
N answers (...)"; the console says each kind at 1, 10, 100 ...; the run's-end summary counts them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from k3load.analysis.pillars.agent.pillar_agent import judge_agent_api
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
from k3load.client.result import StreamResult, ToolCall
from k3load.events import Event
from k3load.loadgen import console
from k3load.outcomes import CLIENT, FAIL, HARNESS_ERROR, INCONCLUSIVE, PASS
from k3load.records import Attempt, Finding
from k3load.summary import format_summary, unjudged
from k3load.workload import conversation
from k3load.workload.conversation import RunContext, StreamDrill, run_turn, run_turn_both_ways
from k3load.workload.harness_error import kind_of
from k3load.workload.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = load_scenario(ROOT / "scenarios" / "agent_weather_trip.yaml")
CALL = SCENARIO.turns[0]
LIMITS = DEFAULT_THRESHOLDS["agent_api"]


class FakeClient:
    """Answers every request at once with the weather call the first turn expects."""

    transport = "fake"

    def __init__(self, raises: BaseException | None = None) -> None:
        self.sent = 0
        self.raises = raises

    def send(self, body: bytes, deadline_s: float, *, headers: object = None) -> StreamResult:
        self.sent += 1
        if self.raises is not None:
            raise self.raises
        return StreamResult(status="ok", transport="fake", send_ts=100.0, end_ts=100.5, http_status=200,
                            finish_reason="tool_calls", first_token_ts=100.1, chunk_ts=[100.1],
                            tool_calls=[ToolCall(0, "c0", "get_current_weather", '{"location": "Paris, FR"}')])


def _ctx(**kw: object) -> RunContext:
    return RunContext(run_id="r", model="m", user_id="u", **kw)  # type: ignore[arg-type]


def _only_record(attempts: list[Attempt], sink: list[Attempt]) -> Attempt:
    assert len(attempts) == len(sink) == 1 and attempts[0] is sink[0]
    attempt = sink[0]
    assert [f.check for f in attempt.findings] == [HARNESS_ERROR]
    assert not attempt.valid and attempt.primary_layer == CLIENT and attempt.failed_layers == [CLIENT]
    assert not attempt.will_retry
    assert Attempt.from_dict(json.loads(attempt.to_json())).findings == attempt.findings  # the line reads back
    return attempt


def test_a_turn_whose_validation_raises_writes_exactly_one_record_as_received(monkeypatch):
    def explode(*_args, **_kw):
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")

    monkeypatch.setattr(conversation, "validate", explode)
    sink: list[Attempt] = []
    told: list[Attempt] = []
    client = FakeClient()
    attempts = run_turn(client, _ctx(on_unjudged=told.append), SCENARIO, CALL, "", sink.append)
    attempt = _only_record(attempts, sink)
    assert client.sent == 1 and told == sink  # told after its sink, once
    detail = attempt.findings[0].detail
    assert detail.startswith("RecursionError while validating the answer (k3load/workload/conversation.py:")
    assert "maximum recursion depth exceeded" in detail
    assert "recorded as received: ok, HTTP 200, " in detail and "answer bytes, sha256 " in detail
    # the answer as received stays on the record: status, timing, the call as the server sent it
    assert attempt.status == "ok" and attempt.http_status == 200 and attempt.ttft_ms == pytest.approx(100)
    assert attempt.tool_calls[0]["function"]["arguments"] == '{"location": "Paris, FR"}'


def test_a_client_that_raises_is_recorded_with_status_harness_error():
    sink: list[Attempt] = []
    attempts = run_turn(FakeClient(raises=KeyError("chunk")), _ctx(), SCENARIO, CALL, "", sink.append)
    attempt = _only_record(attempts, sink)
    assert attempt.status == "client_raised" and attempt.error == "the client raised KeyError: 'chunk'"
    assert kind_of(attempt.findings[0].detail).startswith("KeyError while sending the request or reading the answer (")
    assert "recorded as received: client_raised, no HTTP status" in attempt.findings[0].detail


def test_building_the_record_that_raises_still_writes_one(monkeypatch):
    real = conversation.make_attempt
    calls = []

    def once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise TypeError("unhashable")
        return real(*args, **kw)

    monkeypatch.setattr(conversation, "make_attempt", once)
    sink: list[Attempt] = []
    attempt = _only_record(run_turn(FakeClient(), _ctx(), SCENARIO, CALL, "", sink.append), sink)
    assert kind_of(attempt.findings[0].detail).startswith("TypeError while building the record (")
    assert attempt.ttft_ms == pytest.approx(100)  # timed before it raised

    def always(*_args, **_kw):
        raise ValueError("broken")

    monkeypatch.setattr(conversation, "make_attempt", always)
    sink = []
    bare = _only_record(run_turn(FakeClient(), _ctx(), SCENARIO, CALL, "", sink.append), sink)
    assert bare.status == "ok" and bare.e2e_ms == pytest.approx(500) and bare.http_status == 200
    assert bare.scenario == SCENARIO.name and bare.request_bytes and bare.stage == "default"


def test_a_comparison_that_raises_leaves_the_whole_twin_judged(monkeypatch):
    def explode(*_args, **_kw):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(conversation, "compare_twins", explode)
    sink: list[Attempt] = []
    run_turn_both_ways(FakeClient(), _ctx(drill=StreamDrill(share=1.0)), SCENARIO, CALL, "", sink.append)
    stream, whole = sink
    assert (stream.stream_role, whole.stream_role) == ("stream", "whole")
    assert [f.check for f in stream.findings] == [HARNESS_ERROR] and whole.valid
    assert "ZeroDivisionError while comparing the streamed and whole twins" in stream.findings[0].detail


# -- the verdict ------------------------------------------------------------------------------------
def _attempt(i: int, findings: list[Finding] | None = None) -> Attempt:
    findings = findings or [Finding("transport", True)]
    failed = [f for f in findings if not f.ok]
    return Attempt(run_id="r", attempt_id=f"a{i:04d}", chain_id=f"c{i}", attempt=1, stage="load", scenario="s",
                   family="agent", turn=0, turn_kind="tool_call", user_id="u", request_sha256=f"q{i}",
                   prefix_sha256="p", transport="t", status="ok", send_ts=float(i), end_ts=i + 0.5,
                   findings=findings, valid=not failed, failed_layers=sorted({f.layer for f in failed}),
                   primary_layer=failed[0].layer if failed else None)


RECURSION = Finding(HARNESS_ERROR, False, CLIENT, "RecursionError while validating the answer (k3load/workload/"
                    "validate.py:175 check_tool_calls): maximum recursion depth exceeded; recorded as received: ok")
BROKEN = Finding("tool_call.arguments_json", False, "parser", "call 0 (get): Expecting ','")


def test_the_agent_pillar_is_inconclusive_with_the_count_until_none_are_unjudged():
    passing = [_attempt(i) for i in range(100)]
    assert judge_agent_api(passing, LIMITS).status == PASS
    attempts = passing + [_attempt(1000 + i, [RECURSION]) for i in range(398)]
    result = judge_agent_api(attempts, LIMITS)
    assert result.status == INCONCLUSIVE
    assert result.reasons[0].startswith(
        "inconclusive, because the harness could not judge 398 answers (RecursionError while validating the answer "
        "(k3load/workload/validate.py:175 check_tool_calls) x398): they count neither as valid nor as the "
        "server's failures; each is recorded as received with a harness.error finding, the first in attempt a1000")
    numbers = result.numbers
    assert numbers["attempts"] == 100 and numbers["valid"] == 100  # judged on the others only
    assert numbers["failed_by_layer"]["client"] == 0 and "harness.error" not in numbers["failed_by_check"]
    assert numbers["unjudged"]["answers"] == 398 and numbers["unjudged"]["first_attempt"] == {
        kind_of(RECURSION.detail): "a1000"}
    assert [r["id"] for r in numbers["rules"]][:2] == ["agent.harness_errors", "agent.valid_rate"]


def test_a_failure_among_the_judged_answers_stands_unless_the_unjudged_could_undo_it():
    broken = [_attempt(i, [BROKEN]) for i in range(40)] + [_attempt(100 + i) for i in range(60)]
    unjudged_few = [_attempt(1000 + i, [RECURSION]) for i in range(3)]
    assert judge_agent_api(broken + unjudged_few, LIMITS).status == FAIL
    barely = [_attempt(i, [BROKEN]) for i in range(12)] + [_attempt(100 + i) for i in range(88)]  # 88% of 100
    assert judge_agent_api(barely, LIMITS).status == FAIL
    many = [_attempt(1000 + i, [RECURSION]) for i in range(150)]  # 238 of 250 were they valid: no longer failing
    result = judge_agent_api(barely + many, LIMITS)
    assert result.status == INCONCLUSIVE
    assert "the 150 answers the harness could not judge would carry the rate out of failing" in result.reasons[1]


# -- the console and the run's end -----------------------------------------------------------------
class Events:
    def __init__(self) -> None:
        self.lines: list[tuple[Event, dict]] = []

    def event(self, name: Event, **fields: object) -> None:
        self.lines.append((name, fields))


def test_each_kind_is_said_at_1_10_100_never_per_answer(caplog):
    events = Events()
    errors = console.HarnessErrors(lambda: events, "local 1", logging.getLogger("k3load.test"))
    other = Finding(HARNESS_ERROR, False, CLIENT, "KeyError while building the record (x.py:1 f): 'k'; recorded")
    with caplog.at_level(logging.WARNING, logger="k3load.test"):
        for i in range(150):
            errors.unjudged(_attempt(i, [RECURSION]))
        errors.unjudged(_attempt(999, [other]))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4 and "Traceback" not in "".join(said)
    assert said[0] == (f"k3load: 1 answer: {kind_of(RECURSION.detail)}; first at attempt a0000…, see events.jsonl")
    assert said[1].startswith("k3load: 10 answers: RecursionError") and said[2].startswith("k3load: 100 answers")
    assert {name for name, _ in events.lines} == {Event.ANSWER_UNJUDGED}
    assert [(f["count"], f["first_attempt_id"]) for _, f in events.lines] == [
        (1, "a0000"), (10, "a0000"), (100, "a0000"), (1, "a0999")]
    assert [console.milestone(n) for n in (1, 2, 10, 20, 100, 1000, 1001)] == [True, False, True, False, True, True,
                                                                                False]


def test_kinds_are_bounded_and_turn_failures_are_said_without_a_traceback(caplog):
    errors = console.HarnessErrors(lambda: None, "worker 2", logging.getLogger("k3load.test"))
    for i in range(console.MAX_KINDS + 20):
        errors.unjudged(_attempt(i, [Finding(HARNESS_ERROR, False, CLIENT, f"E{i} while x (y.py:1 f): m")]))
    assert len(errors.counts) == console.MAX_KINDS + 1 and errors.counts[console.OTHER] == 20
    errors = console.HarnessErrors(lambda: None, "worker 2", logging.getLogger("k3load.test"))
    with caplog.at_level(logging.WARNING, logger="k3load.test"):
        try:
            raise OSError(28, "No space left on device")
        except OSError as exc:
            errors.turn_failed(exc)
    assert caplog.records[-1].getMessage().startswith("k3load: 1 turn ended without a record: OSError while playing "
                                                      "a turn (tests/unit/test_unjudged.py:")
    assert caplog.records[-1].exc_info is None


def test_the_run_end_summary_counts_every_kind(tmp_path):
    attempts = [_attempt(i, [RECURSION]) for i in range(398)] + [_attempt(500)]
    found = unjudged(attempts)
    assert found["answers"] == 398
    text = format_summary({"all": {"attempts": 399}, "by_scenario": {}, "unjudged": found}, tmp_path)
    lines = text.splitlines()
    assert "the harness could not judge 398 answers" in lines[1]
    assert lines[2] == f"  398 answers: {kind_of(RECURSION.detail)}; first at attempt a0000…"


def test_library_request_logs_stay_off_the_console_unless_debug():
    root = logging.getLogger("k3load.test.root")
    try:
        root.setLevel(logging.DEBUG)
        logging.getLogger("httpx").setLevel(logging.NOTSET)
        console.quiet_library_logs(root)
        assert logging.getLogger("httpx").level == logging.NOTSET
        root.setLevel(logging.INFO)
        console.quiet_library_logs(root)
        assert logging.getLogger("httpx").level == logging.getLogger("httpcore").level == logging.WARNING
    finally:
        logging.getLogger("httpx").setLevel(logging.NOTSET)
        logging.getLogger("httpcore").setLevel(logging.NOTSET)


def test_a_record_names_the_stage_it_was_sent_in_not_the_one_it_ended_in():
    """A search's steps follow each other with no drain: an answer still streaming when its step is decided is
    that step's (its record is built after the stage moved on); so are a client that raised and a record that
    could not be built."""
    stage = ["find-s1-c2"]

    class SlowClient(FakeClient):
        def send(self, body: bytes, deadline_s: float, *, headers: object = None) -> StreamResult:
            stage[0] = "find-s2-c4"  # decided while this answer streamed
            return super().send(body, deadline_s, headers=headers)

    ctx, sink = _ctx(stage=lambda: stage[0]), []
    (attempt,) = run_turn(SlowClient(), ctx, SCENARIO, CALL, "", sink.append)
    assert attempt.stage == "find-s1-c2" and attempt.valid
    stage[0] = "find-s1-c2"

    class SlowRaising(SlowClient):
        def send(self, body: bytes, deadline_s: float, *, headers: object = None) -> StreamResult:
            stage[0] = "find-s2-c4"
            raise KeyError("chunk")

    (raised,) = run_turn(SlowRaising(), ctx, SCENARIO, CALL, "", [].append)
    assert raised.stage == "find-s1-c2"
