"""The sampler reading vllm:* back from a REAL Prometheus (Debian's `prometheus`, `make prometheus`) that
scrapes the sim every second on loopback: lines shaped as a direct scrape's, counters equal to what the sim
itself says at the end, the cache_config event; an unreachable or refusing Prometheus is said, never a crash.

Outside CI a missing binary skips (with the reason); under CI=true it fails, as the chromium test does."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import httpx
import pytest

from k3load.sampler import Sampler
from k3load.sampler.prom import parse
from k3load.sim.process import SimProcess
from tests.conftest import FAST_SIM
from tests.sim.test_sampler_sim import ASK, events, read_metrics, wait_for

COUNTERS = ('vllm:prompt_tokens_total{engine="0",model_name="tiny"}',
            'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"}',
            'vllm:generation_tokens_total{engine="0",model_name="tiny"}')


def _binary() -> str:
    found = shutil.which("prometheus")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("prometheus is missing on CI: `make test` installs Debian's prometheus first")
    pytest.skip("prometheus is not installed here (make test / make prometheus installs it on Debian)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


@pytest.fixture(scope="session")
def scraped_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    sim = SimProcess(FAST_SIM, tmp_path_factory.mktemp("prom-sim") / "sim.log").start()
    yield sim
    sim.stop()


@pytest.fixture(scope="session")
def prometheus(scraped_sim: SimProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus scraping the sim's /metrics every second; its base URL once the target is up."""
    binary = _binary()
    folder = tmp_path_factory.mktemp("prometheus")
    target = scraped_sim.base_url.removeprefix("http://")
    (folder / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: vllm\n    static_configs: [{{targets: ['{target}']}}]\n")
    url = f"http://127.0.0.1:{_free_port()}"
    with (folder / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={folder / 'data'}",
                                 f"--web.listen-address={url.removeprefix('http://')}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: _answers(url + "/-/ready"), 30, "prometheus ready")
        wait_for(lambda: _up(url), 30, "the sim scraped")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def _up(url: str) -> bool:
    try:
        result = _get_json(url + "/api/v1/query?query=up")["data"]["result"]
    except (OSError, ValueError, KeyError):
        return False
    return any(r["value"][1] == "1" for r in result)


def _direct(sim: SimProcess) -> dict[str, float | None]:
    with urllib.request.urlopen(sim.base_url + "/metrics", timeout=5) as response:
        return parse(response.read().decode()).samples


def test_prometheus_lines_match_a_direct_scrape(prometheus, scraped_sim, tmp_path):
    out = tmp_path / "run"
    before = _direct(scraped_sim)
    sampler = Sampler(out, None, interval_s=0.5, prometheus_url=prometheus, prometheus_selector='job="vllm"').start()
    time.sleep(1.0)
    for _ in range(3):
        response = httpx.post(f"{scraped_sim.base_url}/v1/chat/completions", timeout=30,
                              json={"model": "tiny", "messages": ASK, "max_tokens": 8})
        assert response.status_code == 200
    time.sleep(3.0)  # three scrape intervals: Prometheus has the final counters
    summary = sampler.stop()
    after = _direct(scraped_sim)
    instance = scraped_sim.base_url.removeprefix("http://")
    lines = read_metrics(out)
    assert lines and {line["source"] for line in lines} == {f"prometheus:{instance}"}
    assert all(line["ok"] and line["vllm_series"] > 300 for line in lines)
    assert set(lines[0]) == {"ts", "source", "ok", "scrape_ms", "load_generator_cpu_pct", "vllm_series", "samples",
                             "legacy", "process_start_ts"}
    assert set(lines[-1]["samples"]) == set(after)  # keys as a direct scrape's: no instance/job labels
    for key in COUNTERS:
        assert lines[0]["samples"][key] == before[key] < after[key], key
        assert lines[-1]["samples"][key] == after[key], key
    steps = [b["ts"] - a["ts"] for a, b in itertools.pairwise(lines)]
    assert steps and all(abs(step - 0.5) < 0.01 for step in steps)
    (config,) = events(out, "cache_config")
    assert config["source"] == f"prometheus:{instance}" and config["labels"][0]["block_size"] == "16"
    assert not events(out, "prometheus_error") and not events(out, "counter_reset")
    assert summary["prometheus"]["instances"] == [instance] and summary["prometheus"]["lines"] == len(lines)


def test_unreachable_or_refusing_prometheus_is_said_never_a_crash(prometheus, tmp_path):
    closed = f"http://127.0.0.1:{_free_port()}"
    Sampler(tmp_path / "gone", None, interval_s=0.5, prometheus_url=closed).start().stop()
    (error,) = events(tmp_path / "gone", "prometheus_error")
    assert error["source"] == closed and error["reason"] == "connection refused"
    (line,) = read_metrics(tmp_path / "gone")
    assert line["ok"] is False and line["source"] == f"prometheus:{closed}"
    assert line["error"] == "prometheus: connection refused" and "samples" not in line
    assert events(tmp_path / "gone", "prometheus_incomplete") and not events(tmp_path / "gone", "sampler_error")

    Sampler(tmp_path / "bad", None, interval_s=0.5, prometheus_url=prometheus,
            prometheus_selector="job=").start().stop()
    (error,) = events(tmp_path / "bad", "prometheus_error")
    assert error["http_status"] == 400 and error["reason"].startswith("HTTP 400: bad_data: ")
    assert "parse error" in error["reason"]
    assert all(not line["ok"] for line in read_metrics(tmp_path / "bad"))
