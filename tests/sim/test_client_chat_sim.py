"""ChatClient over both transports against a real sim on loopback: K3 and K2 tool calls, mid-stream errors,
cut streams, HTTP errors, a dead server, and a request's own headers.

Every fault ends as a StreamResult, never an exception; deadlines hold while a server stalls before
or during the stream, under gevent (this process: conftest imports locust) and in a plain process.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from k3load.client import result as res
from k3load.client.chat import ChatClient
from k3load.client.transport import TRANSPORTS
from tests.sim.chat_wire import SECRET, WEATHER, SimFactory, assert_timeline, body, send

SLACK_S = 1.5  # far below the 6 s stall: a request that waited for the server would fail
STALL_DEADLINE_S = 0.8  # against 6 s stalls; leaves a loaded machine time to deliver a first token


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
