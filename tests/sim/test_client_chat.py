"""ChatClient over both transports against a real sim on loopback, and a bare scripted HTTP server for
the bytes no well-behaved server sends (garbage SSE, a key-echoing 401, a stall then an answer).

Every fault ends as a StreamResult, never an exception; deadlines hold while a server stalls before
or during the stream, under gevent (this process: conftest imports locust) and in a plain process.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k3load.client import result as res
from k3load.client.chat import ChatClient, chat_url, wants_stream
from k3load.client.result import StreamResult
from k3load.client.transport import TRANSPORTS, shared_ssl_context

SimFactory = Callable[..., Any]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SLACK_S = 1.5  # far below the 6 s stall: a request that waited for the server would fail
STALL_DEADLINE_S = 0.8  # against 6 s stalls; leaves a loaded machine time to deliver a first token
SECRET = "sk-test-7f3c9a1e-DO-NOT-LEAK"


def body(stream: bool = True, **extra: Any) -> bytes:
    """Canonical JSON bytes, as the runner will hand them over."""
    fields = {"model": "tiny", "messages": ASK, "max_tokens": 64, "stream": stream, **extra}
    if stream:
        fields.setdefault("stream_options", {"include_usage": True})
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


def send(url: str, transport: str, payload: bytes, deadline_s: float = 20.0, **kw: Any) -> StreamResult:
    with ChatClient(url, transport=transport, **kw) as client:
        return client.send(payload, deadline_s)


def assert_timeline(r: StreamResult) -> None:
    assert r.first_byte_ts is not None and r.first_token_ts is not None, r
    assert r.send_ts <= r.first_byte_ts <= r.first_token_ts <= r.end_ts, r
    assert r.chunk_ts == sorted(r.chunk_ts) and r.chunk_ts[0] == r.first_token_ts and r.chunk_ts[-1] <= r.end_ts
    assert r.first_event_ts is not None and r.first_byte_ts <= r.first_event_ts <= r.first_token_ts, r
    assert abs(r.send_ts - time.time()) < 60  # epoch seconds


# -- a bare scripted server ------------------------------------------------------------------------
Script = Callable[[int], list[tuple[float, bytes]]]  # request number -> [(delay_s, bytes to send)]


class RawServer:
    """HTTP/1.1 keep-alive on loopback that answers request n with script(n); counts connections."""

    def __init__(self, script: Script, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.requests: list[bytes] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            try:
                if self.tls is not None:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    self.requests.append(head + b"\r\n\r\n" + buf[:length])
                    buf = buf[length:]
                    for delay, data in self.script(len(self.requests) - 1):
                        time.sleep(delay)
                        conn.sendall(data)
            except OSError:  # ssl.SSLError included (a client that refused our certificate)
                return

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def raw_server() -> Iterator[Callable[..., RawServer]]:
    servers: list[RawServer] = []

    def start(script: Script, tls: ssl.SSLContext | None = None) -> RawServer:
        servers.append(RawServer(script, tls))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def http(status: int, payload: bytes, content_type: str) -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n\r\n"
            .encode() + payload)


def chunked_head(content_type: str = "text/event-stream") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
                    for e in events)


HELLO = sse({"id": "r1", "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": "stop"}]},
            "[DONE]")


# -- against the sim -------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_k3_stream_and_whole_answer(start_sim: SimFactory, transport: str) -> None:
    sim = start_sim("--tool-call-style", "k3")
    with ChatClient(sim.base_url, transport=transport) as client:
        r = client.send(body(tools=[WEATHER]), 20.0)
        again = client.send(body(tools=[WEATHER]), 20.0)
        whole = client.send(body(stream=False, tools=[WEATHER]), 20.0)
    for got in (r, again):
        assert got.status == res.STATUS_OK and got.http_status == 200 and got.transport == transport, got
        assert_timeline(got)
        (call,) = got.tool_calls
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] and got.finish_reason == "tool_calls"
        assert got.reasoning.startswith("Let me think.") and got.response_id.startswith("chatcmpl-")
        assert got.reasoning_tokens > 0 and len(got.chunk_ts) <= got.completion_tokens and got.prompt_tokens > 16
        assert got.tool_chunk_idx == [len(got.chunk_ts) - 1]  # K3: the call whole, in the last token chunk
    assert r.cached_tokens == 0 and again.cached_tokens > 0  # same prompt: the sim's prefix cache hits
    assert whole.status == res.STATUS_OK and whole.tool_calls and whole.reasoning and whole.usage
    assert whole.first_token_ts is None and whole.chunk_ts == [] and whole.first_byte_ts <= whole.end_ts
    assert whole.first_event_ts is None and whole.tool_chunk_idx == []


def test_k2_split_arguments_and_plain_text(start_sim: SimFactory) -> None:
    sim = start_sim("--tool-call-style", "k2")
    for transport in TRANSPORTS:
        r = send(sim.base_url, transport, body(tools=[WEATHER]))
        assert r.status == res.STATUS_OK and json.loads(r.tool_calls[0].arguments)["city"], (transport, r)
        assert len(r.chunk_ts) > len(r.reasoning.split())  # header + one chunk per argument piece
        first = r.tool_chunk_idx[0]  # after the reasoning, every token chunk to the end is the call's
        assert first > 0 and r.tool_chunk_idx == list(range(first, len(r.chunk_ts))), (transport, r)
        text = send(sim.base_url, transport, body(messages=[{"role": "user", "content": "hi"}]))
        assert text.status == res.STATUS_OK and text.content and text.finish_reason in ("stop", "length")
        assert_timeline(text)


def test_midstream_error_event(start_sim: SimFactory) -> None:
    sim = start_sim("--midstream-error-rate", "1")
    for transport in TRANSPORTS:
        r = send(sim.base_url, transport, body())
        assert r.status == res.STATUS_STREAM_ERROR and r.http_status == 200, (transport, r)
        assert r.error == ("error event mid-stream: InternalServerError (500): "
                           "k3load sim: injected engine error mid-stream")
        assert r.reasoning and r.chunk_ts and r.finish_reason is None


def test_truncated_stream_cut_chunked_encoding(start_sim: SimFactory) -> None:
    sim = start_sim("--truncate-stream-rate", "1")
    for transport in TRANSPORTS:
        r = send(sim.base_url, transport, body())
        assert r.status == res.STATUS_TRUNCATED and "body cut" in r.error and r.chunk_ts, (transport, r)


@pytest.mark.parametrize(("style", "status", "error"), [
    ("vllm", "503", "HTTP 503: InternalServerError (503): k3load sim: injected server error"),
    ("gateway", "429", "HTTP 429: upstream error 429"),
])
def test_http_errors(start_sim: SimFactory, style: str, status: str, error: str) -> None:
    sim = start_sim("--http-error-rate", "1", "--http-error-status", status, "--http-error-style", style)
    for transport in TRANSPORTS:
        for stream in (True, False):
            r = send(sim.base_url, transport, body(stream=stream))
            assert r.status == res.STATUS_HTTP_ERROR and r.http_status == int(status) and r.error == error, r
            assert r.error_body and r.first_token_ts is None


@pytest.mark.parametrize("fault", [("--slow-first-token-rate", "1", "--slow-first-token-ms", "60000"),
                                   ("--slow-drip-rate", "1", "--slow-drip-ms", "60000")])
def test_deadline_holds_while_the_server_stalls(start_sim: SimFactory, fault: tuple[str, ...]) -> None:
    sim = start_sim(*fault)  # a 6 s stall (time-scale 0.1) before the first token, or after it: the deadline
    # must end the request long before the stall does, with slack for a loaded 2-core CI machine
    deadline = STALL_DEADLINE_S
    for transport in TRANSPORTS:
        started = time.perf_counter()
        r = send(sim.base_url, transport, body(), deadline_s=deadline)
        wall = time.perf_counter() - started
        assert r.status == res.STATUS_TIMEOUT and f"deadline of {deadline:g} s" in r.error, (transport, r)
        assert deadline <= r.end_ts - r.send_ts < deadline + SLACK_S and wall < deadline + SLACK_S, (transport, r)
        assert r.first_byte_ts is not None and bool(r.chunk_ts) == ("--slow-drip-rate" in fault)


def test_dead_server_is_a_transport_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for transport in TRANSPORTS:
        r = send(url, transport, body(), deadline_s=5.0, api_key=SECRET)
        assert r.status == res.STATUS_TRANSPORT_ERROR and "refused" in r.error.lower(), (transport, r)
        assert r.first_byte_ts is None and r.end_ts - r.send_ts < 1.0 and SECRET not in repr(r)


# -- against the bare server -----------------------------------------------------------------------
def test_api_key_is_sent_but_never_shown(raw_server: Callable[..., RawServer],
                                         caplog: pytest.LogCaptureFixture) -> None:
    server = raw_server(lambda n: [(0.0, http(401, b"bad key in: " + server.requests[n], "text/plain"))])
    caplog.set_level(logging.DEBUG)
    for transport in TRANSPORTS:
        client = ChatClient(server.url, api_key=SECRET, transport=transport)
        for stream in (True, False):
            r = client.send(body(stream=stream), 5.0)
            assert r.status == res.STATUS_HTTP_ERROR and r.http_status == 401 and "[redacted]" in r.error_body, r
            assert SECRET not in repr(r) and SECRET not in str(vars(r))
        assert SECRET not in repr(client) and "api_key=set" in repr(client)
        client.close()
    assert all(f"Authorization: Bearer {SECRET}".lower().encode() in req.lower() for req in server.requests)
    assert SECRET not in caplog.text
    with pytest.raises(ValueError) as bad:
        ChatClient(server.url, api_key=SECRET + "\r\nX-Evil: 1")
    assert SECRET not in str(bad.value)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_a_given_context_and_the_shared_default(raw_server: Callable[..., RawServer],
                                                         tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server = raw_server(lambda n: [(0.0, chunked_head() + chunk(HELLO) + chunk(b""))], server_ctx)
    trusting = ssl.create_default_context(cafile=str(cert))
    for transport in TRANSPORTS:
        with ChatClient(server.url, transport=transport, ssl_context=trusting) as client:
            got = [client.send(body(), 5.0) for _ in range(2)]
        assert [(r.status, r.content) for r in got] == [(res.STATUS_OK, "hello")] * 2, (transport, got)
        refused = send(server.url, transport, body(), deadline_s=5.0)  # the shared default context
        assert refused.status == res.STATUS_TRANSPORT_ERROR and "CERTIFICATE_VERIFY_FAILED" in refused.error
    assert shared_ssl_context(True) is shared_ssl_context(True)  # built once per process


SCRIPTED = [  # (name, response bytes, status, words in the error)
    ("ok", chunked_head() + chunk(HELLO) + chunk(b""), res.STATUS_OK, None),
    ("garbage line", chunked_head() + chunk(b"<html>bad gateway</html>\n") + chunk(b""), res.STATUS_MALFORMED,
     "not an SSE field"),
    ("invalid json", chunked_head() + chunk(b'data: {"id": 1,}\n\n' + HELLO) + chunk(b""), res.STATUS_MALFORMED,
     "invalid JSON"),
    ("json to a stream request", http(200, b'{"id": "x"}', "application/json"), res.STATUS_MALFORMED,
     "application/json"),
    ("clean end without [DONE]", chunked_head() + chunk(HELLO[: HELLO.index(b"data: [DONE]")]) + chunk(b""),
     res.STATUS_TRUNCATED, "without [DONE]"),
    ("bad chunk shape", chunked_head() + chunk(sse({"choices": [{"index": 0, "delta": {"content": 5}}]}))
     + chunk(b""), res.STATUS_MALFORMED, "not a string"),
]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_scripted_streams_and_one_kept_alive_connection(raw_server: Callable[..., RawServer],
                                                        transport: str) -> None:
    server = raw_server(lambda n: [(0.0, SCRIPTED[n % len(SCRIPTED)][1])])
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        for name, _, status, words in SCRIPTED * 2:
            r = client.send(body(), 5.0)
            assert r.status == status and (words is None or words in r.error), (name, r)
    assert server.connections == 1  # every response read to its end, malformed ones included


INTERIM = [  # (name, what the server sends before the final answer, pause between them)
    ("100 in the head's read", [b"HTTP/1.1 100 Continue\r\n\r\n"], 0.0),
    ("100 read on its own", [b"HTTP/1.1 100 Continue\r\n\r\n"], 0.05),
    ("103 with headers, then 100", [b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n",
                                    b"HTTP/1.1 100 Continue\r\n\r\n"], 0.02),
]


@pytest.mark.parametrize(("transport", "stamped"), [(name, True) for name in sorted(TRANSPORTS)]
                         + [("geventhttpclient", False)])
def test_interim_1xx_answers_before_the_final_one_are_skipped(raw_server: Callable[..., RawServer],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            transport: str, stamped: bool) -> None:
    """A gateway may send interim answers (RFC 9110 15.2) unasked. geventhttpclient released the socket when an
    interim answer ended (back to the pool, while the body was still to come), so the whole answer was recorded
    truncated after its first read, and the socket could serve another request mid-answer. Unstamped: the
    path of TLS sockets and of systems without kernel receive times."""
    if not stamped:
        monkeypatch.setattr("k3load.client.transport._SO_TIMESTAMPNS", None)
    def script(n: int) -> list[tuple[float, bytes]]:
        _name, interim, pause = INTERIM[n % len(INTERIM)]
        tokens = [sse({"id": "r1", "choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}) for i in range(3)]
        if pause == 0.0:
            return [(0.0, b"".join(interim) + chunked_head() + chunk(tokens[0])),
                    *((0.02, chunk(t)) for t in tokens[1:]), (0.02, chunk(HELLO) + chunk(b""))]
        return [*((pause, part) for part in interim), (pause, chunked_head()),
                *((0.02, chunk(t)) for t in tokens), (0.02, chunk(HELLO) + chunk(b""))]

    server = raw_server(script)
    with ChatClient(server.url, transport=transport, max_connections=1) as client:
        for name, _, _ in INTERIM * 2:
            r = client.send(body(), 5.0)
            assert (r.status, r.error, r.content) == (res.STATUS_OK, None, "tok0 tok1 tok2 hello"), (name, r)
            assert_timeline(r)
    assert server.connections == 1  # the connection was kept and reused, never given back mid-answer


def test_a_timed_out_request_frees_its_connection_slot(raw_server: Callable[..., RawServer]) -> None:
    def script(n: int) -> list[tuple[float, bytes]]:
        head = chunked_head() + chunk(HELLO[: HELLO.index(b"\n\n") + 2])
        return [(0.0, head), (3.0, chunk(b"data: [DONE]\n\n") + chunk(b""))] if n % 2 == 0 else [(0.0, head + chunk(
            b"data: [DONE]\n\n") + chunk(b""))]

    server = raw_server(script)
    for transport in TRANSPORTS:
        with ChatClient(server.url, transport=transport, max_connections=1) as client:
            stalled, after = client.send(body(), 0.3), client.send(body(), 2.0)
        assert stalled.status == res.STATUS_TIMEOUT and stalled.content == "hello", (transport, stalled)
        assert after.status == res.STATUS_OK and after.content == "hello", (transport, after)


def test_a_timeout_while_sending_the_body_frees_the_slot() -> None:
    """A server that accepts but never reads: sending a big body blocks until the deadline."""
    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        threading.Thread(target=lambda: [accepted.append(listener.accept()[0]) for _ in range(4)],
                         daemon=True).start()
        huge = b'{"stream":true,"pad":"' + b"a" * (48 << 20) + b'"}'
        for n, transport in enumerate(TRANSPORTS):
            with ChatClient(f"http://127.0.0.1:{listener.getsockname()[1]}", transport=transport,
                            max_connections=1) as client:
                results = [client.send(huge, 0.3, stream=True) for _ in range(2)]
            assert [r.status for r in results] == [res.STATUS_TIMEOUT] * 2, (transport, results)
            assert len(accepted) == 2 * (n + 1)  # the second request got the slot back and connected
    for conn in accepted:
        conn.close()


PLAIN_SCRIPT = """
import json, sys, time
import gevent.monkey
from k3load.client.chat import ChatClient
urls, body, deadline, out = json.loads(sys.argv[1]), sys.argv[2].encode(), float(sys.argv[3]), {}
out["patched"] = gevent.monkey.is_module_patched("socket")
for transport in ("geventhttpclient", "httpx"):
    for name, limit in (("ok", 20.0), ("stall_first", deadline), ("stall_mid", deadline)):
        with ChatClient(urls[name], transport=transport) as client:
            started = time.perf_counter()
            r = client.send(body, limit)
            out[transport + "/" + name] = [r.status, time.perf_counter() - started, len(r.chunk_ts)]
print(json.dumps(out))
"""


def test_plain_process_without_gevent_patching(start_sim: SimFactory) -> None:
    urls = {"ok": start_sim().base_url,
            "stall_first": start_sim("--slow-first-token-rate", "1", "--slow-first-token-ms", "60000").base_url,
            "stall_mid": start_sim("--slow-drip-rate", "1", "--slow-drip-ms", "60000").base_url}
    argv = [sys.executable, "-c", PLAIN_SCRIPT, json.dumps(urls), body().decode(), str(STALL_DEADLINE_S)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out.pop("patched") is False
    for key, (status, wall, chunks) in out.items():
        assert status == (res.STATUS_OK if key.endswith("/ok") else res.STATUS_TIMEOUT), (key, out)
        if not key.endswith("/ok"):
            assert wall < STALL_DEADLINE_S + SLACK_S and (chunks > 0) == key.endswith("stall_mid"), (key, out)


# -- no sockets ------------------------------------------------------------------------------------
def test_url_forms_stream_detection_and_bad_arguments() -> None:
    assert chat_url("http://h:8000") == ("http://h:8000", "/v1/chat/completions")
    assert chat_url("http://h:8000/v1/") == ("http://h:8000", "/v1/chat/completions")
    assert chat_url("https://gw.example/llm/v1") == ("https://gw.example", "/llm/v1/chat/completions")
    assert wants_stream(body()) and not wants_stream(body(stream=False)) and not wants_stream(b"[1]")
    # a nested "stream": true is not the request's own field
    assert not wants_stream(json.dumps({"tools": [{"stream": True}], "x": '"stream":true'}).encode())
    for url in ("ftp://h", "h:8000", "http://user:pw@h:8000"):
        with pytest.raises(ValueError):
            chat_url(url)
    with pytest.raises(ValueError, match="transport"):
        ChatClient("http://h:8000", transport="aiohttp")


@pytest.mark.parametrize(("payload", "detail"), [
    (b'{"error":{"message":"too\\nmany","type":"TooManyRequests","code":429}}', "TooManyRequests (429): too many"),
    (b'{"error":"rate limited"}', "rate limited"),
    (b'{"object":"error","message":"old vLLM","type":"BadRequestError","code":400}', "BadRequestError (400): old vLLM"),
    (b"<html>\n<h1>502 Bad Gateway</h1>", "<html>"),
    (b"", "(empty body)"),
])
def test_error_detail_forms(payload: bytes, detail: str) -> None:
    from k3load.client.exchange import _error_detail

    assert _error_detail(payload, payload.decode()) == detail


# -- kernel receive times --------------------------------------------------------------------------
# A server in its own process (this one is about to be blocked): the head and a role chunk at once,
# the first token 0.3 s later, the end 1.2 s after that: well after the client's block (0.1-0.8 s) ends, so
# the read after the block holds the token alone. A read that took the end too carries the end's receive
# time (the kernel stamps a TCP read with its last segment's): the end 0.5 s after the token came with the
# block's end on a busy machine, and the token was stamped 0.8 s late.
LATE_READ_SERVER = r"""
import socket, sys, time
srv = socket.create_server(("127.0.0.1", 0)); print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); buf = b""
while b"\r\n\r\n" not in buf:
    buf += conn.recv(65536)
def chunk(data): return b"%x\r\n" % len(data) + data + b"\r\n"
role = b'data: {"id":"r","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
token = b'data: {"id":"r","choices":[{"index":0,"delta":{"content":"hello"},"finish_reason":"stop"}]}\n\n'
conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
             + chunk(role))
time.sleep(0.3); conn.sendall(chunk(token))
time.sleep(1.2); conn.sendall(chunk(b"data: [DONE]\n\n") + chunk(b"")); conn.close()
"""


def _send_while_blocked(server_code: str, transport: str) -> tuple[StreamResult, list[float]]:
    """One request to `server_code` while the whole process (the gevent hub too) is blocked from 0.1 s to
    0.8 s, as a worker at full CPU is: the answer, and when the block ended. The answer was whole."""
    import gevent
    import gevent.monkey

    from k3load.clock import now

    server = subprocess.Popen([sys.executable, "-c", server_code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        blocked: list[float] = []

        def block() -> None:
            gevent.monkey.get_original("time", "sleep")(0.7)  # no greenlet runs: the hub is blocked too
            blocked.append(now())

        gevent.spawn_later(0.1, block)
        r = send(f"http://127.0.0.1:{port}", transport, body(), deadline_s=10.0)
    finally:
        server.kill()
        server.wait()
    assert r.status == res.STATUS_OK and r.content == "hello", r
    return r, blocked


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_token_is_stamped_when_it_arrived_not_when_a_busy_worker_read_it(transport: str) -> None:
    """The whole process is blocked (a worker at full CPU) from 0.1 s to 0.8 s after the head; the first
    token arrives at 0.3 s. geventhttpclient stamps it with the kernel's receive time (SO_TIMESTAMPNS),
    about 0.5 s before the process could read it; httpx cannot see its socket's reads and stamps it
    when read. Both timelines stay ordered."""
    r, blocked = _send_while_blocked(LATE_READ_SERVER, transport)
    assert_timeline(r)
    assert r.first_event_ts - r.first_byte_ts < 0.05  # the role chunk came with the head
    if transport == "geventhttpclient" and sys.platform.startswith("linux"):
        assert 0.15 < r.first_token_ts - r.first_byte_ts < 0.6, r  # 0.3 s after the head (later: a busy server)
        assert blocked[0] - r.first_token_ts > 0.15, (blocked, r)  # though read only after the block
    else:
        assert r.first_token_ts >= blocked[0], (blocked, r)


# The head and the first token in one write, 0.3 s after the request: a worker blocked from 0.1 s to
# 0.8 s reads both in the head's read.
LATE_HEAD_SERVER = LATE_READ_SERVER.replace(
    'conn.sendall(b"HTTP/1.1 200 OK', 'time.sleep(0.3); conn.sendall(b"HTTP/1.1 200 OK').replace(
    "             + chunk(role))\ntime.sleep(0.3); conn.sendall(chunk(token))",
    "             + chunk(role) + chunk(token))")


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_token_that_came_with_a_late_read_head_is_stamped_when_it_arrived(transport: str) -> None:
    """The first tokens often come with the response head when the worker is busy: geventhttpclient's own
    head read took them unstamped, so a first token was timed when the worker got round to the head
    (bench/peers.py: 16 streams of 16-token answers, the bare client's p99 0.84 ms late; 0.06 ms with the
    head stamped). Now the head's read carries the kernel's receive time, and first_byte_ts with it."""
    assert LATE_HEAD_SERVER.count("time.sleep(0.3)") == 1 and "chunk(role) + chunk(token))" in LATE_HEAD_SERVER
    r, blocked = _send_while_blocked(LATE_HEAD_SERVER, transport)
    assert_timeline(r)
    assert r.first_token_ts - r.first_byte_ts < 0.05  # one write: head, role and token
    if transport == "geventhttpclient" and sys.platform.startswith("linux"):
        assert 0.15 < r.first_byte_ts - r.send_ts < 0.6, r  # 0.3 s after the request (later: a busy machine)
        assert blocked[0] - r.first_token_ts > 0.15, (blocked, r)  # though read only after the block
    else:
        assert r.first_byte_ts >= blocked[0] and r.first_token_ts >= blocked[0], (blocked, r)


# -- how the stream arrived, and the request's own headers --------------------------------------------
TOKENS = [{"id": "r2", "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
          for i in range(6)]
ROLE = {"id": "r2", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_the_reads_that_carried_a_stream_are_counted_with_their_bytes(raw_server: Callable[..., RawServer],
                                                                      transport: str) -> None:
    """One write per event arrives in about one read each; a proxy's block (every event in one write) in
    one read. The bytes are the stream's to its [DONE], whatever the reads."""
    paced = [sse(ROLE)] + [sse(t) for t in TOKENS] + [sse("[DONE]")]
    block = b"".join(paced)
    server = raw_server(lambda n: [(0.0, chunked_head() + chunk(block) + chunk(b""))] if n == 0 else
                        [(0.0, chunked_head() + chunk(paced[0]))] + [(0.05, chunk(p)) for p in paced[1:]]
                        + [(0.0, chunk(b""))])
    with ChatClient(server.url, transport=transport) as client:
        whole_block, paced_out = client.send(body(), 10.0), client.send(body(), 10.0)
    for r in (whole_block, paced_out):
        assert r.status == res.STATUS_OK and r.content == "".join(f"w{i} " for i in range(6)), r
        assert r.stream_bytes == len(block), r
    assert whole_block.stream_reads == 1 and len(set(whole_block.chunk_ts)) == 1
    # eight writes 50 ms apart: a busy machine may read two at once, never more reads than writes
    assert 2 <= paced_out.stream_reads <= len(paced), paced_out


def test_a_request_carries_its_own_headers_and_the_sim_answers_with_its_id(start_sim: SimFactory) -> None:
    """vLLM takes X-Request-Id as its request id (`chatcmpl-<it>`) and echoes it under
    --enable-request-id-headers; the sim does the same. A request's own header never replaces the key, the
    content type or a gateway header, and a line break in one is refused before anything is sent."""
    sim = start_sim("--enable-request-id-headers")
    with ChatClient(sim.base_url, api_key=SECRET) as client:
        streamed = client.send(body(), 20.0, headers={"X-Request-Id": "k3load-abc", "X-Session-Id": "s1"})
        whole = client.send(body(stream=False), 20.0, headers={"X-Request-Id": "k3load-def"})
        for bad in ({"Authorization": "Bearer x"}, {"content-type": "text/plain"}, {"X-Id": "a\r\nEvil: 1"},
                    {"Bad Name": "x"}):
            with pytest.raises(ValueError, match="header"):
                client.send(body(), 20.0, headers=bad)
    assert streamed.status == whole.status == res.STATUS_OK, (streamed, whole)
    assert streamed.response_id == "chatcmpl-k3load-abc" and whole.response_id == "chatcmpl-k3load-def"
    assert streamed.stream_reads >= 1 and streamed.stream_bytes > 0
    assert whole.stream_reads is None and whole.stream_bytes is None  # not streamed
    # the echo, as vLLM's middleware answers it on every path
    assert httpx.get(sim.base_url + "/health", headers={"X-Request-Id": "q1"}).headers["x-request-id"] == "q1"
    assert len(httpx.get(sim.base_url + "/health").headers["x-request-id"]) == 32
