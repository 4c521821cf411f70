"""A real Debian nginx (tests/nginx_proxy.py) in front of the sim: what a gateway does to the raw stream.

Asserted on read counts and the servers' own counters, never on narrow timing windows (the suite runs on
oversubscribed CI machines): nginx's default `proxy_pass` buffers an SSE stream into a few large reads
(several events per read, the first read late), `proxy_buffering off` passes about one event per read as
the sim does directly; two upstreams alternate round-robin (each sim's `vllm:request_success_total` and
nginx's `$upstream_addr` agree), a session-affinity hash keeps one header value on one sim; a short
`proxy_read_timeout` answers 504 before the first byte and cuts a stream after it. These are the read
patterns the buffering and routing findings of issue 26 are built on.

Outside CI a missing nginx skips; under CI=true it fails (`make nginx` installs it).
"""

from __future__ import annotations

import itertools
import json
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3load.sim.process import SimProcess
from tests.conftest import FAST_SIM
from tests.nginx_proxy import NginxProxy, ProxyConfig, nginx_binary, nginx_factory, render

# 100 ms wall between events (1,000 model ms at FAST_SIM's 0.1): a 4 KB nginx buffer holds about 18 of them,
# so a buffered first read comes seconds-scale late, and direct reads seldom merge events on a busy machine.
DRIP = ["--slow-drip-rate", "1", "--slow-drip-ms", "1000", "--answer-tokens-min", "24", "--answer-tokens-max", "24"]
# 6 s wall of thinking spread over an answer's reasoning tokens: cut to two by max_tokens (THINKING), a silence
# of 3 s after each, three times a 1 s proxy_read_timeout.
SLOW_THINK = ["--think-ms", "60000"]
SHORT_READ_TIMEOUT_S = 1.0
STREAM = json.dumps({"model": "tiny", "stream": True,
                     "messages": [{"role": "user", "content": "Say something long."}]}).encode()
SHORT = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi."}]}
THINKING = {**SHORT, "max_tokens": 2}


@dataclass
class RawStream:
    """One HTTP exchange as the socket delivered it: each recv's bytes and when (seconds after sending)."""

    reads: list[tuple[float, bytes]]

    @property
    def raw(self) -> bytes:
        return b"".join(data for _, data in self.reads)

    @property
    def status(self) -> int:
        return int(self.raw.split(b" ", 2)[1])

    @property
    def events_per_read(self) -> list[int]:
        """Complete SSE events (ended by a blank line) per read, for the reads that ended any: an event cut
        across two reads counts in the read that ends it."""
        ends, counts, seen = [], [], 0
        for _, data in self.reads:
            seen += len(data)
            ends.append(seen)
        raw, offsets = self.raw, []
        start = raw.find(b"\r\n\r\n") + 4  # after the response's headers
        while (found := raw.find(b"\n\n", start)) >= 0:
            offsets.append(found + 2)
            start = found + 2
        previous = 0
        for end in ends:
            counts.append(sum(1 for offset in offsets if previous < offset <= end))
            previous = end
        return [count for count in counts if count]

    @property
    def events(self) -> int:
        return sum(self.events_per_read)

    @property
    def first_event_s(self) -> float:
        """When the first read that ended an event came."""
        raw_seen, first_end = 0, self.raw.find(b"\n\n", self.raw.find(b"\r\n\r\n") + 4) + 2
        for when, data in self.reads:
            raw_seen += len(data)
            if raw_seen >= first_end:
                return when
        raise AssertionError("no event in the stream")

    @property
    def done(self) -> bool:
        return b"data: [DONE]" in self.raw


def raw_post(base_url: str, body: bytes, headers: dict[str, str], timeout_s: float = 30.0) -> RawStream:
    """POST a chat body over a bare socket and keep every recv as it came, until the server closes."""
    host, port = base_url.removeprefix("http://").split(":")
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n{head}\r\n").encode() + body
    reads: list[tuple[float, bytes]] = []
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
        sent = time.monotonic()
        conn.sendall(request)
        while (left_s := deadline - time.monotonic()) > 0 and len(reads) < 10_000:
            conn.settimeout(left_s)
            data = conn.recv(65536)
            if not data:
                break
            reads.append((time.monotonic() - sent, data))
    return RawStream(reads)


def successes(sim: SimProcess) -> float:
    """The sim's own count of finished requests (vllm:request_success_total over every finished_reason)."""
    text = httpx.get(sim.base_url + "/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "vllm:request_success_total")


def host_port(sim: SimProcess) -> str:
    return sim.base_url.removeprefix("http://")


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimProcess]]:
    """Three sims started at once: a dripping one (streams, and non-streamed answers at full speed), a plain
    one (the second upstream), a slow thinker (the read timeout)."""
    nginx_binary()  # skip (or fail on CI) before starting anything
    folder = tmp_path_factory.mktemp("nginx-sims")
    wanted = {"drip": DRIP, "plain": [], "slow": SLOW_THINK}
    procs = {name: SimProcess([*FAST_SIM, *args], folder / f"{name}.log") for name, args in wanted.items()}
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(SimProcess.start, procs.values()))
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def start_nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[ProxyConfig], NginxProxy]]:
    yield from nginx_factory(tmp_path_factory.mktemp("nginx"))


# The read-timeout tests come first: the slow sim's answers they leave thinking finish during the streams
# below, not at the module's end (a sim stops after its open answers).
@pytest.fixture(scope="module")
def timeout_proxies(sims: dict[str, SimProcess],
                    start_nginx: Callable[[ProxyConfig], NginxProxy]) -> dict[str, NginxProxy]:
    """One nginx per test, so that each error log's "upstream timed out" is that test's own."""
    slow = sims["slow"].base_url
    return {"whole": start_nginx(ProxyConfig((slow,), read_timeout_s=SHORT_READ_TIMEOUT_S)),
            "buffered": start_nginx(ProxyConfig((slow,), read_timeout_s=SHORT_READ_TIMEOUT_S)),
            "unbuffered": start_nginx(ProxyConfig((slow,), buffering=False, read_timeout_s=SHORT_READ_TIMEOUT_S))}


def test_short_read_timeout_answers_504_before_the_first_byte(timeout_proxies: dict[str, NginxProxy]) -> None:
    """A non-streamed answer sends nothing while the sim thinks (6 s): nginx gives up at 1 s with its 504."""
    proxy = timeout_proxies["whole"]
    answer = raw_post(proxy.base_url, json.dumps(THINKING).encode(), {"X-Request-Id": "timeout-whole"})
    assert answer.status == 504 and b"<html>" in answer.raw, answer.raw[:300]
    [line] = proxy.log_for("timeout-whole")
    assert (line["status"], line["upstream_status"]) == ("504", "504"), line
    assert "upstream timed out" in proxy.error_log.read_text()


@pytest.mark.parametrize("mode", ["buffered", "unbuffered"])
def test_short_read_timeout_cuts_a_stream_after_its_first_byte(timeout_proxies: dict[str, NginxProxy],
                                                               mode: str) -> None:
    """A stream's headers and first events go out before the silence: nginx's timeout then cuts it, a 200
    without [DONE] (and without the chunked body's end), never a 504."""
    proxy = timeout_proxies[mode]
    body = json.dumps({**THINKING, "stream": True}).encode()
    stream = raw_post(proxy.base_url, body, {"X-Request-Id": f"timeout-{mode}"})
    assert stream.status == 200 and not stream.done, stream.raw[-300:]
    if mode == "unbuffered":  # the role chunk and the first reasoning token came before the silence
        assert stream.events == 2, stream.raw
    assert not stream.raw.endswith(b"0\r\n\r\n")  # the chunked body never ended properly
    [line] = proxy.log_for(f"timeout-{mode}")
    assert line["status"] == "200", line
    assert "upstream timed out" in proxy.error_log.read_text()


@dataclass
class Streamed:
    """The same streamed request sent direct and through both nginx configurations at once."""

    direct: RawStream
    buffered: RawStream
    unbuffered: RawStream
    proxies: dict[str, NginxProxy]


@pytest.fixture(scope="module")
def streamed(sims: dict[str, SimProcess], start_nginx: Callable[[ProxyConfig], NginxProxy]) -> Streamed:
    """One stream each way, concurrently (about 4 s in all, the drip's): the tests below only read them."""
    drip = sims["drip"].base_url
    proxies = {"buffered": start_nginx(ProxyConfig((drip,))),
               "unbuffered": start_nginx(ProxyConfig((drip,), buffering=False))}
    urls = {"direct": drip, **{name: proxy.base_url for name, proxy in proxies.items()}}
    with ThreadPoolExecutor(len(urls)) as pool:
        futures = {name: pool.submit(raw_post, url, STREAM, {"X-Request-Id": f"stream-{name}"})
                   for name, url in urls.items()}
        got = {name: future.result() for name, future in futures.items()}
    return Streamed(got["direct"], got["buffered"], got["unbuffered"], proxies)


def test_buffered_proxy_delivers_the_stream_in_few_large_reads(streamed: Streamed) -> None:
    """nginx's defaults hold the SSE until a 4 KB buffer fills: several events per read, the first one late."""
    direct, buffered = streamed.direct, streamed.buffered
    for stream in (direct, buffered):
        assert stream.status == 200 and stream.done and stream.events >= 30, stream.raw[:300]
    assert abs(buffered.events - direct.events) <= 3  # the same answer's length, give or take the role chunk
    assert len(direct.events_per_read) >= direct.events / 2, direct.events_per_read  # about one event a read
    assert statistics.median(direct.events_per_read) <= 2, direct.events_per_read
    assert len(buffered.events_per_read) <= buffered.events / 6, buffered.events_per_read
    assert buffered.events_per_read[0] >= 8, buffered.events_per_read  # nothing until a buffer's worth
    # With 100 ms between events the first block comes about 1.8 s in; direct, the first event at once.
    assert buffered.first_event_s >= 3 * max(direct.first_event_s, 0.1), (buffered.first_event_s,
                                                                            direct.first_event_s)


def test_unbuffered_proxy_passes_each_event_on_as_the_sim_writes_it(streamed: Streamed) -> None:
    """`proxy_buffering off` (HTTP/1.1 upstream): about one event per read, like the sim read directly."""
    unbuffered = streamed.unbuffered
    assert unbuffered.status == 200 and unbuffered.done and unbuffered.events >= 30, unbuffered.raw[:300]
    assert len(unbuffered.events_per_read) >= unbuffered.events / 2, unbuffered.events_per_read
    assert statistics.median(unbuffered.events_per_read) <= 2, unbuffered.events_per_read
    assert unbuffered.events_per_read[0] <= 3, unbuffered.events_per_read
    assert len(unbuffered.events_per_read) >= 4 * len(streamed.buffered.events_per_read)


def test_a_streamed_request_is_found_in_nginx_log_by_its_request_id(streamed: Streamed,
                                                                     sims: dict[str, SimProcess]) -> None:
    for name, proxy in streamed.proxies.items():
        [line] = proxy.log_for(f"stream-{name}")
        assert (line["status"], line["upstream_status"], line["uri"]) == ("200", "200", "/v1/chat/completions")
        assert line["upstream_addr"] == host_port(sims["drip"]) and line["nginx_request_id"], line


def test_every_path_is_proxied(streamed: Streamed, sims: dict[str, SimProcess]) -> None:
    """/metrics, /health, /v1/models and /version reach the sim through the gateway as they are."""
    proxied, direct = streamed.proxies["buffered"].base_url, sims["drip"].base_url
    with httpx.Client(timeout=10) as client:
        assert client.get(proxied + "/health").status_code == 200
        for path in ("/v1/models", "/version"):
            assert client.get(proxied + path).json() == client.get(direct + path).json()
        metrics = client.get(proxied + "/metrics")
    assert metrics.status_code == 200 and "vllm:request_success_total" in metrics.text


def _send_short(proxy: NginxProxy, client: httpx.Client, request_id: str, session: str) -> str:
    """One short non-streamed answer through `proxy`; the upstream nginx chose for it, from its access log."""
    response = client.post(proxy.base_url + "/v1/chat/completions", json=SHORT,
                           headers={"X-Request-Id": request_id, "X-Session-Id": session})
    assert response.status_code == 200, response.text
    [line] = proxy.log_for(request_id)
    return str(line["upstream_addr"])


def _counted(sims: list[SimProcess], before: list[float], total: int) -> list[float]:
    """Each sim's own finished-request count since `before`, once they add up to `total` (at most 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        deltas = [successes(sim) - start for sim, start in zip(sims, before, strict=True)]
        if sum(deltas) >= total or time.monotonic() > deadline:
            return deltas
        time.sleep(0.05)


def test_round_robin_alternates_between_two_sims(sims: dict[str, SimProcess],
                                                 start_nginx: Callable[[ProxyConfig], NginxProxy]) -> None:
    """Two upstreams, nginx's default balancing: requests alternate, whatever the session header says; each
    sim's own counter agrees with nginx's log."""
    pair = [sims["drip"], sims["plain"]]
    proxy = start_nginx(ProxyConfig(tuple(sim.base_url for sim in pair)))
    before = [successes(sim) for sim in pair]
    with httpx.Client(timeout=30) as client:
        chosen = [_send_short(proxy, client, f"rr-{i}", "one-session") for i in range(6)]
    assert all(a != b for a, b in itertools.pairwise(chosen)), chosen
    assert sorted(set(chosen)) == sorted(host_port(sim) for sim in pair)
    assert _counted(pair, before, 6) == [chosen.count(host_port(sim)) for sim in pair] == [3, 3]


def test_affinity_keeps_one_session_on_one_sim(sims: dict[str, SimProcess],
                                               start_nginx: Callable[[ProxyConfig], NginxProxy]) -> None:
    """`hash $http_x_session_id consistent`: every request of a session reaches the same sim."""
    pair = [sims["drip"], sims["plain"]]
    proxy = start_nginx(ProxyConfig(tuple(sim.base_url for sim in pair), affinity_header="X-Session-Id"))
    before = [successes(sim) for sim in pair]
    by_session: dict[str, set[str]] = {}
    with httpx.Client(timeout=30) as client:
        for i in range(12):  # four sessions, interleaved
            session = f"session-{i % 4}"
            by_session.setdefault(session, set()).add(_send_short(proxy, client, f"aff-{i}", session))
    assert all(len(upstreams) == 1 for upstreams in by_session.values()), by_session
    routed = [upstream for upstreams in by_session.values() for upstream in upstreams]
    assert _counted(pair, before, 12) == [3 * routed.count(host_port(sim)) for sim in pair]


def test_a_config_renders_to_the_directives_it_names(tmp_path: Path) -> None:
    """No nginx needed: each ProxyConfig field is the directive the tests above rely on, every path in DIR."""
    buffered = render(ProxyConfig(("http://127.0.0.1:1",)), tmp_path, 8080)
    assert "proxy_buffering" not in buffered and "proxy_http_version" not in buffered  # nginx's defaults
    assert "proxy_read_timeout 60000ms;" in buffered and "hash " not in buffered
    assert "listen 127.0.0.1:8080;" in buffered and "daemon off;" in buffered
    assert all(f"{kind}_temp_path {tmp_path}" in buffered for kind in ("client_body", "proxy", "fastcgi"))
    routed = render(ProxyConfig(("http://127.0.0.1:1", "http://127.0.0.1:2/"), buffering=False,
                                read_timeout_s=1.5, affinity_header="X-Session-Id"), tmp_path, 8080)
    for directive in ("proxy_buffering off;", "proxy_http_version 1.1;", 'proxy_set_header Connection "";',
                      "proxy_read_timeout 1500ms;", "hash $http_x_session_id consistent;",
                      "server 127.0.0.1:1;", "server 127.0.0.1:2;"):
        assert directive in routed
    for bad in ({"upstreams": ()}, {"upstreams": ("127.0.0.1:1",)}, {"upstreams": ("http://h:1/v1",)},
                {"upstreams": ("http://h:1",), "read_timeout_s": 0},
                {"upstreams": ("http://h:1",), "affinity_header": "X-Id; evil"}):
        with pytest.raises(ValueError):
            ProxyConfig(**bad)
