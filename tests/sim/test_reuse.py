"""Designed vs achieved prefix reuse (issue 15): the design measured with the sim's /tokenize over real
HTTP, the analysis of one short real Locust run against the sim, and the findings it must make when a
family is not what it was designed to be (hand-made run directories built from that run).

Why one run for the module: a run costs seconds of CI; every judgment after it re-reads a copy of its
directory (`k3load analyze` depends only on the directory), changed where a test needs another story.
"""

from __future__ import annotations

import glob
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from k3load.analysis.analyze import analyze
from k3load.evidence import lines, records_file
from k3load.rundir import write_json_atomic
from k3load.sim.process import SimProcess
from k3load.workload.reuse_design import DESIGN_FILE, http_tokenizer, measure, measure_into
from k3load.workload.scenario import load_scenarios
from tests.conftest import FAST_SIM

ROOT = Path(__file__).resolve().parents[2]
SIM = ["--time-scale", "0.05", "--prefill-ms-per-token", "0.2", "--max-model-len", "8192"]
STAGES = [{"name": "mixed", "kind": "soak", "duration_s": 6, "users": 3,
           "mix": {"shared_prefix": 1, "cold": 1, "agent": 1}}]
SALT = re.compile(r"^\[session [^\]]*\] ")

pytestmark = pytest.mark.slow


def _scenarios(*names: str) -> list[Any]:
    found = load_scenarios([Path(p) for p in sorted(glob.glob(str(ROOT / "scenarios" / "*.yaml")))])
    return [s for s in found if s.name in names]


def _writer(run_dir: Path) -> Any:
    """measure_into's writer for a directory no run holds (the run's own writes through its lock's descriptor)."""
    return lambda name, data: write_json_atomic(run_dir / name, data)


def _client() -> httpx.Client:
    return httpx.Client(timeout=30)


def _salt_after_the_tools(tokenize: Any) -> Any:
    """The sim's tokenizer over the request as k3load built it before issue 15: the per-request salt
    only in the system prompt, none in the first tool's description."""
    def old(body: dict[str, Any]) -> list[int]:
        tools = [{**t, "function": {**t["function"], "description": SALT.sub("", t["function"]["description"])}}
                 for t in body.get("tools") or []]
        return tokenize({**body, "tools": tools})
    return old


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    process = SimProcess([*FAST_SIM, *SIM], tmp_path_factory.mktemp("sim") / "sim.log").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def run(sim: SimProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One short mixed stage (shared-prefix, cold and agent users at once) against the sim."""
    base = tmp_path_factory.mktemp("reuse")
    plan = base / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "reuse-test", "stages": STAGES}))
    out = base / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
           "--host", sim.base_url, "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe",
           "recipes/local-dev.yaml", "--k3-scenarios", "scenarios/*.yaml", "--only-summary"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (out / "verdict.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _judged(run: Path, tmp_path: Path, change: Any = None) -> dict[str, Any]:
    """A copy of the run judged again, after `change(copy)` edited its files."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    if change is not None:
        change(copy)
    analyze(copy)
    return json.loads((copy / "verdict.json").read_text())


def _edit_records(copy: Path, family: str, cached: Any) -> None:
    path = records_file(copy)
    rows = [json.loads(line) for line in lines(path)]
    for r in rows:
        if r["family"] == family and r["status"] == "ok" and r["prompt_tokens"]:
            r["cached_tokens"] = cached(r)
    path.unlink()  # written back plain, as an older run's records.jsonl (read alike)
    (copy / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# -- the design, measured with the sim's tokenizer over HTTP -------------------------------------------

def test_cold_support_is_cold_by_design_and_the_shared_family_shares_its_head(sim: SimProcess):
    tokenize = http_tokenizer(_client, sim.base_url, "tiny")
    design = measure(_scenarios("cold_support", "shared_prefix_support", "agent_weather_trip"), "run-1", "tiny",
                     lambda s: None, tokenize)
    cold = design["scenarios"]["cold_support"]
    # the salt sits in the first tool's description, declared after its type and name (bodies go out in declared
    # order): early in the tools, where the sim's tokenizer (a token per punctuation mark) counts about 64 tokens
    assert cold["tools_tokens"] > 300 and cold["salt_at_token"] < min(96, cold["tools_tokens"] / 4)
    assert cold["tools_before_salt"] is False
    keys, matrix, lengths = design["variants"], design["shared_prefix_tokens"], design["prompt_tokens"]
    a, b = keys.index("cold_support/1/A"), keys.index("cold_support/2/B")
    shared = keys.index("shared_prefix_support/0/A")
    assert matrix[a][b] < 96 < 1000 < lengths[a]  # two users' cold requests part at the salt
    assert matrix[a][shared] < 96  # and the shared family's cached head is no use to them
    s0, s1 = keys.index("shared_prefix_support/0/A"), keys.index("shared_prefix_support/1/A")
    assert matrix[s0][s1] > 0.9 * lengths[s0]  # run-salted: everything but the question is shared
    t1, t2 = keys.index("agent_weather_trip/1/A"), keys.index("agent_weather_trip/2/A")
    assert matrix[t2][t1] > 0.9 * lengths[t1]  # a conversation's next turn repeats the previous one


def test_the_old_salt_placement_is_measured_as_salt_after_the_tools(sim: SimProcess):
    tokenize = _salt_after_the_tools(http_tokenizer(_client, sim.base_url, "tiny"))
    cold = measure(_scenarios("cold_support"), "run-1", "tiny", lambda s: None, tokenize)["scenarios"]["cold_support"]
    assert cold["tools_before_salt"] is True and cold["salt_at_token"] > cold["tools_tokens"] > 300


def test_a_refused_tokenizer_is_written_as_the_reason(sim: SimProcess, tmp_path: Path):
    measure_into(_writer(tmp_path), _scenarios("cold_support"), "run-1", "tiny", lambda s: None,
                 http_tokenizer(_client, sim.base_url + "/behind-a-gateway", "tiny"))
    design = json.loads((tmp_path / DESIGN_FILE).read_text())
    assert design["error"] == "POST /tokenize answered HTTP 404" and "variants" not in design


# -- the analysis of a real run ------------------------------------------------------------------------

def test_a_run_measures_its_design_and_reaches_it(run: Path):
    design = json.loads((run / DESIGN_FILE).read_text())
    assert design["error"] is None and design["run_id"] == json.loads((run / "run.json").read_text())["run_id"]
    verdict = json.loads((run / "verdict.json").read_text())
    cache = verdict["pillars"]["prefix_cache"]
    reuse = cache["numbers"]["reuse"]
    cold, shared, agent = (reuse["families"][f] for f in ("cold", "shared_prefix", "agent"))
    assert cold["attempts_with_usage"] >= 4 and cold["designed_share"] < 0.05 and cold["achieved_share"] < 0.05
    assert cold["achieved_share_ci95"][1] < 0.1 and cold["finding"]["status"] == "pass"
    assert shared["attempts_with_design"] >= 10 and shared["designed_share"] > 0.8
    assert 0.9 <= shared["achieved_of_design"] <= 1.05 and shared["achieved_of_design_ci95"][0] >= 0.8
    assert shared["finding"]["status"] == "pass" and shared["reached_design"]["rate"] >= 0.9
    assert agent["designed_share"] > 0.5 and agent["achieved_of_design"] >= 0.8
    assert reuse["block_size_known"] and reuse["block_size"] == 16 and reuse["evidence_gaps"] == []
    total = reuse["run"]
    assert total["metrics"]["prefix_cache_queries"] >= total["prompt_tokens"] * 0.9
    counted = total["metrics"]  # every answered request (the rows leave the drill's twins out)
    assert abs(counted["prefix_cache_hits"] - counted["responses_cached_tokens"]) \
        <= 0.05 * counted["responses_cached_tokens"]
    assert not any(r.startswith("reuse:") for r in cache["reasons"]), cache["reasons"]
    report = (run / "report.md").read_text()
    assert "## Prefix reuse: designed vs achieved" in report and "| cold |" in report
    assert "Prefix reuse: designed vs achieved" in (run / "report.html").read_text()


def test_a_cold_family_salted_after_the_tools_is_the_harness_finding(run: Path, sim: SimProcess, tmp_path: Path):
    tokenize = _salt_after_the_tools(http_tokenizer(_client, sim.base_url, "tiny"))
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    played = _scenarios(*json.loads((run / DESIGN_FILE).read_text())["scenarios"])

    def old_design(copy: Path) -> None:
        measure_into(_writer(copy), played, run_id, "tiny", lambda s: None, tokenize)

    verdict = _judged(run, tmp_path, old_design)
    cache = verdict["pillars"]["prefix_cache"]
    cold = cache["numbers"]["reuse"]["families"]["cold"]
    assert cold["designed_share"] > 0.15 and cold["finding"]["layer"] == "harness"
    reason = next(r for r in cache["reasons"] if "cold family is not cold by design" in r)
    assert "salt after the tools in cold_support: the first" in reason and "pillar status unchanged" in reason
    assert cache["status"] == json.loads((run / "verdict.json").read_text())["pillars"]["prefix_cache"]["status"]


def test_a_shared_family_far_below_its_design_fails_the_pillar(run: Path, tmp_path: Path):
    verdict = _judged(run, tmp_path, lambda copy: _edit_records(copy, "shared_prefix", lambda r: 0))
    cache = verdict["pillars"]["prefix_cache"]
    shared = cache["numbers"]["reuse"]["families"]["shared_prefix"]
    assert shared["achieved_of_design"] == 0 and shared["finding"] == {
        "family": "shared_prefix", "status": "fail", "layer": "server", "reason": shared["finding"]["reason"]}
    assert cache["status"] == "fail" and cache["reasons"][0].startswith(
        "reuse: the prefix cache missed what the samples share: shared_prefix family reused 0% of its designed")


def test_a_cold_family_reusing_more_than_designed_is_a_server_finding(run: Path, tmp_path: Path):
    verdict = _judged(run, tmp_path,
                      lambda copy: _edit_records(copy, "cold", lambda r: r["prompt_tokens"] // 2 // 16 * 16))
    cache = verdict["pillars"]["prefix_cache"]
    cold = cache["numbers"]["reuse"]["families"]["cold"]
    assert cold["finding"]["status"] == "finding" and cold["finding"]["layer"] == "server"
    assert any("cold family is not cold on the server" in r for r in cache["reasons"])


def test_without_the_servers_tokenizer_reuse_is_inconclusive(run: Path, tmp_path: Path):
    def refused(copy: Path) -> None:
        (copy / DESIGN_FILE).write_text(json.dumps({"version": 1, "error": "POST /tokenize answered HTTP 404"}))

    verdict = _judged(run, tmp_path, refused)
    cache = verdict["pillars"]["prefix_cache"]
    assert cache["numbers"]["reuse"]["status"] == "inconclusive"
    assert "reuse: inconclusive, because the server's tokenizer was not reachable (POST /tokenize answered HTTP " \
           "404)" in cache["reasons"]


def test_another_runs_design_is_never_this_runs(run: Path, tmp_path: Path):
    """A design measured for another run (a web UI test's measurement ending after the next test began in the
    same directory; a file copied in): its salts carry that run's id, so reuse is inconclusive, saying whose."""
    def foreign(copy: Path) -> None:
        design = json.loads((copy / DESIGN_FILE).read_text())
        (copy / DESIGN_FILE).write_text(json.dumps(design | {"run_id": "an-earlier-test"}))

    verdict = _judged(run, tmp_path, foreign)
    cache = verdict["pillars"]["prefix_cache"]
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    assert cache["numbers"]["reuse"]["status"] == "inconclusive"
    assert f"reuse: inconclusive, because reuse_design.json was measured for run an-earlier-test, not this run " \
           f"({run_id})" in cache["reasons"]


def test_a_gateway_page_or_odd_tokens_from_tokenize_is_a_clear_reason_never_a_crash():
    """Servers we did not write: a gateway's HTML page with 200, or a token list that is not integers, end
    the measurement with a reason (the analysis then says "inconclusive, because ..."), not a dead greenlet
    and a missing file."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from k3load.workload.reuse_design import TokenizerUnavailable

    class Gateway(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            html = not self.path.startswith("/odd")
            body = b"<html><body>502 Bad Gateway</body></html>" if html else b'{"tokens": [1, "x", null]}'
            self.send_response(200)
            self.send_header("content-type", "text/html" if html else "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        for host in (base, base + "/odd"):
            tokenize = http_tokenizer(_client, host, "tiny")
            with pytest.raises(TokenizerUnavailable, match="without a `tokens` list of integers"):
                tokenize({"messages": [{"role": "user", "content": "hi"}]})
    finally:
        server.shutdown()
