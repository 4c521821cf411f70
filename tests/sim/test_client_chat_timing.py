"""When ChatClient stamps what arrived: a token by the kernel's receive time, not when a busy worker read it
(geventhttpclient; httpx stamps it when read), and the reads and bytes that carried a stream.

Servers in their own processes or the bare scripted one; the timelines stay ordered whatever the reads.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from k3load.client import result as res
from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult
from k3load.client.transport import TRANSPORTS
from tests.sim.chat_wire import RawServer, assert_timeline, body, chunk, chunked_head, raw_server, send, sse

__all__ = ["raw_server"]  # the scripted server's fixture


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
