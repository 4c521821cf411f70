"""The precheck when /metrics is out of reach (an engine behind a gateway that forwards only /v1): an
observability gap said as `inconclusive` with the reason, never a failed deployment; and /metrics read
from a separate URL (the first --k3-metrics-url), where the API key goes only when it is the API's host."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from k3load.precheck import run_precheck

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "recipes" / "local-dev.yaml"
SECRET = "sk-k3load-precheck-metrics-secret"
ENGINE_METRICS = (
    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 0.0\n"
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 0.0\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 0.0\n"
    "# TYPE vllm:cache_config_info gauge\n"
    "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\"} 1.0\n")


class _Api(BaseHTTPRequestHandler):
    """A vLLM-like API: /version and /v1/models answer; /metrics answers `metrics` (None: 404)."""

    metrics: ClassVar[str | None] = None
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:  # http.server's name
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        bodies = {"/version": json.dumps({"version": "0.32.0"}),
                  "/v1/models": json.dumps({"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]}),
                  "/metrics": self.metrics}
        body = bodies.get(self.path)
        self._answer(404 if body is None else 200, (body or "404 page not found\n").encode())

    def do_POST(self) -> None:
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        self._answer(200, json.dumps({"id": "x", "system_fingerprint": "fp_gateway", "choices": []}).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[Any]:
    """Factory: serve(metrics) -> (base URL, handler class with `seen`); stopped after the test."""
    servers: list[ThreadingHTTPServer] = []

    def start(metrics: str | None) -> tuple[str, type[_Api]]:
        handler = type("Api", (_Api,), {"metrics": metrics, "seen": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", handler

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _by_id(compat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {rule["id"]: rule for rule in compat["rules"]}


def test_metrics_404_behind_a_gateway_is_inconclusive_never_fail(serve, tmp_path: Path) -> None:
    base, _ = serve(None)
    compat = run_precheck(tmp_path / "run", LOCAL, base, use_local_nvml=False)
    rules = _by_id(compat)
    assert not [r["id"] for r in compat["rules"] if r["status"] == "fail"], compat["rules"]
    assert compat["status"] != "fail"
    assert rules["server_reachable"]["status"] == "pass"
    assert f"/metrics answered 404 at {base}/metrics" in rules["server_reachable"]["reason"]
    reachable = rules["metrics_reachable"]
    assert reachable["status"] == "inconclusive"
    assert reachable["reason"].startswith(f"inconclusive, because /metrics answered 404 at {base}/metrics")
    assert "monitoring is not possible" in reachable["reason"]
    flags = rules["serve_flags"]
    assert flags["status"] == "inconclusive" and "because /metrics answered 404" in flags["reason"]
    assert (tmp_path / "run" / "evidence" / "server" / "metrics.txt").read_text() == "404 page not found\n"


def test_metrics_read_from_a_separate_url_and_the_key_stays_on_the_api_host(serve, tmp_path: Path) -> None:
    base, gateway = serve(None)
    engine_url, engine = serve(ENGINE_METRICS)
    compat = run_precheck(tmp_path / "run", LOCAL, base, use_local_nvml=False, api_key=SECRET,
                          metrics_url=engine_url + "/metrics")
    rules = _by_id(compat)
    assert rules["metrics_reachable"]["status"] == "pass"
    assert rules["metrics_reachable"]["reason"] == f"{engine_url}/metrics answered (4 vllm:* families)"
    assert rules["serve_flags"]["status"] == "pass"  # enable_prefix_caching from that engine's cache_config_info
    assert engine.seen == [("/metrics", None)]  # another host:port: never the key
    assert {auth for path, auth in gateway.seen} == {f"Bearer {SECRET}"} and ("/metrics", None) not in gateway.seen
    fetch = json.loads((tmp_path / "run" / "evidence" / "server" / "fetch.json").read_text())
    assert fetch["endpoints"]["metrics"]["url"] == engine_url + "/metrics"
    assert not any(SECRET.encode() in p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file())


def test_metrics_without_the_engines_gauges_is_not_monitoring(start_sim, tmp_path: Path) -> None:
    """vLLM with --disable-log-stats answers /metrics, but with no queue or KV gauge (the sim's
    --metrics-disabled keeps only the tool-parser counter, as vLLM 0.32 does): not monitorable."""
    sim = start_sim("--metrics-disabled")
    compat = run_precheck(tmp_path / "run", LOCAL, sim.base_url, use_local_nvml=False)
    rule = _by_id(compat)["metrics_reachable"]
    assert rule["status"] == "inconclusive", rule
    assert "has no engine gauges (vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc"\
        in rule["reason"] and "monitoring is not possible" in rule["reason"]
    assert _by_id(compat)["server_reachable"]["status"] == "pass" and compat["status"] != "fail"
