"""Several /metrics sources: one line per source per tick, events per source, a silent source that never
delays another (the scrape timeout honoured), the API key only on the target's host:port, the `k3load
sample` options; and the Prometheus reader's grid, chunks and error spells against a fake query API."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from k3load.evidence import lines
from k3load.sampler import Sampler, promapi
from k3load.sampler.fetch import Fetched, same_origin
from k3load.sampler.promapi import PrometheusReader, query_expr
from tests.sim.test_sampler_sim import _CLI, PROMPT_TOKENS, ask, bad_server, events, read_jsonl, read_metrics, wait_for  # noqa: F401


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers a byte."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


def test_two_sources_each_get_their_lines_and_events(start_sim, tmp_path):
    sim = start_sim()
    port = urllib.parse.urlsplit(sim.base_url).port
    urls = [f"http://127.0.0.1:{port}/metrics", f"http://localhost:{port}/metrics"]
    out = tmp_path / "run"
    sampler = Sampler(out, urls, interval_s=0.1).start()
    assert ask(sim.base_url).status_code == 200
    wait_for(lambda: {line["source"] for line in read_metrics(out)
                      if (line.get("samples") or {}).get(PROMPT_TOKENS)} == set(urls), what="both sources count")
    summary = sampler.stop()
    lines = read_metrics(out)
    assert all(line["ok"] for line in lines) and {line["source"] for line in lines} == set(urls)
    assert set(summary["sources"]) == set(urls) and summary["scrapes"] == len(lines)
    assert {e["source"] for e in events(out, "cache_config")} == set(urls)
    (start,) = events(out, "sampler_start")
    assert start["metrics_urls"] == urls and start["health_url"] == f"http://127.0.0.1:{port}/health"


def test_a_silent_source_times_out_and_never_delays_the_other(start_sim, silent_port, tmp_path):
    sim = start_sim()
    silent = f"http://127.0.0.1:{silent_port}/metrics"
    out = tmp_path / "run"
    sampler = Sampler(out, [sim.base_url + "/metrics", silent], interval_s=0.1, timeout_s=0.5,
                      health_url=sim.base_url + "/health").start()
    wait_for(lambda: [line for line in read_metrics(out) if line["source"] == silent], 10,
             "a timed-out scrape")
    time.sleep(0.6)
    started = time.monotonic()
    summary = sampler.stop()
    assert time.monotonic() - started < 2.5
    lines = read_metrics(out)
    hung = [line for line in lines if line["source"] == silent]
    fine = [line for line in lines if line["source"] == sim.base_url + "/metrics"]
    assert hung and all(line["error"] == "timeout after 0.5 s" and line["scrape_ms"] >= 450 for line in hung)
    assert all(line["ok"] for line in fine) and len(fine) >= 2 * len(hung)
    gaps = sorted(b["ts"] - a["ts"] for a, b in itertools.pairwise(fine))
    assert gaps[len(gaps) // 2] < 0.25  # about every 0.1 s: never waiting on the silent source's 0.5 s
    assert summary["sources"][silent]["failures"] == len(hung)
    assert not events(out, "server_down")  # /health is the target's, not the silent source's


def test_the_key_goes_only_to_the_target_host_and_port(bad_server, silent_port, tmp_path):  # noqa: F811
    url, handler = bad_server
    handler.mode = "ok"
    other = url.replace("127.0.0.1", "localhost")  # the same server under another host name: not the target
    secret = "sk-k3load-sources-secret"
    sampler = Sampler(tmp_path / "run", [url + "/metrics", other + "/metrics"], interval_s=0.1, api_key=secret,
                      health_url=url + "/health", prometheus_url=f"http://127.0.0.1:{silent_port}",
                      timeout_s=0.3).start()
    wait_for(lambda: len(read_metrics(tmp_path / "run")) >= 4, what="scrapes")
    sampler.stop()
    assert set(handler.seen_auth) == {f"Bearer {secret}", None}
    assert handler.seen_auth.count(None) >= 2  # every scrape of the other host name, none keyed
    assert not any(secret in "".join(lines(path)) for path in (tmp_path / "run").iterdir())
    assert same_origin("http://h:80/metrics", "http://h/health") and not same_origin("https://h/x", "http://h/x")


def test_sample_command_takes_several_sources_and_a_scrape_timeout(start_sim, silent_port, tmp_path):
    sim = start_sim()
    silent = f"http://127.0.0.1:{silent_port}/metrics"
    done = subprocess.run([sys.executable, "-c", _CLI, "--metrics-url", sim.base_url + "/metrics", "--metrics-url",
                           silent, "--health-url", sim.base_url + "/health", "--scrape-timeout", "0.3", "--nvml", "off",
                           "--interval", "0.2", "--duration", "1", "--out", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = read_metrics(tmp_path / "a")
    assert {line.get("error") for line in lines if line["source"] == silent} == {"timeout after 0.3 s"}
    assert events(tmp_path / "a", "sampler_start")[0]["timeout_s"] == 0.3
    bad = subprocess.run([sys.executable, "-c", _CLI, "--out", str(tmp_path / "b")], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "give --metrics-url (repeatable) or --prometheus-url" in bad.stderr


# -- the Prometheus reader against a fake query API ------------------------------------------------------
class FakeApi:
    """Answers query_range with one counter per instance (value = the timestamp) or an error, and records
    every (start, end, step) asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[float, float, float]] = []
        self.fail: str | None = None

    def __call__(self, url: str) -> Fetched:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
        start, end, step = (float(query[k][0]) for k in ("start", "end", "step"))
        self.asked.append((start, end, step))
        if self.fail:
            return Fetched(False, 503, json.dumps({"status": "error", "errorType": "unavailable",
                                                   "error": self.fail}), "HTTP 503", 1.0)
        n = round((end - start) / step) + 1
        values = [[round(start + i * step, 3), str(start + i * step)] for i in range(n)]
        result = [{"metric": {"__name__": "vllm:prompt_tokens_total", "instance": inst, "job": "vllm",
                              "model_name": "m", "engine": "0"}, "values": values} for inst in ("a:1", "b:2")]
        result += [{"metric": {"__name__": "up", "instance": "b:2", "job": "vllm"},
                    "values": [[v[0], "0"] for v in values]}]
        return Fetched(True, 200, json.dumps({"status": "success", "data": {"resultType": "matrix",
                                                                            "result": result}}), None, 1.0)


class Sink:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []
        self.events: list[tuple[str, float, dict[str, Any]]] = []

    def append(self, line: dict[str, Any]) -> None:
        self.lines.append(line)

    def event(self, name: str, ts: float, **fields: Any) -> None:
        self.events.append((name, ts, fields))


def test_reader_walks_the_grid_in_bounded_chunks_and_says_errors_once(monkeypatch):
    monkeypatch.setattr(promapi, "VALUE_BUDGET", 30)  # 3 series: 10 points a query
    api, sink = FakeApi(), Sink()
    reader = PrometheusReader("http://prom:9090/", 'job="vllm"', 1000.0, 1.0, api, sink, sink.event,  # type: ignore[arg-type]
                              settle_s=5.0)
    reader.tick(1004.0)
    assert api.asked == []  # nothing is 5 s old yet
    reader.tick(1010.0)  # first answer: the guess of 1,000 series asks for 1 point ...
    reader.tick(1030.0)  # ... then 3 series seen: 10 points
    assert api.asked == [(1000.0, 1000.0, 1.0), (1001.0, 1010.0, 1.0)]
    api.fail = "too busy"
    reader.tick(1031.0)
    reader.tick(1032.0)
    api.fail = None
    reader.tick(1040.0, final=True)
    assert api.asked[-1] == (1031.0, 1040.0, 1.0) and all(end - start <= 9 for start, end, _ in api.asked)
    names = [name for name, _ts, _fields in sink.events]
    assert names.count("prometheus_error") == 1 and names.count("prometheus_back") == 1
    error = next(fields for name, _ts, fields in sink.events if name == "prometheus_error")
    assert error == {"source": "http://prom:9090/", "reason": "HTTP 503: unavailable: too busy", "http_status": 503}
    good = [line for line in sink.lines if line["source"] == "prometheus:a:1" and line["ok"]]
    assert [line["ts"] for line in good] == [1000.0 + i for i in range(41)]  # every step once, in order
    assert good[3]["samples"] == {'vllm:prompt_tokens_total{engine="0",model_name="m"}': 1003.0}
    down = [line for line in sink.lines if line["source"] == "prometheus:b:2"]
    assert all(not line["ok"] for line in down) and down[0]["error"].startswith("up=0")
    assert "prometheus_incomplete" not in names and reader.summary()["read_to_ts"] == 1040.0


def test_query_expression_takes_the_selector_with_or_without_braces():
    assert query_expr() == '{__name__=~"vllm:.+|up|process_start_time_seconds"}'
    assert query_expr('{job="vllm",cluster="a"}') == query_expr('job="vllm",cluster="a"') == \
        '{__name__=~"vllm:.+|up|process_start_time_seconds",job="vllm",cluster="a"}'
