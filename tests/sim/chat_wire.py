"""The chat client's test kit, shared by its tests and the ones built on it (done reasons, tool cadence,
reliability, time to first answer): a request body as the runner hands it over, the send and timeline check, and
a bare scripted HTTP/1.1 server on loopback (`raw_server`) for the bytes no well-behaved server sends."""

from __future__ import annotations

import json
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult

SimFactory = Callable[..., Any]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
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

