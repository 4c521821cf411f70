"""The answer ends at `data: [DONE]` (issue 37, item 3), whatever the connection does after it.

A proxy may pass [DONE] on and hold the chunked body open (its last chunk late, or never). OpenAI's SDK
stops reading at [DONE]; so must the client: the answer is timed to [DONE], a body still open after a
brief wait for its end has its connection closed (never reused, never drained), and what came after
[DONE] is counted on the record. A server that ends the body normally keeps its connection.

Decoder tests and the property tests (under the conftest's Hypothesis profile) need no sockets; the
client tests run both transports against the bare scripted server of tests/sim/chat_wire.py (it
counts connections) and against the sim's `--hold-after-done-rate` fault, in this gevent-patched
process and in a plain one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from k3load.client import exchange
from k3load.client import result as res
from k3load.client.chat import ChatClient
from k3load.client.sse import DONE, SSEDecoder, SSEError, SSEEvent, SSELineTooLong
from k3load.client.transport import TRANSPORTS
from k3load.records import Attempt, timing_fields
from tests.sim.chat_wire import HELLO, RawServer, body, chunk, chunked_head, sse

HOLD_S = 30.0  # the proxy's hold: an answer read to the body's end would take this long
PROMPT_S = 5.0  # far below the hold, with room for a loaded 2-core machine
PING = b": proxy keep-alive\n\n"


def feed_all(raw: bytes, cuts: list[int], cap: int = 1 << 20) -> tuple[list[SSEEvent], SSEDecoder]:
    """Feed `raw` split at the sorted offsets `cuts`, then finish."""
    decoder, events, start = SSEDecoder(cap), [], 0
    for cut in [*cuts, len(raw)]:
        events += decoder.feed(raw[start:cut])
        start = cut
    return events + decoder.finish(), decoder


def outcome(raw: bytes, cuts: list[int], cap: int = 1 << 20) -> tuple[Any, ...]:
    """What a read of `raw` gives: its events and counts, or the error's type and line."""
    try:
        events, decoder = feed_all(raw, cuts, cap)
    except SSEError as exc:
        return type(exc), exc.line
    return events, decoder.after_done, decoder.invalid_utf8, decoder.pending_bytes


def splits(raw: bytes) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, len(raw)), max_size=8).map(sorted)


# -- the decoder -----------------------------------------------------------------------------------
def test_the_stream_ends_at_done_and_what_follows_is_counted_never_decoded() -> None:
    answer = sse({"a": 1}, "[DONE]")
    after = PING + b"<html>502</html>\ndata: {not json\n\n" + b"x" * 100
    for cut in range(len(answer + after) + 1):
        events, decoder = feed_all(answer + after, [cut])
        assert events == [{"a": 1}, DONE] and decoder.after_done == len(after), cut
        assert decoder.pending_bytes == 0 and decoder.done
    decoder = SSEDecoder()
    assert decoder.feed(answer) == [{"a": 1}, DONE] and decoder.after_done == 0
    assert decoder.feed(b"garbage\n") == [] and decoder.after_done == 8 and decoder.finish() == []


def test_an_over_long_line_after_done_in_the_same_read_is_not_an_error() -> None:
    after = b"data: " + b"z" * 500 + b"\n\n"
    events, decoder = feed_all(sse({"a": 1}, "[DONE]") + after, [], cap=100)
    assert events == [{"a": 1}, DONE] and decoder.after_done == len(after)
    with pytest.raises(SSELineTooLong, match="SSE line 3"):  # before [DONE] it still is
        feed_all(sse({"a": 1}) + after + sse("[DONE]"), [], cap=100)


@given(raw=st.binary(max_size=400), data=st.data())
@example(raw=b"data: [DONE]\n\ndata: [DONE]\n\n\xff", data=None)
@example(raw=b'data: {"a":1}\r\n\r\ndata: [DONE]\r\n\r\n: x\n', data=None)
def test_arbitrary_bytes_raise_only_sse_errors_and_splits_do_not_matter(raw: bytes, data: Any) -> None:
    """Any bytes, cut anywhere: an SSEError (a ValueError) or events, the same for every way the reads
    cut them; [DONE] at most once, always last; nothing held after it."""
    whole = outcome(raw, [])
    cuts = data.draw(splits(raw)) if data is not None else list(range(1, len(raw)))
    assert outcome(raw, cuts) == whole
    if isinstance(whole[0], list):
        events, after_done, _, pending = whole
        assert DONE not in events[:-1] and (after_done == 0 or events[-1] is DONE)
        assert pending == 0 or DONE not in events


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=3), max_leaves=8)


@given(chunks=st.lists(st.dictionaries(st.text(max_size=8), json_values, max_size=4), max_size=5),
       after=st.binary(max_size=300), crlf=st.booleans(), data=st.data())
def test_an_answer_then_any_bytes_is_the_answer_and_a_count(chunks: list[dict[str, Any]], after: bytes, crlf: bool,
                                                            data: Any) -> None:
    raw = sse(*chunks, "[DONE]")
    if crlf:
        raw = raw.replace(b"\n", b"\r\n")
    events, decoder = feed_all(raw + after, data.draw(splits(raw + after)))
    assert events == [*chunks, DONE] and decoder.after_done == len(after) and decoder.pending_bytes == 0


# -- the client against a scripted server ----------------------------------------------------------
@pytest.fixture
def scripted() -> Iterator[Callable[..., RawServer]]:
    servers: list[RawServer] = []

    def start(script: Callable[[int], list[tuple[float, bytes]]]) -> RawServer:
        servers.append(RawServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def held(after: bytes = b"", late: bytes = b"") -> Callable[[int], list[tuple[float, bytes]]]:
    """Request 0: the answer and [DONE] (and `after` in the same write), `late` 3 s later, and the body
    held open for HOLD_S; every later request: the answer, ended normally."""
    def script(n: int) -> list[tuple[float, bytes]]:
        if n:
            return [(0.0, chunked_head() + chunk(HELLO) + chunk(b""))]
        return [(0.0, chunked_head() + chunk(HELLO + after)), *([(3.0, chunk(late))] if late else []),
                (HOLD_S, chunk(b""))]
    return script


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize(("after", "late"), [(b"", b""), (PING, b""), (b"", PING)], ids=["bare", "ping", "late"])
def test_a_body_held_open_after_done_ends_the_answer_at_done(scripted: Callable[..., RawServer], transport: str,
                                                            after: bytes, late: bytes) -> None:
    server = scripted(held(after, late))
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        started = time.perf_counter()
        r = client.send(body(), 20.0)
        wall = time.perf_counter() - started
        nxt = client.send(body(), 20.0)  # the one slot is free again: the held connection was closed
    assert (r.status, r.content, r.error) == (res.STATUS_OK, "hello", None), r
    assert wall < PROMPT_S and r.end_ts - r.send_ts < PROMPT_S, (wall, r)
    assert r.after_done_open is True and r.after_done_bytes == len(after), r  # `late` never waited for
    assert (nxt.status, nxt.content, nxt.after_done_open, nxt.after_done_bytes) == (res.STATUS_OK, "hello", False, 0)
    assert server.connections == 2  # never reused: the next request came on a fresh connection
    timing = timing_fields(r)
    assert timing["e2e_ms"] < PROMPT_S * 1000 and (timing["after_done_bytes"], timing["after_done_open"]) == \
        (len(after), True)
    record = Attempt.from_dict(json.loads(_record(r).to_json()))
    assert (record.after_done_bytes, record.after_done_open) == (len(after), True)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_body_that_ends_after_done_keeps_its_connection(scripted: Callable[..., RawServer],
                                                          transport: str) -> None:
    """The last chunk in its own write a moment after [DONE] (as uvicorn and aiohttp send it), or in the
    same one: the message's end is waited for, and the connection goes back to the pool."""
    def script(n: int) -> list[tuple[float, bytes]]:
        if n % 2:
            return [(0.0, chunked_head() + chunk(HELLO) + chunk(b""))]
        return [(0.0, chunked_head() + chunk(HELLO)), (0.005, chunk(b""))]

    server = scripted(script)
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        got = [client.send(body(), 20.0) for _ in range(6)]
    assert all((r.status, r.content, r.after_done_open, r.after_done_bytes) == (res.STATUS_OK, "hello", False, 0)
               for r in got), got
    assert server.connections == 1


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_deadline_passing_while_the_end_is_awaited_leaves_the_answer_whole(
        scripted: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """The wait for the message's end is bounded by the deadline; should the deadline's own timer fire
    first, the answer had ended at [DONE] and stays `ok`."""
    monkeypatch.setattr(exchange, "END_WAIT_S", 60.0)
    server = scripted(held())
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        started = time.perf_counter()
        r = client.send(body(), 0.5)
        wall = time.perf_counter() - started
    assert (r.status, r.content, r.error, r.after_done_open) == (res.STATUS_OK, "hello", None, True), r
    assert wall < PROMPT_S and r.end_ts - r.send_ts < 0.5, (wall, r)


def test_an_error_event_then_done_on_a_held_body_ends_there(scripted: Callable[..., RawServer]) -> None:
    """vLLM sends [DONE] after a mid-stream error event: the failed answer ends there too."""
    error = sse({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
    server = scripted(lambda n: [(0.0, chunked_head() + chunk(error)), (0.05, chunk(sse("[DONE]"))),
                                   (HOLD_S, chunk(b""))])
    for transport in TRANSPORTS:
        started = time.perf_counter()
        with ChatClient(server.url, transport=transport) as client:
            r = client.send(body(), 20.0)
        assert r.status == res.STATUS_STREAM_ERROR and "engine died" in r.error, (transport, r)
        assert time.perf_counter() - started < PROMPT_S and r.after_done_open is True, (transport, r)


def _record(result: res.StreamResult) -> Attempt:
    return Attempt(run_id="r", attempt_id="a", chain_id="c", attempt=1, stage="s", scenario="x", family="f", turn=0,
                   turn_kind="answer", user_id="u", request_sha256="", prefix_sha256="", transport=result.transport,
                   status=result.status, send_ts=result.send_ts, end_ts=result.end_ts, **timing_fields(result))


# -- the sim's fault, both transports, with and without gevent's patching --------------------------
PLAIN_SCRIPT = """
import json, sys, time
from k3load.client.chat import ChatClient
url, body, out = sys.argv[1], sys.argv[2].encode(), {}
for transport in ("geventhttpclient", "httpx"):
    with ChatClient(url, transport=transport) as client:
        started = time.perf_counter()
        r = client.send(body, 20.0)
        out[transport] = [r.status, time.perf_counter() - started, r.after_done_open, bool(r.content)]
print(json.dumps(out))
"""


def test_the_sims_held_body_in_this_process_and_a_plain_one(start_sim: Callable[..., Any]) -> None:
    sim = start_sim("--hold-after-done-rate", "1", "--hold-after-done-ms", str(HOLD_S * 1000))
    question = body(messages=[{"role": "user", "content": "hi"}])
    for transport in TRANSPORTS:
        started = time.perf_counter()
        with ChatClient(sim.base_url, transport=transport) as client:
            r = client.send(question, 20.0)
        assert r.status == res.STATUS_OK and r.content and r.after_done_open is True, (transport, r)
        assert time.perf_counter() - started < PROMPT_S and r.end_ts - r.send_ts < PROMPT_S, (transport, r)
    done = subprocess.run([sys.executable, "-c", PLAIN_SCRIPT, sim.base_url, question.decode()], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    for transport, (status, wall, still_open, content) in json.loads(done.stdout).items():
        assert (status, still_open, content) == (res.STATUS_OK, True, True) and wall < PROMPT_S, (transport, wall)
