"""ChatClient over both transports against a bare scripted HTTP server, for the bytes no well-behaved server
sends (garbage SSE, a key-echoing 401, interim 1xx answers, a stall then an answer), and its arguments with no
socket at all.

Every fault ends as a StreamResult, never an exception; a key is sent but never shown; a timed-out request gives
its connection slot back.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from k3load.client import result as res
from k3load.client.chat import ChatClient, chat_url, wants_stream
from k3load.client.transport import TRANSPORTS, shared_ssl_context
from tests.sim.chat_wire import (
    HELLO,
    SECRET,
    RawServer,
    assert_timeline,
    body,
    chunk,
    chunked_head,
    http,
    raw_server,
    send,
    sse,
)

__all__ = ["raw_server"]  # the scripted server's fixture


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
