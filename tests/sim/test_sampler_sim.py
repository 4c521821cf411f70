"""The sampler against real servers on loopback: the sim (restarts, faults, OOM), a misbehaving HTTP
server (garbage, 500, hangs), a log command, the fake NVML, and the `k3load sample` command."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import gevent.monkey
import httpx
import pytest

from k3load.evidence import SeriesTable, lines, metrics_file
from k3load.sampler import Sampler
from k3load.sampler.cpu_wait import read_run_queue_ns
from k3load.sampler.loop import CpuMeter
from tests.fake_nvml import NVML_ERROR_LIBRARY_NOT_FOUND, FakeGpu, FakeNvml

ASK = [{"role": "user", "content": "Say something short."}]
PROMPT_TOKENS = 'vllm:prompt_tokens_total{engine="0",model_name="tiny"}'


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The scrape lines flushed so far (metrics.jsonl.gz, as the analysis reads them: k3load.evidence)."""
    path, table = metrics_file(run_dir), SeriesTable()
    return [table.decode(json.loads(x)) for x in lines(path) if x.endswith("\n")] if path.exists() else []


def _last(run_dir: Path) -> dict[str, Any]:
    """The last scrape flushed so far ({"samples": {}} before the first: lines reach the file within 0.5 s)."""
    return (read_metrics(run_dir) or [{"samples": {}}])[-1]


def events(out: Path, name: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(out / "events.jsonl") if name is None or e["event"] == name]


def wait_for(predicate: Callable[[], Any], timeout_s: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def ask(base_url: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", timeout=30,
                      json={"model": "tiny", "messages": ASK, "max_tokens": max_tokens})


@pytest.fixture
def sampled(tmp_path: Path) -> Iterator[Callable[..., Sampler]]:
    """Factory: sampled(metrics_url, **kw) -> a started Sampler writing to tmp_path/run; stopped after."""
    started: list[Sampler] = []

    def make(metrics_url: str, **kw: Any) -> Sampler:
        kw.setdefault("interval_s", 0.1)
        sampler = Sampler(tmp_path / "run", metrics_url, **kw).start()
        started.append(sampler)
        return sampler

    yield make
    for sampler in started:
        sampler.stop()


# -- against the sim ---------------------------------------------------------------------------------
def test_scrape_round_trip_and_counters_rise_under_requests(start_sim, sampled, tmp_path):
    sim = start_sim()
    sampler = sampled(sim.base_url + "/metrics")
    out = tmp_path / "run"
    wait_for(lambda: read_metrics(out), what="a first scrape")
    for _ in range(3):
        assert ask(sim.base_url).status_code == 200
    wait_for(lambda: (_last(out)["samples"].get(PROMPT_TOKENS) or 0) > 0,
             what="prompt tokens counted")
    summary = sampler.stop()
    lines = read_metrics(out)
    first, last = lines[0], lines[-1]
    assert all(line["ok"] for line in lines) and summary["scrapes"] == len(lines)
    assert gevent.monkey.is_module_patched("threading")  # conftest imports locust: the loops ran as greenlets
    assert first["source"] == sim.base_url + "/metrics" and first["vllm_series"] > 300
    assert set(first) >= {"ts", "source", "ok", "scrape_ms", "load_generator_cpu_pct", "load_generator_cpu_wait_pct",
                          "samples", "legacy", "types"}
    assert "types" not in last  # said once, until it changes
    assert first["samples"][PROMPT_TOKENS] == 0 < last["samples"][PROMPT_TOKENS]
    success = 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'
    assert last["samples"][success] - first["samples"][success] == 3
    # A reading within CpuMeter.MIN_WINDOW_S of the last one counted (the final one at stop(), or a tick right
    # after a late one on a busy machine) is unknown, None; every other is a percentage.
    counted, cpu = lines[0]["ts"], []
    for line in lines[1:]:
        if line["ts"] - counted >= CpuMeter.MIN_WINDOW_S + 0.01:
            cpu.append(line["load_generator_cpu_pct"])
            counted = line["ts"]
        elif line["load_generator_cpu_pct"] is None:
            continue
        else:
            counted = line["ts"]
    assert cpu and all(isinstance(pct, float) and pct >= 0 for pct in cpu)
    waits = [line["load_generator_cpu_wait_pct"] for line in lines]  # the same windows as the CPU's
    assert all(w is None or 0 <= w <= 100 for w in waits)
    if read_run_queue_ns() is not None:  # a kernel that counts run-queue time gives a reading where the CPU has one
        assert all(isinstance(waits[i], float) for i, line in enumerate(lines) if line["load_generator_cpu_pct"])
    (config,) = events(out, "cache_config")
    assert config["labels"][0]["block_size"] == "16" and config["labels"][0]["enable_prefix_caching"] == "True"
    assert not events(out, "counter_reset") and not events(out, "server_down")
    assert events(out)[-1]["event"] == "sampler_stop"


def test_sim_restart_on_the_same_port_gives_down_up_and_a_counter_reset(start_sim, sampled, tmp_path):
    sim = start_sim()
    port = urllib.parse.urlsplit(sim.base_url).port
    out = tmp_path / "run"
    sampled(sim.base_url + "/metrics")
    assert ask(sim.base_url).status_code == 200
    wait_for(lambda: (_last(out)["samples"].get(PROMPT_TOKENS) or 0) > 0,
             what="prompt tokens counted")
    sim.stop()
    (down,) = wait_for(lambda: events(out, "server_down"), what="server_down")
    gone = {"connection refused", "connection reset"}  # reset: the poll that met the shutdown itself
    assert down["reason"] in gone and down["first_poll"] is False
    start_sim("--port", str(port))  # argparse keeps the last --port: the same URL again
    (up,) = wait_for(lambda: events(out, "server_up"), what="server_up")
    (reset,) = wait_for(lambda: events(out, "counter_reset"), what="counter_reset")
    assert up["down_s"] > 0 and reset["series_down"] >= 1 and reset["examples"]
    failed = [line for line in read_metrics(out) if not line["ok"]]
    assert failed and all(line["error"] in gone and "samples" not in line for line in failed)


def test_metrics_disabled_is_missing_not_zeros(start_sim, sampled, tmp_path):
    """As vLLM 0.32 with --disable-log-stats: the tool-parser counter is written as it is, the engine's
    gauges are said to be missing (once), never zeros."""
    sim = start_sim("--metrics-disabled")
    sampler = sampled(sim.base_url + "/metrics")
    out = tmp_path / "run"
    wait_for(lambda: len(read_metrics(out)) >= 3, what="three scrapes")
    sampler.stop()
    lines = read_metrics(out)
    assert all(line["ok"] and line["vllm_series"] == 12 for line in lines)
    assert {key.partition("{")[0] for line in lines for key in line["samples"]} == {
        "vllm:tool_call_parser_invocations_total"}
    (missing,) = events(out, "metrics_missing")
    assert missing["absent"] == ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
    assert missing["reason"] == ("no vllm:num_requests_running / vllm:num_requests_waiting / vllm:kv_cache_usage_perc "
                                 "on /metrics (only 12 vllm:tool_call_parser_invocations_total series): "
                                 "vLLM started with --disable-log-stats?")
    assert not events(out, "metrics_back")
    assert read_jsonl(out / "gpu.jsonl")  # the sim's GPU gauges are still there


def test_simulated_dcgm_gauges_land_in_gpu_jsonl_marked_simulated(start_sim, sampled, tmp_path):
    sim = start_sim("--gpu-count", "2")
    url = sim.base_url + "/metrics"
    sampled(url, gpu_metrics_urls=[url])  # the same body: read once, not twice
    out = tmp_path / "run"
    rows = wait_for(lambda: read_jsonl(out / "gpu.jsonl")[:4], what="gpu rows")
    assert {r["gpu"] for r in rows} == {0, 1}
    row = rows[0]
    assert row["source"] == f"dcgm:{url}" and row["simulated"] is True and row["node"] == "k3load-sim"
    assert row["memory_used_mib"] > 0 and row["memory_total_mib"] == row["memory_used_mib"] + row["memory_free_mib"]
    assert row["util_pct"] is None and row["power_w"] is None  # the sim has no such gauges: None, not 0
    assert not events(out, "gpu_unavailable")


def test_oom_line_in_the_followed_log_is_flagged(start_sim, sampled, tmp_path):
    sim = start_sim("--oom-kv-demand-tokens", "300")
    out = tmp_path / "run"
    sampled(sim.base_url + "/metrics", server_log=sim.log_path)
    wait_for(lambda: (out / "server.log").exists() and "listening on" in (out / "server.log").read_text(),
             what="the startup line copied")
    with pytest.raises(httpx.HTTPError):
        ask(sim.base_url, max_tokens=1000)
    (oom,) = wait_for(lambda: events(out, "log_oom"), what="log_oom")
    assert "CUDA out of memory" in oom["line"] and oom["source"] == f"file:{sim.log_path}"
    wait_for(lambda: events(out, "server_down"), what="server_down after the crash")
    assert "OutOfMemoryError" in (out / "server.log").read_text()


def test_log_command_is_followed_and_ended_on_stop(sampled, start_sim, tmp_path):
    sim = start_sim()
    script = ("import time; print('INFO starting', flush=True); "
              "print('host:1:2 [0] NCCL WARN NET/IB : Got async event : port error', flush=True); time.sleep(60)")
    sampler = sampled(sim.base_url + "/metrics", server_log_cmd=[sys.executable, "-c", script])
    out = tmp_path / "run"
    (nccl,) = wait_for(lambda: events(out, "log_nccl"), what="log_nccl")
    assert "NCCL WARN" in nccl["line"] and nccl["source"] == "cmd"
    proc = sampler._logtail._proc
    sampler.stop()
    assert proc is not None and proc.poll() is not None  # the command we started is gone
    copied = (out / "server.log").read_text().splitlines()
    assert copied == ["INFO starting", "host:1:2 [0] NCCL WARN NET/IB : Got async event : port error"]
    assert events(out, "sampler_start")[0]["server_log_cmd_program"] == sys.executable


def test_nvml_fake_memory_curve_and_unavailable_notice(start_sim, sampled, tmp_path):
    sim = start_sim("--gpu-count", "1")
    lib = FakeNvml(gpus=[FakeGpu(used_bytes=1000 * 2**20), FakeGpu(uuid="GPU-1")])
    sampler = sampled(sim.base_url + "/metrics", nvml=lib)
    out = tmp_path / "run"
    wait_for(lambda: [r for r in read_jsonl(out / "gpu.jsonl") if r["source"] == "nvml"], what="nvml rows")
    lib.gpus[0].used_bytes = 5000 * 2**20
    wait_for(lambda: any(r["source"] == "nvml" and r["memory_used_mib"] == 5000.0
                         for r in read_jsonl(out / "gpu.jsonl")), what="the rise")
    sampler.stop()
    (found,) = events(out, "gpu_found")
    assert found["gpus"] == 2 and lib.initialised == 0
    nvml_rows = [r for r in read_jsonl(out / "gpu.jsonl") if r["source"] == "nvml"]
    assert {r["gpu"] for r in nvml_rows} == {0, 1} and not any(r["simulated"] for r in nvml_rows)


def test_no_gpu_is_said_once_and_nothing_is_invented(start_sim, sampled, tmp_path):
    sim = start_sim("--gpu-count", "1")
    sampler = sampled(sim.base_url + "/metrics", nvml=FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    wait_for(lambda: len(read_metrics(tmp_path / "run")) >= 3, what="three scrapes")
    sampler.stop()
    (notice,) = events(tmp_path / "run", "gpu_unavailable")
    assert notice["source"] == "nvml" and "Library Not Found" in notice["reason"]
    assert not [r for r in read_jsonl(tmp_path / "run" / "gpu.jsonl") if r["source"] == "nvml"]


# -- a misbehaving server ----------------------------------------------------------------------------
class _Bad(BaseHTTPRequestHandler):
    """/metrics answers what `mode` says; every Authorization header is recorded."""

    mode = "garbage"
    seen_auth: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:  # http.server's name
        type(self).seen_auth.append(self.headers.get("Authorization"))
        if self.path == "/metrics" and self.mode == "hang":
            time.sleep(3)
        status, body = (200, b"this is { not prometheus text") if self.mode == "garbage" else (500, b"oops")
        if self.mode == "ok":
            status, body = 200, b"# TYPE vllm:g gauge\nvllm:g 1\n" if self.path == "/metrics" else b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def bad_server() -> Iterator[tuple[str, type[_Bad]]]:
    handler = type("Bad", (_Bad,), {"seen_auth": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_garbage_500_and_refused_are_recorded_and_the_loop_goes_on(bad_server, sampled, tmp_path):
    url, handler = bad_server
    out = tmp_path / "run"
    sampler = sampled(url + "/metrics")
    wait_for(lambda: len(read_metrics(out)) >= 2, what="garbage scrapes")
    handler.mode = "500"
    wait_for(lambda: any(line.get("error") == "HTTP 500" for line in read_metrics(out)), what="500")
    wait_for(lambda: events(out, "server_down"), what="server_down")
    handler.mode = "ok"
    wait_for(lambda: read_metrics(out)[-1]["ok"], what="recovery")
    sampler.stop()
    errors = [line.get("error", "") for line in read_metrics(out)]
    assert errors[0].startswith("parse error") and "HTTP 500" in errors
    down = events(out, "server_down")
    assert down[0]["reason"] == "HTTP 500" and down[0]["http_status"] == 500 and events(out, "server_up")
    assert not events(out, "sampler_error")

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    refused = Sampler(tmp_path / "refused", f"http://127.0.0.1:{closed}/metrics", interval_s=0.1).start()
    wait_for(lambda: len(read_metrics(tmp_path / "refused")) >= 2, what="refused scrapes")
    refused.stop()
    assert {line["error"] for line in read_metrics(tmp_path / "refused")} == {"connection refused"}
    (down,) = events(tmp_path / "refused", "server_down")
    assert down["first_poll"] is True


def test_a_hung_server_times_out_and_stop_is_bounded(bad_server, tmp_path):
    url, handler = bad_server
    handler.mode = "hang"
    sampler = Sampler(tmp_path / "run", url + "/metrics", interval_s=0.1, timeout_s=0.3).start()
    wait_for(lambda: read_metrics(tmp_path / "run"), what="a timed-out scrape")
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 2.5
    assert read_metrics(tmp_path / "run")[0]["error"] == "timeout after 0.3 s"


def test_api_key_is_sent_as_bearer_and_written_nowhere(bad_server, tmp_path):
    url, handler = bad_server
    handler.mode = "ok"
    secret = "sk-k3load-test-secret-123"
    sampler = Sampler(tmp_path / "run", url + "/metrics", interval_s=0.1, api_key=secret).start()
    wait_for(lambda: len(read_metrics(tmp_path / "run")) >= 2, what="scrapes")
    sampler.stop()
    assert set(handler.seen_auth) == {f"Bearer {secret}"}  # /metrics and /health both
    for path in (tmp_path / "run").iterdir():
        assert secret not in "".join(lines(path)), path.name
    assert events(tmp_path / "run", "sampler_start")[0]["api_key"] == "set"


# -- the command ---------------------------------------------------------------------------------------
_CLI = ("import argparse, sys; from k3load.sampler import cli; p = argparse.ArgumentParser(); "
        "cli.add_arguments(p); sys.exit(cli.run(p.parse_args(sys.argv[1:])))")


def test_sample_command_with_duration_and_sigterm(start_sim, tmp_path):
    """Run without gevent (a plain process): --duration ends it; SIGTERM ends it cleanly too."""
    sim = start_sim()
    args = [sys.executable, "-c", _CLI, "--metrics-url", sim.base_url + "/metrics", "--nvml", "off",
            "--interval", "0.2", "--server-log", str(sim.log_path)]
    env = {**os.environ, "K3_API_KEY": "sk-cli-secret"}
    done = subprocess.run([*args, "--duration", "1", "--out", str(tmp_path / "a")], capture_output=True, text=True,
                          timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    assert "scrapes (0 failed)" in done.stdout
    lines = read_metrics(tmp_path / "a")
    assert 3 <= len(lines) <= 10 and all(line["ok"] for line in lines)
    assert events(tmp_path / "a", "sampler_start")[0]["api_key"] == "set"
    assert "listening on" in (tmp_path / "a" / "server.log").read_text()

    proc = subprocess.Popen([*args, "--out", str(tmp_path / "b")], stdout=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(lambda: read_metrics(tmp_path / "b"), what="the command's first scrape")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events(tmp_path / "b")[-1]["event"] == "sampler_stop"


def test_flush_waits_for_the_scrape_under_way_and_leaves_it_in_the_file(start_sim, sampled, tmp_path):
    """Sampler.flush (a live search step's decision calls it): a scrape begun before the call is in
    metrics.jsonl.gz when it returns, though the server takes 1.5 s to answer it, three sampling intervals (a busy
    API server's /metrics). Without the wait the decision read a step's scrapes without its last one, which the
    analysis then judged the step on; waiting one interval at most, it still did with a /metrics that slow."""
    sim = start_sim("--metrics-stall-ms", "1500")  # every /metrics answer waits 1.5 s wall
    sampler = sampled(sim.base_url + "/metrics", interval_s=0.5, timeout_s=8.0)
    wait_for(lambda: read_metrics(tmp_path / "run"), what="a first scrape in the file")
    under_way = wait_for(lambda: next((w.reading_since for w in sampler._watches if w.reading_since is not None),
                                      None), what="a scrape under way")
    sampler.flush()  # waits as a search step's decision does: at most the scrape's own timeout
    assert under_way in [line["ts"] for line in read_metrics(tmp_path / "run")]
