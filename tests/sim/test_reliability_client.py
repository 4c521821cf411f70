"""Every byte a server can send is recorded or refused cleanly (issue 11, points 1 and 4 in part).

A bare loopback server (tests/sim/chat_wire.py's RawServer) sends what no well-behaved server
does: lone surrogate escapes, bytes that are not UTF-8, a body far over the cap, a line far over the
cap. Each answer goes through ChatClient (both transports) and then through the record writer and
reader, so a test fails if an attempt loses its record or its text. Retry-After is checked against the
sim: the retry waits what the server asked, not the scenario's 0.1 s.
"""

from __future__ import annotations

import hashlib
import json
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3load.client import result as res
from k3load.client.body import MAX_BODY_BYTES, parse_retry_after
from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult
from k3load.client.sse import MAX_LINE_BYTES
from k3load.client.transport import TRANSPORTS
from k3load.evidence import RECORDS, lines, records_file
from k3load.records import Attempt, json_line, read_records
from k3load.rundir import JsonlLog
from k3load.workload.conversation import RunContext, run_turn
from k3load.workload.retry_policy import RETRY_AFTER_MAX_S, retry_wait_s
from k3load.workload.scenario import parse_scenario
from tests.sim.chat_wire import HELLO, RawServer, body, chunk, chunked_head, http, sse

ROOT = Path(__file__).resolve().parents[2]
SURROGATE_CHUNKS = [  # JSON text exactly as a faulty server writes it: valid JSON, lone surrogates
    '{"id":"r1","choices":[{"index":0,"delta":{"reasoning":"think \\udfff"}}]}',
    '{"id":"r1","choices":[{"index":0,"delta":{"content":"smile \\ud83d end"}}]}',
    '{"id":"r1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function",'
    '"function":{"name":"f","arguments":"{\\"a\\": \\"\\ud800\\"}"}}]}}]}',
    '{"id":"r1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}',
]
SURROGATE_BODY = ('{"id":"r1","object":"chat.completion","choices":[{"index":0,"finish_reason":"stop","message":'
                  '{"role":"assistant","reasoning":"think \\udfff","content":"smile \\ud83d end","tool_calls":'
                  '[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\\"a\\": \\"\\ud800\\"}"}}]}}]}')
HELLO_STREAM = chunked_head() + chunk(HELLO) + chunk(b"")


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[int], bytes]], RawServer]]:
    """serve(answer) -> a loopback server answering request n with answer(n), closed after the test."""
    servers: list[RawServer] = []

    def start(answer: Callable[[int], bytes]) -> RawServer:
        servers.append(RawServer(lambda n: [(0.0, answer(n))]))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def stream_of(*events: str) -> bytes:
    return chunked_head() + chunk(sse(*events, "[DONE]")) + chunk(b"")


def recorded(result: StreamResult, tmp_path: Path) -> Attempt:
    """The result as an Attempt, written by the run's JsonlLog and read back (the path every attempt takes)."""
    attempt = Attempt(run_id="r", attempt_id=f"a{time.perf_counter_ns()}", chain_id="c", attempt=1, stage="s",
                      scenario="x", family="agent", turn=0, turn_kind="answer", user_id="u", request_sha256="",
                      prefix_sha256="", transport=result.transport, status=result.status, send_ts=result.send_ts,
                      end_ts=result.end_ts, http_status=result.http_status, error=result.error,
                      error_body=result.error_body, reasoning=result.reasoning, content=result.content,
                      tool_calls=[c.as_message() for c in result.tool_calls])
    writer = JsonlLog(tmp_path / RECORDS)
    writer.append_line(attempt.to_json())
    writer.close()
    (back,) = [a for a in read_records(records_file(tmp_path)) if a.attempt_id == attempt.attempt_id]
    assert back == attempt
    return back


# -- point 1: surrogates and bytes that are not UTF-8 --------------------------------------------
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_lone_surrogate_escapes_are_recorded_and_read_back(serve: Callable[..., RawServer], transport: str,
                                                           tmp_path: Path) -> None:
    server = serve(lambda n: stream_of(*SURROGATE_CHUNKS) if n % 2 == 0 else
                   http(200, SURROGATE_BODY.encode(), "application/json"))
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        streamed, whole = client.send(body(), 5.0), client.send(body(stream=False), 5.0)
    for r in (streamed, whole):
        assert r.status == res.STATUS_OK, r  # valid JSON: the server's text, not a protocol fault
        back = recorded(r, tmp_path)
        assert (back.reasoning, back.content) == ("think \udfff", "smile \ud83d end")
        assert json.loads(back.tool_calls[0]["function"]["arguments"]) == {"a": "\ud800"}
    line = list(lines(tmp_path / RECORDS))[-1]
    assert "\\ud83d" in line and line.isascii()  # kept as the JSON escape the server sent


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_invalid_utf8_is_kept_escaped_and_malformed(serve: Callable[..., RawServer], transport: str,
                                                    tmp_path: Path) -> None:
    chunk_bytes = b'{"id":"r1","choices":[{"index":0,"delta":{"content":"ok \xff\xfe end"},"finish_reason":"stop"}]}'
    whole_bytes = (b'{"id":"r1","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant",'
                   b'"content":"ok \xff\xfe end"}}]}')
    server = serve(lambda n: chunked_head() + chunk(b"data: " + chunk_bytes + b"\n\ndata: [DONE]\n\n") + chunk(b"")
                   if n % 2 == 0 else http(200, whole_bytes, "application/json"))
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        streamed, whole = client.send(body(), 5.0), client.send(body(stream=False), 5.0)
    assert streamed.error == "1 SSE events not valid UTF-8 (bad bytes kept as \\udcXX escapes)", streamed
    assert whole.error == "response body is not valid UTF-8 (bad bytes kept as \\udcXX escapes)", whole
    for r in (streamed, whole):
        assert r.status == res.STATUS_MALFORMED and r.finish_reason == "stop", r
        back = recorded(r, tmp_path)
        assert back.content.encode("utf-8", "surrogateescape") == b"ok \xff\xfe end"


def test_writers_never_raise_on_a_lone_surrogate(tmp_path: Path) -> None:
    """The safety net under json_line: a line that still holds a raw surrogate (built by someone
    else's json.dumps(ensure_ascii=False)) is written as its JSON escape, by append_line and append alike."""
    raw = json.dumps({"content": "a\ud83db\udcff"}, ensure_ascii=False)
    log = JsonlLog(tmp_path / "events.jsonl")
    log.append_line(raw)
    log.append({"content": "\udfff"})
    log.close()
    records = JsonlLog(tmp_path / RECORDS)  # compressed, as a run's records are
    records.append_line(raw)
    records.close()
    for name in ("events.jsonl", RECORDS):
        first = json.loads(next(iter(lines(tmp_path / name))))
        assert first == {"content": "a\ud83db\udcff"}
    assert json_line({"a": "é"}) == '{"a":"é"}' and json_line({"a": "\ud83d"}) == '{"a":"\\ud83d"}'


# -- point 2: caps ---------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_body_over_the_cap_is_counted_hashed_and_never_held(serve: Callable[..., RawServer], transport: str,
                                                              tmp_path: Path) -> None:
    huge = b'{"choices":[{"index":0,"message":{"content":"' + b"z" * (3 * MAX_BODY_BYTES) + b'"}}]}'
    answer = http(200, huge, "application/json")  # built here: the server thread is traced too
    server = serve(lambda n: answer if n == 0 else HELLO_STREAM)
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        tracemalloc.start()
        try:
            r = client.send(body(stream=False), 30.0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        after = client.send(body(), 5.0)
    assert r.status == res.STATUS_MALFORMED and r.http_status == 200, r
    assert r.error == (f"body over {MAX_BODY_BYTES} bytes ({len(huge)} bytes, sha256 "
                       f"{hashlib.sha256(huge).hexdigest()})")
    assert r.error_body.startswith('{"choices"') and len(r.error_body) <= 4000 and r.content == ""
    assert peak < 2 * MAX_BODY_BYTES, peak  # the cap and a read or two, never the 24 MiB body
    assert after.status == res.STATUS_OK and server.connections == 1  # read to its end: connection kept
    assert len(recorded(r, tmp_path).to_json()) < 10_000


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_an_sse_line_over_the_cap_is_malformed_with_its_size_and_hash(serve: Callable[..., RawServer],
                                                                      transport: str) -> None:
    line = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"q" * (3 * MAX_LINE_BYTES) + b'"}}]}'
    server = serve(lambda n: chunked_head() + chunk(line + b"\n\n") + chunk(b"data: [DONE]\n\n") + chunk(b"")
                   if n == 0 else HELLO_STREAM)
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        r, after = client.send(body(), 30.0), client.send(body(), 5.0)
    assert r.status == res.STATUS_MALFORMED and r.content == "", r
    assert r.error.startswith(f"line over {MAX_LINE_BYTES} bytes ({len(line)} bytes, sha256 "
                              f"{hashlib.sha256(line).hexdigest()}) at SSE line 1"), r.error
    assert after.status == res.STATUS_OK and after.content == "hello" and server.connections == 1


def test_streamed_text_over_the_cap_is_malformed(serve: Callable[..., RawServer]) -> None:
    piece = sse({"choices": [{"index": 0, "delta": {"content": "w" * 1000}}]})
    server = serve(lambda n: chunked_head() + b"".join(chunk(piece) for _ in range(300))
                   + chunk(b"data: [DONE]\n\n") + chunk(b""))
    for transport in TRANSPORTS:
        with ChatClient(server.url, transport=transport, max_body_bytes=64 << 10) as client:
            r = client.send(body(), 10.0)
        assert r.status == res.STATUS_MALFORMED and "streamed text over 65536 characters" in r.error, r
        assert 64 << 10 < len(r.content) < 2 * (64 << 10) + 70_000, len(r.content)


def test_caps_must_be_positive() -> None:
    for bad in ({"max_body_bytes": 0}, {"max_line_bytes": -1}):
        with pytest.raises(ValueError, match="positive"):
            ChatClient("http://127.0.0.1:1", **bad)


# -- point 4: Retry-After --------------------------------------------------------------------------
def test_retry_after_forms() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("2", now) == 2.0 and parse_retry_after(" 0 ", now) == 0.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:30 GMT", now) == pytest.approx(10.0)
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:00 GMT", now) == 0.0  # in the past: no wait
    for bad in (None, "", "soon", "-3", "nan", "inf"):
        assert parse_retry_after(bad, now) is None, bad


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_retry_after_is_captured_in_both_forms(serve: Callable[..., RawServer], transport: str) -> None:
    soon = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 20))
    headers = [b"Retry-After: 7\r\n", f"Retry-After: {soon}\r\n".encode(), b""]
    server = serve(lambda n: http(429, b"slow down", "text/plain").replace(b"\r\n\r\n", b"\r\n" + headers[n % 3]
                                                                           + b"\r\n", 1))
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        seconds, date, none = (client.send(body(), 5.0) for _ in range(3))
    assert seconds.retry_after_s == 7.0 and seconds.error == "HTTP 429: slow down (Retry-After 7 s)", seconds
    assert 17 <= date.retry_after_s <= 21 and none.retry_after_s is None and none.error == "HTTP 429: slow down"


def test_retry_wait_is_bounded() -> None:
    def wait(retry_after: float | None, backoff: float = 0.1, timeout: float = 60.0) -> float:
        result = StreamResult(status="http_error", transport="t", send_ts=0.0, end_ts=0.0, retry_after_s=retry_after)
        return retry_wait_s({"backoff_s": backoff}, timeout, result)

    assert wait(None) == 0.1 and wait(2.0) == 2.0 and wait(0.0) == 0.1  # never below the scenario's backoff
    assert wait(3600.0) == RETRY_AFTER_MAX_S == 30.0 and wait(3600.0, timeout=5.0) == 5.0


def _retrying_turn(tmp_path: Path) -> Any:
    data = yaml.safe_load((ROOT / "scenarios" / "agent_timeout_retry.yaml").read_text())
    data["turns"] = data["turns"][:1]
    data["turns"][0]["retry"] = {"max_attempts": 2, "backoff_s": 0.1, "when": ["http_429"]}
    return parse_scenario(data, tmp_path / "retry.yaml")


@pytest.mark.parametrize(("retry_after", "low", "high"), [("2", 1.9, 3.5), (None, 0.09, 0.9)])
def test_the_retry_waits_what_the_server_asked(start_sim: Callable[..., Any], tmp_path: Path,
                                               retry_after: str | None, low: float, high: float) -> None:
    extra = ["--http-error-retry-after-s", retry_after] if retry_after else []
    sim = start_sim("--http-error-rate", "1", "--http-error-status", "429", *extra)
    scenario = _retrying_turn(tmp_path)
    with ChatClient(sim.base_url) as client:
        first, second = run_turn(client, RunContext(run_id="r", model="tiny", user_id="u"), scenario,
                                 scenario.turns[0], "", lambda attempt: None)
    assert first.will_retry and first.status == second.status == res.STATUS_HTTP_ERROR
    assert (first.error.endswith("(Retry-After 2 s)")) == bool(retry_after), first.error
    assert low <= second.send_ts - first.end_ts <= high


def test_cap_options_defaults_environment_and_errors(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from locust.argument_parser import get_parser

    from k3load.loadgen.options import add_options

    def parse(*args: str) -> Any:
        parser = get_parser(default_config_files=[])
        add_options(parser)
        return parser.parse_args(list(args))

    opts = parse()
    assert (opts.k3_max_body_bytes, opts.k3_max_line_bytes) == (MAX_BODY_BYTES, MAX_LINE_BYTES) == (8 << 20, 1 << 20)
    monkeypatch.setenv("K3_MAX_BODY_BYTES", "1000")
    assert parse("--k3-max-line-bytes", "500").k3_max_body_bytes == 1000
    with pytest.raises(SystemExit):
        parse("--k3-max-line-bytes", "0")
    assert "--k3-max-line-bytes: must be a whole number of bytes > 0, got '0'" in capsys.readouterr().err
