"""Time to the first answer token (TTFA): the first content or tool-call token, after any reasoning.

K3 thinks before it answers, and TTFT (the first reasoning token) hides that wait. These tests follow
the figure from the wire to the verdict: the client's `first_answer_ts` (both transports, scripted
streams), the record's `ttfa_ms` and `reasoning_ms`, the run loader's column (the fast decoder and the
whole-line reader), the stage rule `slo.ttfa_p95` (unknown, never breached, without a streamed answer),
`k3load diff`, and the sim's `--think-ms`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from k3load.analysis.decision.ramp import RAMP_COLUMNS
from k3load.analysis.diff import _stage_rules, compare_stages
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.headroom.stages import _latency, stage_breaches
from k3load.analysis.pillars.pillar import thresholds
from k3load.analysis.run import rundata
from k3load.analysis.run.record_columns import RecordColumns, Rows
from k3load.analysis.run.rundata import read_attempts
from k3load.client import result as res
from k3load.client.assemble import Assembler
from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult
from k3load.client.transport import TRANSPORTS
from k3load.records import Attempt, timing_fields
from tests.sim.chat_wire import WEATHER, body, chunk, chunked_head, raw_server, send, sse

__all__ = ["raw_server"]  # the scripted server's fixture, shared with the client's tests
GAP_S = 0.15  # between the reasoning chunks and before the answer: far above a read's jitter


def _delta(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "r1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


ROLE = _delta({"role": "assistant", "content": ""})
CALL = {"index": 0, "id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _script(*events: dict[str, Any], end: bytes = b"") -> list[tuple[float, bytes]]:
    """Each event in its own chunk after GAP_S (the role chunk at once), then [DONE] and the body's end."""
    steps = [(0.0, chunked_head() + chunk(sse(ROLE)))]
    steps += [(GAP_S, chunk(sse(event))) for event in events]
    return [*steps, (0.0, chunk(end or sse("[DONE]")) + b"0\r\n\r\n")]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_reasoning_then_content_then_a_call(raw_server: Any, transport: str) -> None:
    server = raw_server(lambda n: _script(_delta({"reasoning": "Let me"}), _delta({"reasoning": " think."}),
                                          _delta({"content": "Checking."}),
                                          _delta({"tool_calls": [CALL]}, "tool_calls")))
    r = send(server.url, transport, body())
    assert r.status == res.STATUS_OK and r.reasoning == "Let me think." and r.content == "Checking.", r
    assert r.first_token_ts == r.chunk_ts[0] and r.first_answer_ts == r.chunk_ts[2], r  # the content, not the call
    assert r.first_answer_ts - r.first_token_ts >= 2 * GAP_S * 0.9, r
    timing = timing_fields(r)
    # durations are kept to the microsecond (records.TIMING_DECIMALS): each rounds on its own
    assert timing["ttfa_ms"] == pytest.approx((r.first_answer_ts - r.send_ts) * 1000, abs=0.001)
    assert timing["reasoning_ms"] == pytest.approx(timing["ttfa_ms"] - timing["ttft_ms"], abs=0.002)
    assert timing["reasoning_ms"] > 0


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_call_after_reasoning_is_the_first_answer_token(raw_server: Any, transport: str) -> None:
    server = raw_server(lambda n: _script(_delta({"reasoning": "hm"}), _delta({"content": "", "tool_calls": []}),
                                          _delta({"tool_calls": [CALL]}, "tool_calls")))
    r = send(server.url, transport, body())
    assert r.status == res.STATUS_OK and r.tool_calls, r
    assert r.first_answer_ts == r.chunk_ts[r.tool_chunk_idx[0]] > r.first_token_ts, r  # empty deltas add nothing


def test_a_stream_of_reasoning_only_has_no_answer_token(raw_server: Any) -> None:
    server = raw_server(lambda n: _script(_delta({"reasoning": "hm"}), _delta({"reasoning": " hm"}, "length")))
    r = send(server.url, "geventhttpclient", body())
    assert r.status == res.STATUS_OK and r.first_token_ts is not None and r.first_answer_ts is None, r
    timing = timing_fields(r)
    assert "ttfa_ms" not in timing and "reasoning_ms" not in timing and timing["ttft_ms"] > 0


def test_an_answer_without_reasoning_has_its_first_token_as_its_first_answer_token(raw_server: Any) -> None:
    server = raw_server(lambda n: _script(_delta({"content": "Hi"}), _delta({"content": "!"}, "stop")))
    r = send(server.url, "httpx", body())
    assert r.first_answer_ts == r.first_token_ts is not None, r
    timing = timing_fields(r)
    assert timing["ttfa_ms"] == timing["ttft_ms"] and "reasoning_ms" not in timing  # no reasoning: unknown, not 0


def test_an_answer_token_in_an_event_never_ended_is_still_timed(raw_server: Any) -> None:
    """The decoder's last event, whose blank line never came (`_stream_end`): its answer token counts."""
    tail = b"data: " + json.dumps(_delta({"content": "late"}, "stop")).encode() + b"\n"
    server = raw_server(lambda n: _script(_delta({"reasoning": "hm"}), end=tail))
    r = send(server.url, "geventhttpclient", body())
    assert r.status == res.STATUS_TRUNCATED and r.content == "late", r
    assert r.first_answer_ts == r.chunk_ts[-1] > r.first_token_ts, r


def test_the_assembler_says_answered_only_for_content_or_a_call_part() -> None:
    asm = Assembler()
    for chunk_ in (ROLE, _delta({"reasoning": "hm"}), _delta({"content": "", "tool_calls": []}),
                   _delta({"tool_calls": [{"index": 0, "function": {"arguments": ""}}]})):
        asm.add(chunk_)
        assert not asm.answered, chunk_
    asm.add(_delta({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "w"}}]}))
    assert asm.answered
    whole = Assembler()
    whole.add_completion({"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]})
    assert not whole.answered  # a whole answer has no first answer token: the client never reads it


def _attempt(attempt_id: str, **timing: Any) -> Attempt:
    return Attempt(run_id="r", attempt_id=attempt_id, chain_id="c1", attempt=1, stage="load", scenario="s", family="f",
                   turn=0, turn_kind="answer", user_id="u", request_sha256="x", prefix_sha256="y", transport="httpx",
                   status="ok", send_ts=1.0, end_ts=2.0, **timing)


def test_the_record_carries_ttfa_and_the_loader_reads_it_on_both_paths(tmp_path: Path) -> None:
    result = StreamResult(status="ok", transport="httpx", send_ts=10.0, end_ts=12.0, first_token_ts=10.1,
                          first_answer_ts=10.9, chunk_ts=[10.1, 10.9, 11.0], reasoning="hm", content="ok")
    timing = timing_fields(result)
    assert timing["ttfa_ms"] == pytest.approx(900) and timing["reasoning_ms"] == pytest.approx(800)
    fast = _attempt("a1", **timing)
    refused = _attempt("a2", **(timing | {"ttft_ms": float("nan")}))  # msgspec refuses NaN: read whole
    unknown = _attempt("a3")  # an attempt with no answer token: None, never 0
    assert json.loads(fast.to_json())["ttfa_ms"] == pytest.approx(900)
    assert json.loads(unknown.to_json())["ttfa_ms"] is None
    path = tmp_path / "records.jsonl"
    path.write_text("".join(a.to_json() + "\n" for a in (fast, refused, unknown)))
    attempts, columns = rundata._read_records(path)
    assert [a.attempt_id for a in attempts] == ["a1", "a2", "a3"] and len(read_attempts(path)) == 3
    ttfa = columns.array("ttfa_ms")
    assert ttfa[:2].tolist() == [pytest.approx(900), pytest.approx(900)] and math.isnan(ttfa[2])


def _stage(ttfa: list[float | None], status: str = "ok") -> Rows:
    rows = [{"status": status, "ttft_ms": 50.0, "ttfa_ms": v, "itl_mean_ms": 5.0, "e2e_ms": 3000.0} for v in ttfa]
    return RecordColumns.of(rows).rows()


def _stats(frame: Rows) -> StageRow:
    return StageRow.of(stage="load", attempts=len(frame), error_rate_ci95=(0.0, 0.1), **_latency(frame))


def test_the_stage_rule_judges_ttfa_p95_and_reads_none_as_unknown() -> None:
    thinking = _stats(_stage([2000.0 + i for i in range(20)]))
    p95 = thinking.ttfa_p95_ms
    assert 2000 < thinking.ttfa_p50_ms < p95 < 2020 and thinking.ttft_p95_ms == 50
    assert stage_breaches(thinking, thresholds(None)) == []  # the default (30 s) is generous
    (problem,) = stage_breaches(thinking, thresholds({"slo": {"ttfa_p95_ms": 1000}}))
    assert problem.id == "slo.ttfa_p95" and problem.signal == "latency"
    assert f"TTFA p95 {p95:.0f} ms > 1000 ms" in problem.reason
    for frame in (_stage([None] * 20), _stage([900.0] * 20, status="timeout")):  # not streamed; all failed
        stats = _stats(frame)
        assert stats.ttfa_p95_ms is None and stage_breaches(stats, thresholds({"slo": {"ttfa_p95_ms": 1}})) == []
    assert {"ttfa_p50_ms", "ttfa_p95_ms", "ttfa_p99_ms"} <= set(RAMP_COLUMNS)


def test_diff_compares_ttfa_and_skips_it_where_neither_run_timed_one() -> None:
    def figures(ttfa: float | None) -> dict[str, Any]:
        some = {"value": 100.0, "ci95": [90.0, 110.0]}
        out = {m: some for m in ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms",
                                 "itl_p50_ms", "itl_p95_ms", "e2e_p50_ms", "e2e_p95_ms")}
        none = {"value": None, "ci95": None}
        known = {"value": ttfa, "ci95": [ttfa * 0.9, ttfa * 1.1]} if ttfa else none
        return {"load": {"answers": 20, **out, "ttfa_p50_ms": known, "ttfa_p95_ms": known}}

    limits = thresholds(None)["diff"]
    rows = compare_stages(figures(None), figures(None))
    assert not any("ttfa" in r.id for r in _stage_rules(rows, limits))
    rows = compare_stages(figures(1000.0), figures(5000.0))
    (rule,) = [r for r in _stage_rules(rows, limits) if "ttfa_p95" in r.id]
    assert rule.status == "fail" and rows[0]["measures"]["ttfa_p95_ms"]["changed_beyond_noise"] == "higher"


def test_the_sims_thinking_phase_delays_the_first_answer_token(start_sim: Any) -> None:
    """--think-ms 3000 at the fast sim's time scale (0.1): 0.3 s of thinking between the first reasoning
    token and the first answer token, streamed or whole."""
    sim = start_sim("--think-ms", "3000")
    with ChatClient(sim.base_url, transport="geventhttpclient") as client:
        r = client.send(body(tools=[WEATHER]), 20.0)
        started = time.monotonic()
        whole = client.send(body(stream=False), 20.0)
        whole_s = time.monotonic() - started
    assert r.status == res.STATUS_OK and r.reasoning and r.tool_calls, r
    assert r.first_answer_ts - r.first_token_ts >= 0.3 * 0.95, r
    assert r.first_token_ts - r.send_ts < r.first_answer_ts - r.first_token_ts  # TTFT does not wait for it
    assert whole.status == res.STATUS_OK and whole.first_answer_ts is None and whole_s >= 0.3 * 0.95, whole
