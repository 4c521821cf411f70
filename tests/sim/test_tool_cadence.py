"""Tool-call cadence (issue 13): which chunks carried a tool-call part, and what timing_fields makes of it.

Why: a parser that holds a K3 call back until it is whole (vllm#50604) sends it in one delta after a
long silence; the record must say so (`tool_call_max_gap_ms`, `tool_call_deltas`) instead of reading
as slow decoding. First on hand-built StreamResults (exact times), then end to end: a loopback server
(tests/sim/chat_wire.py's RawServer) streams a role chunk, reasoning, a silence, then a whole call,
read by ChatClient over both transports.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from k3load.client import result as res
from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult, ToolCall
from k3load.client.transport import TRANSPORTS
from k3load.records import Attempt, timing_fields
from tests.sim.chat_wire import RawServer, body, chunk, chunked_head, http, sse

CADENCE = ("tool_call_deltas", "tool_call_span_ms", "tool_call_max_gap_ms")


def streamed(chunk_ts: list[float], tool_idx: list[int], first_event: float | None = 1.0,
             end: float | None = None) -> StreamResult:
    """A streamed result sent at 0.0, headers in at 0.5, its first event at `first_event`."""
    return StreamResult("ok", "none", send_ts=0.0, end_ts=end if end is not None else chunk_ts[-1] + 0.1,
                        first_byte_ts=0.5, first_token_ts=chunk_ts[0] if chunk_ts else None, chunk_ts=chunk_ts,
                        tool_chunk_idx=tool_idx, first_event_ts=first_event)


def cadence(result: StreamResult) -> tuple[Any, ...]:
    timing = timing_fields(result)
    return tuple(timing.get(name) for name in CADENCE)


# -- timing_fields on hand-built results ------------------------------------------------------------
def test_k2_cadence_streamed_piece_by_piece() -> None:
    """Reasoning, then a header and three argument pieces: the lead-in (reasoning to header) counts."""
    result = streamed([1.0, 1.1, 1.2, 1.3, 1.35, 1.4, 1.6], [3, 4, 5, 6], end=1.75)
    deltas, span, gap = cadence(result)
    assert deltas == 4 and span == pytest.approx(300) and gap == pytest.approx(200)
    assert timing_fields(result)["last_silence_ms"] == pytest.approx(150)


def test_k3_call_held_back_is_one_delta_after_the_silence() -> None:
    """vllm#50604: reasoning streams, then 90 s of nothing, then the whole call in one delta."""
    deltas, span, gap = cadence(streamed([1.0, 1.1, 1.2, 91.2], [3]))
    assert (deltas, span) == (1, 0.0) and gap == pytest.approx(90_000)


def test_gaps_before_the_lead_in_and_after_the_call_do_not_count() -> None:
    """A slow prefill (send to first event) and a slow answer after the call are not the call's."""
    deltas, span, gap = cadence(streamed([5.0, 9.0, 9.1, 9.2, 15.0], [2, 3], first_event=4.0))
    assert deltas == 2 and span == pytest.approx(100) and gap == pytest.approx(100)


def test_parallel_calls_with_a_pause_between_them() -> None:
    """Two calls: the silence between the first call's end and the second's header is inside the span."""
    deltas, span, gap = cadence(streamed([1.0, 1.05, 1.1, 3.1, 3.15], [0, 1, 2, 3, 4], first_event=1.0))
    assert deltas == 5 and span == pytest.approx(2150) and gap == pytest.approx(2000)


@pytest.mark.parametrize(("first_event", "gap_ms"), [
    (1.0, 1500.0),  # the role chunk (prefill done), then 1.5 s of nothing, then the call
    (2.5, 0.0),  # the role chunk in the same read as the call
    (None, 0.0),  # no event known (only a hand-built result can say so): no lead-in
])
def test_a_call_as_the_first_token_measures_its_lead_in_from_the_first_event(first_event: float | None,
                                                                              gap_ms: float) -> None:
    deltas, span, gap = cadence(streamed([2.5], [0], first_event=first_event))
    assert (deltas, span) == (1, 0.0) and gap == pytest.approx(gap_ms)


def test_no_call_leaves_the_cadence_unknown_and_says_the_last_silence() -> None:
    text = timing_fields(streamed([1.0, 1.1, 1.2], [], end=4.2))
    assert all(name not in text for name in CADENCE) and text["last_silence_ms"] == pytest.approx(3000)
    stalled = StreamResult("timeout", "none", send_ts=0.0, end_ts=60.0, first_byte_ts=0.5, first_event_ts=2.0)
    assert timing_fields(stalled)["last_silence_ms"] == pytest.approx(58_000)  # began, then nothing
    headers_only = StreamResult("timeout", "none", send_ts=0.0, end_ts=60.0, first_byte_ts=0.5)
    assert timing_fields(headers_only)["last_silence_ms"] == pytest.approx(59_500)
    refused = StreamResult("transport_error", "none", send_ts=0.0, end_ts=0.25)
    assert timing_fields(refused)["last_silence_ms"] == pytest.approx(250)


def test_a_non_streamed_call_has_no_cadence() -> None:
    whole = StreamResult("ok", "none", send_ts=0.0, end_ts=3.0, first_byte_ts=2.0,
                         tool_calls=[ToolCall(0, "a", "w", '{"city": "Paris"}')])
    timing = timing_fields(whole)
    assert all(name not in timing for name in CADENCE) and timing["last_silence_ms"] == pytest.approx(1000)


def test_every_timing_field_is_an_attempt_field() -> None:
    timing = timing_fields(streamed([1.0, 1.5], [1]))
    assert set(CADENCE) | {"last_silence_ms"} <= set(timing) <= set(Attempt.__dataclass_fields__)


# -- end to end: a server that holds a call back ----------------------------------------------------
def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "r1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]}


ROLE = _chunk({"role": "assistant", "content": ""})
WHOLE_CALL = _chunk({"tool_calls": [{"index": 0, "id": "functions.get_weather:0", "type": "function", "function": {
    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]})
TAIL = sse(_chunk({}, "tool_calls"), {"id": "r1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 12,
                                                                        "total_tokens": 21}}, "[DONE]")


def held_back(reasoning: int, silence_s: float) -> list[tuple[float, bytes]]:
    """Role chunk, `reasoning` reasoning chunks (one read each), `silence_s` of nothing, the whole call."""
    head = [(0.0, chunked_head() + chunk(sse(ROLE)))]
    thinking = [(0.01, chunk(sse(_chunk({"reasoning": f"step {i} "})))) for i in range(reasoning)]
    return [*head, *thinking, (silence_s, chunk(sse(WHOLE_CALL))), (0.0, chunk(TAIL) + chunk(b""))]


@pytest.fixture
def hold_back() -> Iterator[Callable[[int, float], RawServer]]:
    servers: list[RawServer] = []

    def start(reasoning: int, silence_s: float) -> RawServer:
        servers.append(RawServer(lambda n: held_back(reasoning, silence_s)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize(("reasoning", "silence_s"), [(3, 1.5), (0, 0.5)], ids=["after-reasoning", "first-token"])
def test_a_call_held_back_reads_as_one_delta_after_the_silence(hold_back: Callable[[int, float], RawServer],
                                                               transport: str, reasoning: int,
                                                               silence_s: float) -> None:
    server = hold_back(reasoning, silence_s)
    with ChatClient(server.url, transport=transport) as client:
        result = client.send(body(tools=[]), 20.0)
    assert result.status == res.STATUS_OK, result
    assert len(result.chunk_ts) == reasoning + 1 and result.tool_chunk_idx == [reasoning]
    assert result.first_event_ts is not None and result.first_byte_ts <= result.first_event_ts <= result.chunk_ts[0]
    timing = timing_fields(result)
    assert timing["tool_call_deltas"] == 1 and timing["tool_call_span_ms"] == 0.0
    assert silence_s * 1000 - 5 <= timing["tool_call_max_gap_ms"] <= silence_s * 1000 + 400, timing
    assert 0 <= timing["last_silence_ms"] < 400 and result.tool_calls[0].name == "get_weather"


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_non_streamed_answer_has_no_event_and_no_tool_chunks(transport: str) -> None:
    message = {"role": "assistant", "content": None, "tool_calls": WHOLE_CALL["choices"][0]["delta"]["tool_calls"]}
    whole = {"id": "r1", "object": "chat.completion", "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": message}]}
    server = RawServer(lambda n: [(0.0, http(200, json.dumps(whole).encode(), "application/json"))])
    try:
        with ChatClient(server.url, transport=transport) as client:
            result = client.send(body(stream=False), 20.0)
    finally:
        server.close()
    assert result.status == res.STATUS_OK and result.tool_calls and result.chunk_ts == [], result
    assert result.tool_chunk_idx == [] and result.first_event_ts is None
    timing = timing_fields(result)
    assert all(name not in timing for name in CADENCE) and timing["last_silence_ms"] is not None
