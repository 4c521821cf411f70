"""The sim's gateway and wire faults, seen from a client over real HTTP (and raw sockets where only
the socket can tell a TCP reset from a clean close): the misbehaviour of what stands in front of an
engine, so that verdict rules can be tested against it."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from k3load.sim.config import ProfileError, load_profile
from tests.probes import Target, chat, scrape, total

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HI = [{"role": "user", "content": "hi"}]


def _t(sim) -> Target:
    return Target("sim", sim.base_url, "tiny")


def _raw_chat(base_url: str, body: dict) -> tuple[bytes, OSError | None]:
    """POST a chat over a bare socket; what came back, and the reset error if the peer sent RST.
    A clean close (FIN) ends with recv() == b"" and no error."""
    url = urlsplit(base_url)
    payload = json.dumps({"model": "tiny", **body}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    got = b""
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        sock.sendall(head.encode() + payload)
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError as exc:
            return got, exc
    return got, None


def test_html_error_page_and_retry_after(start_sim, client):
    sim = start_sim("--http-error-rate", "1", "--http-error-status", "502", "--http-error-style", "html",
                    "--http-error-retry-after-s", "7")
    resp = chat(_t(sim), client, messages=ASK)
    assert resp.status_code == 502 and resp.headers["content-type"] == "text/html"
    assert resp.headers["retry-after"] == "7" and resp.headers["server"] == "nginx"
    assert resp.text == ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
                         "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
                         "</body>\r\n</html>\r\n")
    assert sim.metrics_url == ""  # no second port unless asked for
    limited = start_sim("--http-error-rate", "1", "--http-error-status", "429", "--http-error-retry-after-s", "3")
    resp = chat(_t(limited), client, messages=ASK)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "3"
    assert resp.json()["error"]["type"] == "TooManyRequests"
    plain = start_sim("--http-error-rate", "1", "--http-error-status", "429", "--http-error-style", "gateway")
    assert "retry-after" not in chat(_t(plain), client, messages=ASK).headers


def test_connection_reset_before_any_response_byte(start_sim, client):
    sim = start_sim("--connection-reset-rate", "1")
    got, err = _raw_chat(sim.base_url, {"messages": HI})
    assert got == b"" and isinstance(err, ConnectionResetError)
    with pytest.raises(httpx.ReadError) as caught:
        chat(_t(sim), client, messages=HI)
    assert "Connection reset by peer" in str(caught.value)
    assert client.get(f"{sim.base_url}/health").status_code == 200  # the server itself is fine


def test_midstream_reset_is_a_reset_not_a_clean_close(start_sim):
    body = {"messages": HI, "stream": True, "max_tokens": 30, "ignore_eos": True}
    got, err = _raw_chat(start_sim("--midstream-reset-rate", "1").base_url, body)
    assert isinstance(err, ConnectionResetError)
    assert got.startswith(b"HTTP/1.1 200") and got.count(b"data: {") >= 5 and b"[DONE]" not in got
    cut, clean = _raw_chat(start_sim("--truncate-stream-rate", "1").base_url, body)
    assert clean is None and cut.count(b"data: {") >= 5 and b"[DONE]" not in cut  # truncate: FIN, no RST


def _until(sock: socket.socket, got: bytes, end: bytes) -> bytes:
    while not got.endswith(end):
        data = sock.recv(65536)
        assert data, got
        got += data
    return got


def test_a_body_held_open_after_done_ends_after_the_hold_or_when_the_client_leaves(start_sim):
    """A proxy that passes `data: [DONE]` on and holds the chunked body open: the last chunk comes only
    after the hold; a client that leaves at [DONE] ends the hold (the sim stops at once)."""
    payload = json.dumps({"model": "tiny", "messages": HI, "stream": True, "max_tokens": 4}).encode()
    for hold_ms in ("1500", "60000"):
        sim = start_sim("--hold-after-done-rate", "1", "--hold-after-done-ms", hold_ms)
        url = urlsplit(sim.base_url)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n")
        with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
            sock.sendall(head.encode() + payload)
            got = _until(sock, b"", b"data: [DONE]\n\n\r\n")
            done_at = time.monotonic()
            assert b"transfer-encoding: chunked" in got.lower() and not got.endswith(b"0\r\n\r\n")
            if hold_ms == "1500":
                _until(sock, got, b"0\r\n\r\n")
                assert 1.0 < time.monotonic() - done_at < 10
        if hold_ms == "60000":
            started = time.monotonic()
            assert sim.stop() == 0 and time.monotonic() - started < 5  # no handler left holding


def test_resets_are_drawn_from_the_seed(start_sim, client):
    def pattern(sim) -> list[bool]:
        out = []
        for i in range(12):
            try:
                out.append(chat(_t(sim), client, messages=[{"role": "user", "content": f"q{i}"}],
                                max_tokens=2).status_code != 200)
            except httpx.ReadError:
                out.append(True)
        return out

    first = pattern(start_sim("--connection-reset-rate", "0.5"))
    assert 0 < sum(first) < 12 and pattern(start_sim("--connection-reset-rate", "0.5")) == first


def test_health_flaps_while_the_engine_is_fine(start_sim, client):
    sim = start_sim("--health-flap-period-s", "1", "--metrics-port", "-1")
    engine_health = sim.metrics_url.removesuffix("/metrics") + "/health"
    readings: list[tuple[float, int]] = []
    start = time.monotonic()
    while time.monotonic() - start < 3.4:
        readings.append((time.monotonic(), client.get(f"{sim.base_url}/health").status_code))
        assert client.get(engine_health).status_code == 200
        time.sleep(0.05)
    runs: list[list[float]] = []  # [status, first seen, last seen]
    for at, status in readings:
        if runs and runs[-1][0] == status:
            runs[-1][2] = at
        else:
            runs.append([status, at, at])
    assert {r[0] for r in runs} == {200, 503} and len(runs) >= 3
    for status, first, last in runs[1:-1]:  # whole periods: about a second each
        assert 0.5 <= last - first <= 1.1, (status, last - first)
    assert chat(_t(sim), client, messages=HI, max_tokens=2).status_code == 200


def test_metrics_refused_on_the_api_port_and_served_on_the_metrics_port(start_sim, client):
    sim = start_sim("--metrics-http-status", "404", "--metrics-port", "-1")
    resp = client.get(f"{sim.base_url}/metrics")
    assert resp.status_code == 404 and resp.text == "404 page not found\n"
    assert resp.headers["content-type"].startswith("text/plain")
    api, metrics = urlsplit(sim.base_url), urlsplit(sim.metrics_url)
    assert metrics.hostname == api.hostname and metrics.port not in (api.port, 0) and metrics.path == "/metrics"
    assert f"metrics on {sim.metrics_url}" in sim.log_path.read_text()
    assert chat(_t(sim), client, messages=HI, max_tokens=2).status_code == 200
    engine = Target("engine", sim.metrics_url.removesuffix("/metrics"), "tiny")
    samples = scrape(engine, client)
    assert total(samples, "vllm:request_success_total") == 1 and total(samples, "k3load_sim_info") == 1
    assert client.get(f"{engine.base_url}/health").status_code == 200
    assert client.post(f"{engine.base_url}/v1/chat/completions", json={}).status_code == 404  # metrics only


def _timed_scrape(client: httpx.Client, url: str) -> float:
    start = time.monotonic()
    assert client.get(url).status_code == 200
    return time.monotonic() - start


def test_metrics_stall_window_follows_chat_requests(start_sim, client):
    """Window [after=2, after+count=4) chat requests received: scrapes stall 0.6 s there, not outside;
    the chat API keeps serving while a scrape is held."""
    sim = start_sim("--metrics-stall-ms", "600", "--metrics-stall-after-requests", "2",
                    "--metrics-stall-requests", "2")
    url, t = f"{sim.base_url}/metrics", _t(sim)
    assert _timed_scrape(client, url) < 0.3
    chat(t, client, messages=HI, max_tokens=2)
    assert _timed_scrape(client, url) < 0.3
    chat(t, client, messages=HI, max_tokens=2)
    assert _timed_scrape(client, url) >= 0.6
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(timeout=60) as other:
        held = pool.submit(_timed_scrape, other, url)
        time.sleep(0.1)
        assert chat(t, client, messages=HI, max_tokens=2).status_code == 200  # third: still in the window
        assert not held.done() and held.result() >= 0.6
    assert _timed_scrape(client, url) >= 0.6
    chat(t, client, messages=HI, max_tokens=2)  # fourth: the window closes
    assert _timed_scrape(client, url) < 0.3


def test_context_over_a_small_max_model_len_gets_vllms_exact_400(start_sim, client):
    t = _t(start_sim("--max-model-len", "64"))
    words = [{"role": "user", "content": "word " * 100}]
    expected = {"error": {
        "message": "This model's maximum context length is 64 tokens. However, your prompt contains at least 65 "
                   "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                   "of the input prompt. (parameter=input_tokens, value=65)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}}
    for stream in (False, True):  # as vLLM: a JSON 400 even when streaming was asked for
        resp = chat(t, client, messages=words, max_tokens=4, stream=stream)
        assert resp.status_code == 400 and resp.json() == expected
        assert resp.headers["content-type"] == "application/json; charset=utf-8"
    assert chat(t, client, messages=HI, max_tokens=4).status_code == 200


def test_profile_sets_the_gateway_faults(tmp_path: Path):
    profile = tmp_path / "gateway.yaml"
    profile.write_text("engine:\n  metrics_port: -1\nfaults:\n  http_error_style: html\n"
                       "  http_error_retry_after_s: 30\n  connection_reset_rate: 0.1\n  midstream_reset_rate: 0.2\n"
                       "  health_flap_period_s: 5\n  metrics_http_status: 404\n  metrics_stall_ms: 2500\n"
                       "  metrics_stall_after_requests: 10\n  metrics_stall_requests: 3\n")
    config = load_profile(profile)
    f = config.faults
    assert config.metrics_port == -1 and f.http_error_style == "html" and f.http_error_retry_after_s == 30
    assert (f.connection_reset_rate, f.midstream_reset_rate, f.health_flap_period_s) == (0.1, 0.2, 5.0)
    assert (f.metrics_http_status, f.metrics_stall_ms) == (404, 2500.0)
    assert (f.metrics_stall_after_requests, f.metrics_stall_requests) == (10, 3)


@pytest.mark.parametrize(("section", "line", "field"), [
    ("faults", "http_error_style: xml", "http_error_style"),
    ("faults", "metrics_http_status: 302", "metrics_http_status"),
    ("faults", "http_error_status: 200", "http_error_status"),
    ("faults", "connection_reset_rate: 2", "connection_reset_rate"),
    ("faults", "metrics_stall_ms: -1", "metrics_stall_ms"),
    ("faults", "hold_after_done_ms: -1", "hold_after_done_ms"),
    ("faults", "hold_after_done_rate: 1.5", "hold_after_done_rate"),
    ("faults", "health_flap_period_s: fast", "health_flap_period_s"),
    ("faults", "http_error_retry_after_s: 1.5", "http_error_retry_after_s"),
    ("engine", "metrics_port: -2", "metrics_port"),
])
def test_bad_gateway_fault_values_name_the_field(tmp_path: Path, section: str, line: str, field: str):
    profile = tmp_path / "bad.yaml"
    profile.write_text(f"{section}:\n  {line}\n")
    with pytest.raises(ProfileError, match=field):
        load_profile(profile)
