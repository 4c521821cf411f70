"""Real-server proof: the whole acceptance plan against the real vLLM CPU build, misconfigured the way
production servers are, asserting the verdict, every pillar's status and the reasons (verdict.json).

Why: a simulator we wrote can agree with a harness we wrote for the wrong reasons. Each setup runs
`locust -f locustfiles/agent.py --headless` (the plan scaled to a 2-core CPU server: about 85 s) with
the local-dev recipe, the server's own log as startup log and followed log, and CPU-scaled SLOs:

2. --no-enable-prefix-caching
7. healthy, SIGKILLed mid-soak, brought back by --k3-restart-cmd; 7b. then restarted on purpose by the
   restart drill, in a run whose control prompt is under one cache block (6: a harness input, not a
   server setting, so it rides along instead of costing a run of its own)
3. KV starved (the session server, 24 blocks)     4. --enable-auto-tool-choice forgotten

Setup 5 (--disable-log-stats) moved onto the real instruct model's misconfigured server
(tests/real/test_real_model.py, R2), so the suite starts one server fewer.

Setup 1 (healthy) moved to the real instruct model (tests/real/test_real_model.py, R1): random weights
only ever showed that tool turns come back as newlines. The tiny healthy server still serves 6 and 7.
Servers run eager (tests/target_fixtures.py EAGER) and start two at a time (about 3 GB each; never
more than three of ours at once, the session one included) and stop as soon as their setups are done. Each run's
verdict.json, validation_summary.json, compat.json and report.md are kept under
runs/real-server/SETUP/ (docs/real-server-results.md is written from them).

What the real server does that the sim did not (found here): with --disable-log-stats vLLM 0.32 still
serves vllm:tool_call_parser_invocations_total; without --enable-auto-tool-choice it refuses every
request with tools and tool_choice other than "none" (400), not just "auto"; its scheduler mostly
queues rather than preempts when KV blocks run out; and at the harness's temperature 0 the
random-weight model answers with runs of newlines, never tool markup, so the parser layer shows up
only as schema-constrained JSON with raw control characters that xgrammar let through.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from k3load.evidence import records_file
from k3load.outcomes import LAYERS
from k3load.records import Attempt, read_records
from k3load.targets.vllm_cpu import process_group_alive
from k3load.workload.scenario import load_scenarios
from tests.probes import Target, scrape, total
from tests.scenario_edits import short_control_prompt
from tests.target_fixtures import EAGER, SERVER_ARGS, ServerConfig, VllmPool, VllmTarget, cache_dir

ROOT = Path(__file__).resolve().parents[2]
KEEP = ROOT / "runs" / "real-server"
RECIPE = "recipes/local-dev.yaml"
STAGES: list[dict[str, Any]] = [
    {"name": "prefix-control", "kind": "prefix_control", "duration_s": 32, "users": 1,
     "mix": {"shared_prefix": 1}, "iterations_per_user": 1},  # 8 pairs: 8 x (3 s cold + a warm twin)
    {"name": "load", "kind": "load", "duration_s": 16, "users": 2, "mix": {"agent": 3, "shared_prefix": 1}},
    {"name": "long-input", "kind": "long_input", "duration_s": 8, "users": 1, "mix": {"long_input": 1}},
    {"name": "concurrency", "kind": "concurrency", "duration_s": 6, "steps": [1, 4],
     "mix": {"agent": 2, "shared_prefix": 1}},
    {"name": "soak", "kind": "soak", "duration_s": 15, "users": 3,
     "mix": {"agent": 2, "shared_prefix": 1, "cold": 1, "long_input": 1}},
]
# The defaults are a GPU deployment's SLOs; here a cold 2,000-token prefill on two shared cores takes
# seconds (3-27 s TTFT p95 seen while other jobs ran), so judging latency against them would make
# `resources` a coin toss of the machine's load. KV, preemption, error and crash limits keep their
# defaults; sustained waiting is scaled to steps of 6-10 s (the default 10 s could never be reached), and
# so is the drain bound (an abort lands after the step in progress: two such steps).
THRESHOLDS = {"slo": {"ttft_p95_ms": 30000, "itl_p95_ms": 2000, "e2e_p95_ms": 120000},
              "resources": {"max_waiting_sustained_s": 5, "max_drain_s": 20}}
# Setups 2 and 4 judge a misconfiguration the control and the base load show (caching off, tool choice
# refused): the long input, the ramp and the soak add nothing to their verdicts but about 40 s each of CI
# (setups 3 and 7 keep every stage). Setup 2's control keeps its 8 pairs: its tool-call turns are half
# the attempts that decide the agent pillar (16 s left it inconclusive on a busy machine).
SHORT_STAGES = STAGES[:2]
# Setup 4's control pairs are refused at once: 16 s plays them all.
REFUSED_STAGES = [{**STAGES[0], "duration_s": 16}, STAGES[1]]
# Setup 3: agents only above the KV capacity (300-1,000-token prompts that grow while decoding:
# admitted, then short of blocks), for long enough to count as sustained.
KV_STAGES = [*STAGES[:3], {**STAGES[3], "duration_s": 10, "steps": [2, 8], "mix": {"agent": 1}}, STAGES[4]]
# Setup 7: the same stages, shorter before the soak (the crash is the point); the soak is killed
# KILL_AFTER_S in, and the restart stage outlasts a start-up on two busy cores (eager: back after
# 44-49 s seen; compiled it was 90-110 s) with load left to serve after it.
KILL_AFTER_S = 6
RESTART_STAGES = [{**STAGES[0], "duration_s": 16}, {**STAGES[1], "duration_s": 8}, {**STAGES[2], "duration_s": 6},
                  {**STAGES[3], "duration_s": 5}, {**STAGES[4], "duration_s": 20},
                  {"name": "restart", "kind": "restart", "duration_s": 80, "users": 3,
                   "mix": {"agent": 2, "shared_prefix": 1}}]
HEALTHY = ServerConfig()
PREFIX_OFF = ServerConfig(drop_flags=["--enable-prefix-caching"], extra_args=["--no-enable-prefix-caching"])
NO_AUTO_TOOLS = ServerConfig(drop_flags=["--enable-auto-tool-choice"])
AUTO_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'

pytestmark = pytest.mark.vllm


# -- running the plan ---------------------------------------------------------------------------------------
def locust_cmd(target: VllmTarget, out: Path, plan: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
            "--host", target.base_url, "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe", RECIPE,
            "--k3-startup-log", str(target.log_path), "--k3-server-log", str(target.log_path),
            "--stop-timeout", "20", "--only-summary", *extra]


def write_plan(tmp_path: Path, stages: list[dict[str, Any]]) -> Path:
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "real-server", "stages": stages, "thresholds": THRESHOLDS}))
    return plan


def accept(target: VllmTarget, tmp_path: Path, setup: str, flags: list[str], *extra: str,
           stages: list[dict[str, Any]] = STAGES) -> tuple[dict[str, Any], int, Path]:
    """Run the plan against the server; (verdict.json, exit code, run dir), kept for the results doc."""
    out = tmp_path / "run"
    cmd = locust_cmd(target, out, write_plan(tmp_path, stages), *extra)
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert (out / "verdict.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    keep(setup, flags, out)
    return json.loads((out / "verdict.json").read_text()), run.returncode, out


def assert_cache_pass_or_undecided(verdict: dict[str, Any]) -> None:
    """The cache pillar of a setup about something else (a crash, a starved KV pool): pass, or inconclusive for
    want of evidence (too few pairs timed, the latency sign test undecided over 8 pairs on a busy machine),
    never fail. Why not pass only: 8 pairs on two oversubscribed cores left the sign test at p=0.145 in a CI
    run, a timing window the test cannot own (setup 1 proves the cache on a healthy server)."""
    cache = verdict["pillars"]["prefix_cache"]
    assert cache["status"] == "pass" or (cache["status"] == "inconclusive" and re.search(
        r"more pairs would decide|fewer than two pairs have a first-token time", cache["reasons"][0])), cache["reasons"]


def keep(setup: str, flags: list[str], out: Path) -> None:
    """The judgment and its setup, for docs/real-server-results.md and post-mortems."""
    dest = KEEP / setup
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in ("verdict.json", "validation_summary.json", "compat.json", "report.md"):
        if (out / name).exists():
            shutil.copy2(out / name, dest / name)
    (dest / "setup.json").write_text(json.dumps({"setup": setup, "server_flags": flags}, indent=1) + "\n")


def statuses(verdict: dict[str, Any]) -> dict[str, str]:
    return {name: p["status"] for name, p in verdict["pillars"].items()}


def reasons(verdict: dict[str, Any], pillar: str) -> str:
    return " | ".join(verdict["pillars"][pillar]["reasons"])


def because(verdict: dict[str, Any]) -> str:
    return " | ".join(verdict["next_action"]["because"])


def events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]


def judged(attempts: list[Attempt]) -> list[Attempt]:
    """What the agent pillar judges: every attempt except the timeout drill's deliberately short ones."""
    return [a for a in attempts if not a.drill]


def assert_every_failure_has_its_layer(attempts: list[Attempt], verdict: dict[str, Any]) -> Counter[str]:
    """Every invalid attempt names the layer(s) at fault and one primary layer, and the pillar counts
    each failed attempt once, under its primary layer."""
    for attempt in attempts:
        failed = [f for f in attempt.findings if not f.ok]
        assert attempt.valid == (not failed), attempt.attempt_id
        assert all(f.layer in LAYERS for f in failed), [(f.check, f.layer) for f in failed]
        assert sorted(attempt.failed_layers) == sorted({f.layer for f in failed})
        assert (attempt.primary_layer in attempt.failed_layers) if failed else attempt.primary_layer is None
    layers = Counter(a.primary_layer for a in judged(attempts) if a.primary_layer)  # each failure counted once
    numbers = verdict["pillars"]["agent_api"]["numbers"]
    assert numbers["failed_by_layer"] == {layer: layers.get(layer, 0) for layer in LAYERS}
    assert numbers["attempts"] == len(judged(attempts))
    return layers


# -- servers ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def healthy(vllm_pool: VllmPool) -> VllmTarget:
    """Setup 7 kills it (and 7b restarts it on purpose); setup 2's server starts alongside, so the two
    share the start-up minutes."""
    vllm_pool.start(healthy=HEALTHY, prefix_off=PREFIX_OFF)
    return vllm_pool.get("healthy")


# -- 2. prefix caching off ----------------------------------------------------------------------------------
def test_prefix_caching_off_fails_the_cache_pillar_and_the_recipe(vllm_pool, healthy, tmp_path):
    """The server says so itself (vllm:cache_config_info): the cache pillar fails (never inconclusive),
    and the local-dev recipe requires prefix caching, so compat fails first: `rebuild`. The load runs anyway
    (--k3-load-after-rebuild: by default a rebuild stops the run before any load) so the cache pillar's own
    evidence is judged beside it."""
    target = vllm_pool.get("prefix_off")
    try:
        verdict, code, _ = accept(target, tmp_path, "2-prefix-caching-off", PREFIX_OFF.flags(),
                                  "--k3-load-after-rebuild", stages=SHORT_STAGES)
    finally:
        vllm_pool.stop("prefix_off")
    # stop() with a run dir given leaves nothing running and only the log (an own temp dir goes whole: setup 7b)
    assert target.server.pid is not None and not process_group_alive(target.server.pid)
    left = {p.name for p in target.server.run_dir.iterdir()} if target.server.run_dir else set()
    assert "vllm.log" in left and not left & {"vllm-cache", "torchinductor", "tmp"}, left
    with pytest.raises(httpx.TransportError):
        httpx.get(target.base_url + "/health", timeout=2)
    assert statuses(verdict) == {"compat": "fail", "resources": "pass", "prefix_cache": "fail",
                                 "agent_api": "fail"}, json.dumps(verdict["next_action"], indent=1)
    assert reasons(verdict, "prefix_cache") == \
        "prefix caching is off on the server (vllm:cache_config_info enable_prefix_caching=False)"
    assert reasons(verdict, "compat") == \
        "serve_flags: enable_prefix_caching is False (vllm:cache_config_info), needs True"
    assert verdict["verdict"] == "rebuild" and code == 4
    assert because(verdict) == "compatibility failed: " + reasons(verdict, "compat")
    control = verdict["pillars"]["prefix_cache"]["numbers"]["control"]
    assert len(control) >= 2 and all(row["cached_tokens"] == 0 for row in control)
    assert verdict["pillars"]["prefix_cache"]["numbers"]["window"]["prefix_cache_hits"] == 0


# -- 7. killed mid-soak, restarted --------------------------------------------------------------------------
def _restart_command(port: int, compile_cache: Path | None, pidfile: Path) -> str:
    """What an operator's restart hook does: the same server on the same port. `exec` keeps the pid in
    `pidfile` the wrapper's, whose SIGTERM stops its vLLM and removes its files."""
    cache = f" --compile-cache {compile_cache}" if compile_cache else ""
    eager = " --enforce-eager" if HEALTHY.enforce_eager else ""
    return (f"echo $$ > {pidfile}; exec {sys.executable} -m k3load.targets.vllm_cpu --cache-dir {cache_dir()} "
            f"serve --port {port}{cache}{eager}")


def _alive(pid: int) -> bool:
    """Running (a zombie left to init counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _stop_restarted(pidfile: Path, restart_log: Path) -> None:
    """SIGTERM the restart command's wrapper, wait until it has stopped its vLLM; kill what is left."""
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.5)
    found = re.search(r" pid=(\d+) ", restart_log.read_text() if restart_log.exists() else "")
    for pgid in ([pid] if _alive(pid) else []) + ([int(found.group(1))] if found else []):
        if process_group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def _wait_for(path: Path, needle: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{needle} never appeared in {path}")


def _served(base_url: str) -> float:
    """Requests the server finished, every reason (aborts included): its own count of attempts."""
    with httpx.Client(timeout=10) as client:
        return total(scrape(Target("vllm", base_url, "tiny"), client), "vllm:request_success_total")


@dataclass
class KilledRun:
    """Setup 7's one run, judged by the three tests below."""

    verdict: dict[str, Any]
    attempts: list[Attempt]
    events: list[dict[str, Any]]
    killed_ts: float
    served_by_restarted: float | None
    restart_log: str
    drill: tuple[dict[str, Any], list[dict[str, Any]]] | None  # the restart drill's run, on the restarted server

    @property
    def down_ts(self) -> float:
        return next(e["ts"] for e in self.events if e["event"] == "server_down")

    @property
    def kill_ts(self) -> float:
        """The kill on the run's own clock (records and events share it, k3load.clock): when the first
        request it cut ended. `killed_ts` is this process's wall clock, which a step of the wall clock
        (a VM paused and resumed) moves against the run's: seen 0.7 s off in CI-like runs here."""
        return min((a.end_ts for a in self.caught()), default=self.down_ts)

    def caught(self) -> list[Attempt]:
        """The attempts the crash caught: sent before the sampler saw the server gone, ended by the crash
        (not ok, not refused a connection). The kill is not a request boundary: in one CI run the three
        requests in flight finished as the signal landed and the next three, sent within the same 0.1 s,
        reached the dying server and were closed before a response head."""
        down = self.down_ts

        def cut(a: Attempt) -> bool:
            return (a.status in ("truncated", "stream_error", "transport_error") or (a.http_status or 0) >= 500) \
                and "refused" not in (a.error or "").lower()

        return [a for a in self.attempts
                if a.send_ts <= down and (a.end_ts >= down or (cut(a) and a.end_ts >= down - 5))]


@pytest.fixture(scope="module")
def killed_run(vllm_pool: VllmPool, healthy: VllmTarget, tmp_path_factory: pytest.TempPathFactory) -> KilledRun:
    """Runs after setup 2 (it kills the healthy server). The crash is a SIGKILL of vLLM's whole
    process group mid-soak; --k3-restart-cmd brings the same server up on the same port."""
    tmp_path = tmp_path_factory.mktemp("killed-run")
    pidfile, out = tmp_path / "restarted.pid", tmp_path / "run"
    restart = _restart_command(healthy.server.port, vllm_pool.compile_cache, pidfile)
    cmd = locust_cmd(healthy, out, write_plan(tmp_path, RESTART_STAGES), "--k3-restart-cmd", restart)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(out / "events.jsonl", '"stage":"soak"', 180)
        time.sleep(KILL_AFTER_S)
        vllm_pool.kill("healthy")
        killed_ts = time.time()
        output, _ = proc.communicate(timeout=480)
        assert (out / "verdict.json").exists(), output[-3000:]
        restart_log = (out / "restart-1.log").read_text() if (out / "restart-1.log").exists() else ""
        served = _served(healthy.base_url) if "healthy after" in restart_log else None
        drill = _restart_drill(healthy, vllm_pool.compile_cache, pidfile, tmp_path / "drill") if served else None
    finally:
        if proc.poll() is None:
            proc.kill()
        _stop_restarted(pidfile, tmp_path / "drill" / "run" / "restart-drill.log")
        _stop_restarted(pidfile, out / "restart-1.log")
    keep("7-killed-mid-soak", ["SIGKILL of the process group mid-soak", "--k3-restart-cmd: the same server"], out)
    return KilledRun(json.loads((out / "verdict.json").read_text()), read_records(records_file(out)),
                     events(out), killed_ts, served, restart_log, drill)


# The drill's run: the control (setup 6: its prompt under one cache block, a few seconds a pair), a short
# load, then the restart stage, which restarts the (restarted) server on purpose and holds the load
# stage's users and mix for its duration once it answers again.
DRILL_STAGES = [{**STAGES[0], "duration_s": 12}, {**STAGES[1], "duration_s": 8},
                {"name": "restart", "kind": "restart", "duration_s": 15, "users": 1, "mix": {"cold": 1}}]


def _restart_drill(target: VllmTarget, compile_cache: Path | None, pidfile: Path, tmp_path: Path
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An operator's restart hook for a running server: stop the pidfile's wrapper (its SIGTERM stops its
    vLLM), wait until it is gone, start the same server on the same port."""
    tmp_path.mkdir()
    stop = (f"pid=$(cat {pidfile}); kill $pid; while s=$(awk '{{print $3}}' /proc/$pid/stat 2>/dev/null) && "
            f"[ -n \"$s\" ] && [ \"$s\" != Z ]; do sleep 0.5; done; ")
    out = tmp_path / "run"
    cmd = locust_cmd(target, out, write_plan(tmp_path, DRILL_STAGES), "--k3-restart-cmd",
                     stop + _restart_command(target.server.port, compile_cache, pidfile),
                     "--k3-scenarios", short_control_prompt(tmp_path / "scenarios"))
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert (out / "verdict.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    keep("7b-restart-drill", ["--k3-restart-cmd: stop the running server, start the same one",
                              "harness: --k3-scenarios with the control prompt under one cache block (setup 6)"], out)
    return json.loads((out / "verdict.json").read_text()), events(out)


def test_crash_mid_soak_is_recorded_with_its_phase_and_the_restart_check(killed_run):
    verdict = killed_run.verdict
    crashes = verdict["pillars"]["resources"]["numbers"]["crashes"]
    assert len(crashes) == 1, crashes
    crash = crashes[0]
    assert crash["stage"] == "soak" and crash["phase"] == "after long running: fragmentation or poor reuse"
    assert crash["events"] == ["server_down"] and crash["oom"] is False
    assert crash["conditions"]["requests_in_flight"] > 0
    assert crash["restart"]["recovered"] is True and crash["restart"]["ok_after_restart"] > 0, \
        (crash["restart"], killed_run.restart_log[-2000:])
    seen = [e["event"] for e in killed_run.events if e["event"] in ("server_down", "restart_command", "server_up")]
    assert seen == ["server_down", "restart_command", "server_up"], seen
    down = next(e for e in killed_run.events if e["event"] == "server_down")
    # SIGKILL closes the listening socket: the next poll is refused, or reset if it was mid-connect. The
    # kill's time is itself an observation (the end the client stamped on the first request it cut), so
    # the sampler may see it first: 22 ms before it in one CI run.
    assert down["reason"] in ("connection refused", "connection reset") and -1 < down["ts"] - killed_run.kill_ts < 3
    assert_cache_pass_or_undecided(verdict)  # this setup is about the crash: the cache is judged in setup 1
    assert {p: s for p, s in statuses(verdict).items() if p != "prefix_cache"} == {
        "compat": "pass", "resources": "fail", "agent_api": "fail"}, json.dumps(verdict["next_action"], indent=1)
    assert re.match(r"server crash \(no memory evidence\) in stage soak \(after long running: fragmentation or "
                    r"poor reuse\); \d+ requests "
                    r"in flight, largest prompt ~?\d+ tokens( \(estimated from the bytes sent\))?; "
                    r"restart: back after \d+ s, \d+ requests served after it",
                    reasons(verdict, "resources"))
    # It came back and served the same load: not scale_up; the steps before the crash all held.
    assert verdict["verdict"] == "limited", because(verdict)
    assert verdict["next_action"]["because"][0] == "hold concurrency at 4 users (the largest step run; every step held)"
    drill = verdict["pillars"]["resources"]["numbers"]["restart_drill"]
    assert drill["status"] == "not_run" and "already restarted after a crash" in drill["why"], drill


def test_the_restart_drill_restarts_a_running_real_server_and_holds_the_load_before_it(killed_run):
    """Issue 15: the restart stage stops and starts the real server on purpose (after the load stage drained),
    then holds the load stage's users and mix; time to ready and to the first good answer are recorded,
    and both stages drained on the server's own gauges, KV back to its baseline."""
    assert killed_run.drill is not None, killed_run.restart_log[-2000:]
    verdict, seen = killed_run.drill
    numbers = verdict["pillars"]["resources"]["numbers"]
    drill = numbers["restart_drill"]
    assert drill["status"] == "pass" and drill["recovered"] is True, drill
    assert drill["down_seen"] is True and drill["up_before"] is True, drill
    # the first good answer may be seen a poll before the readiness check notices (62.9 s vs 63.3 s in one run):
    # both only after the restart command began, never before
    assert 5 < drill["time_to_ready_s"] < 240 and drill["time_to_first_good_answer_s"] > 5, drill
    assert drill["held_from"] == "load" and drill["users"] == 2 and drill["held_attempts"] > 0, drill
    assert drill["held_problems"] == [], drill
    assert numbers["crashes"] == [] and not [e for e in seen if e["event"] == "restart_command"]
    # The drill's hook SIGTERMed the server the crash restart had started (`k3load.targets.vllm_cpu serve`,
    # its own temp dir): stop() left no process of its group and removed the whole dir.
    started = re.search(r" pid=(\d+) log=(\S+) ", killed_run.restart_log)
    assert started, killed_run.restart_log[-2000:]
    assert not process_group_alive(int(started.group(1))) and not Path(started.group(2)).parent.exists()
    drained = {row["stage"]: row for row in numbers["drain"]}
    for stage in ("load", "restart"):
        row = drained[stage]
        assert row["status"] == "drained", row
        assert row["kv_usage_after"] <= row["kv_usage_baseline"] + 0.02, row


# -- 6. a control prompt shorter than one block (in 7b's run) ----------------------------------------------
def test_control_prompt_under_one_block_is_inconclusive_naming_the_block_size(killed_run):
    assert killed_run.drill is not None, killed_run.restart_log[-2000:]
    verdict, _ = killed_run.drill
    assert statuses(verdict) == {"compat": "pass", "resources": "pass", "prefix_cache": "inconclusive",
                                 "agent_api": "fail"}, json.dumps(verdict["next_action"], indent=1)
    cache = verdict["pillars"]["prefix_cache"]
    assert re.fullmatch(r"inconclusive, because the prompt \(\d+ tokens\) is shorter than one cache block "
                        r"\(block_size 128, read from vllm:cache_config_info\): nothing can be reused",
                        reasons(verdict, "prefix_cache"))
    assert cache["numbers"]["cache_config"]["block_size"] == "128"
    assert cache["numbers"]["control"] and all(row["prompt_tokens"] < 128 for row in cache["numbers"]["control"])
    assert verdict["verdict"] == "limited"
    assert because(verdict).startswith("prefix_cache: inconclusive") and "agent_api: fail" in because(verdict)


def test_no_finished_record_is_lost_across_the_crash_and_restart(killed_run):
    attempts, killed_ts = killed_run.attempts, killed_run.kill_ts
    assert len({a.attempt_id for a in attempts}) == len(attempts)
    finished_before = [a for a in attempts if a.end_ts < killed_ts - 0.5]
    assert finished_before and all(a.status == "ok" for a in judged(finished_before))
    # Caught by the kill: recorded as cut there (vLLM's streams end mid-body or before a head), gateway's fault.
    cut = judged(killed_run.caught())
    assert cut and all(a.status in ("truncated", "stream_error", "transport_error") and a.failed_layers == ["gateway"]
                       and abs(a.end_ts - killed_ts) < 2 for a in cut), [(a.status, a.error) for a in cut]
    # Every request the restarted server finished is a record (a drill may expire before reaching it).
    reached = [a for a in attempts if a.send_ts > killed_ts and a.status != "transport_error"]
    assert killed_run.served_by_restarted is not None, killed_run.restart_log[-2000:]
    assert len(judged(reached)) <= killed_run.served_by_restarted <= len(reached)


def test_crash_names_the_input_length_of_the_requests_it_cut(killed_run):
    """The server's usage chunk never comes for a cut stream, so the crash's largest prompt is estimated
    from the bytes sent, at the tokens per byte of the same turn's finished requests, and marked so."""
    attempts = judged(killed_run.attempts)
    cut = killed_run.caught()
    assert cut and all(a.prompt_tokens is None and a.request_bytes for a in cut)
    (crash,) = killed_run.verdict["pillars"]["resources"]["numbers"]["crashes"]
    conditions = crash["conditions"]
    # Requests refused a connection never reached the server, and those that finished well are done:
    # neither is in flight (cut requests still running at the crash's ts would be; none is here).
    assert conditions["requests_in_flight"] == len(cut) and conditions["prompt_tokens_unknown"] == 0, conditions
    assert conditions["max_prompt_tokens_estimated"] is True
    # The same bytes were sent (and measured) before the kill: the estimate is within a few tokens of it.
    measured = {a.request_sha256: a.prompt_tokens for a in attempts if a.prompt_tokens is not None}
    biggest = max(cut, key=lambda a: a.request_bytes or 0)
    if biggest.request_sha256 in measured:
        # Other salts of the same turn tokenize a little differently: 2.1% off (1,993 for 1,952) seen eagerly.
        assert abs(conditions["max_prompt_tokens"] - measured[biggest.request_sha256]) <= 0.03 * conditions[
            "max_prompt_tokens"], (conditions, measured[biggest.request_sha256])
    assert 0 < conditions["max_prompt_tokens"] <= 2048  # the tiny model's context


# -- 3. KV starved -------------------------------------------------------------------------------------------
def test_kv_starved_server_is_judged_short_of_kv_with_the_limit_named(vllm_pool, request, tmp_path):
    """The session server (24 blocks of 128 tokens: one 2,000-token prompt at a time). vLLM 0.32 mostly
    queues what does not fit (waiting) and preempts what outgrows it; the harness names the KV cache.
    The verdict does not depend on the machine's speed (how long the queue lasts does), so setup 4's
    server starts meanwhile. The same run proves the plain path too: every family sent, usage from the
    server, the long input near the context, the control's warm twins hit and cold ones do not."""
    vllm_pool.start(no_auto_tools=NO_AUTO_TOOLS)
    vllm_server = request.getfixturevalue("vllm_server")
    flags = [" ".join(SERVER_ARGS), *(["--enforce-eager"] if EAGER else [])]
    verdict, code, out = accept(vllm_server, tmp_path, "3-kv-starved", flags, stages=KV_STAGES)
    resources = verdict["pillars"]["resources"]
    assert_cache_pass_or_undecided(verdict)  # a starved KV pool evicts and delays the pairs; judged in setup 1
    assert {p: s for p, s in statuses(verdict).items() if p != "prefix_cache"} == {
        "compat": "pass", "resources": "fail", "agent_api": "fail"}, json.dumps(verdict["next_action"], indent=1)
    stages = {s["stage"]: s for s in resources["numbers"]["stages"]}
    over = stages["concurrency-c8"]
    # The sampler reads the KV gauge once a second (late, under this load), so a full cache shows as a
    # 100% peak only when a reading falls in it: a clean-clone run read 96% (22 of 23 blocks) at most in
    # c8 while vLLM preempted 10 requests there. Either names the KV cache as what ran out in the stage.
    # The waiting gauge likewise: a run with the machine oversubscribed read 0 waiting in every c8 scrape
    # while vLLM preempted 2 there; the queue is asked of the whole run (its soak waited 9 s), not one stage.
    assert over["kv_usage_max"] >= 0.98 or over["preemptions"], over
    assert max(s["waiting_max"] or 0 for s in stages.values()) > 0, stages
    assert re.search(r"stage concurrency-c8 \(8 users\): .*(KV cache usage reached 100% > 98%|preemptions/min > )",
                     reasons(verdict, "resources"))
    # How long the queue stayed non-empty depends on this machine's speed (7 s and under 5 s both seen):
    # the rule must fire exactly when a stage's sustained wait passed the plan's limit.
    limit = THRESHOLDS["resources"]["max_waiting_sustained_s"]
    sustained = max((s.get("waiting_sustained_s") or 0.0) for s in stages.values())
    assert ("requests waited for" in reasons(verdict, "resources")) == (sustained > limit), (sustained, limit)
    assert sum(s["preemptions"] or 0 for s in stages.values()) > 0, stages
    assert verdict["limits"]["ran_out_first"] == "KV cache"
    assert verdict["limits"]["kv_cache_usage_ceiling"] < 0.98
    if verdict["verdict"] == "scale_up":  # even the base load did not fit, or not even the smallest step did
        # (one preemption in the 2-user step's few seconds is 8.5 a minute on a slow machine: seen in a clean run)
        assert code == 5 and ("even the base load stage exceeded its resource limits" in because(verdict) or
                              "no concurrency step stayed within limits (KV cache ran out first)" in because(verdict))
    else:
        assert verdict["verdict"] == "limited" and code == 3
        assert re.match(r"hold concurrency at \d users \(KV cache ran out above it\)", because(verdict))
    attempts = read_records(records_file(out))
    assert_every_failure_has_its_layer(attempts, verdict)
    assert all(a.status == "ok" for a in judged(attempts))  # queued and preempted, never refused
    assert {a.family for a in attempts} == {"agent", "shared_prefix", "cold", "long_input"}
    assert all(a.prompt_tokens and a.completion_tokens is not None for a in attempts if a.status == "ok")
    long_inputs = [a for a in attempts if a.family == "long_input" and a.status == "ok"]
    assert long_inputs and min(a.prompt_tokens or 0 for a in long_inputs) > 0.5 * vllm_server.max_model_len
    control = [a for a in attempts if a.stage == "prefix-control"]  # cold/warm twins: only the warm one hits
    assert control and [a.control_role for a in control] == ["cold", "warm"] * (len(control) // 2)
    assert all((a.cached_tokens or 0) * 10 < (a.prompt_tokens or 0) for a in control if a.control_role == "cold")
    assert all((a.cached_tokens or 0) > 0.5 * (a.prompt_tokens or 0) for a in control if a.control_role == "warm")


# -- 4. --enable-auto-tool-choice forgotten -----------------------------------------------------------------
def _turn_tool_choice(attempt: Attempt, scenarios: dict[str, Any]) -> Any:
    """The tool_choice the attempt sent: its turn's, or its fallback's once the retries were exhausted (the shipped
    timeout drill falls back to tool_choice none: served by this server, as a fallback should be)."""
    turn = scenarios[attempt.scenario].turns[attempt.turn]
    if attempt.path == "fallback" and turn.fallback is not None and turn.fallback.tool_choice is not None:
        return turn.fallback.tool_choice
    return turn.settings.get("tool_choice")


def test_forgotten_auto_tool_choice_is_a_server_refusal_not_a_shortage(vllm_pool, tmp_path):
    """vLLM 0.32 without --enable-auto-tool-choice builds no tool parser: every request with tools and a
    tool_choice other than "none" is refused with 400 before any work. Each refusal is a `server`
    failure (vLLM's own JSON error body, not a proxy's); the requests with tool_choice "none" are served.
    Not scale_up: a refusal is the configuration's fault, not a shortage (analysis/pillars/headroom/stages.py,
    _load_errors)."""
    vllm_pool.start(no_auto_tools=NO_AUTO_TOOLS)
    target = vllm_pool.get("no_auto_tools")
    try:
        verdict, code, out = accept(target, tmp_path, "4-no-auto-tool-choice", NO_AUTO_TOOLS.flags(),
                                    stages=REFUSED_STAGES)
    finally:
        vllm_pool.stop("no_auto_tools")
    assert statuses(verdict) == {"compat": "pass", "resources": "pass", "prefix_cache": "inconclusive",
                                 "agent_api": "fail"}, json.dumps(verdict["next_action"], indent=1)
    assert verdict["verdict"] == "limited" and code == 3
    assert re.search(r"by primary layer: .*server \d+; most frequent checks: transport x\d+",
                     reasons(verdict, "agent_api"))
    assert reasons(verdict, "prefix_cache") == \
        "inconclusive, because no cold/warm control pair completed (every pair had a failed request: server)"
    attempts = read_records(records_file(out))
    assert_every_failure_has_its_layer(attempts, verdict)
    scenarios = {s.name: s for s in load_scenarios(sorted((ROOT / "scenarios").glob("*.yaml")))}
    refused = [a for a in judged(attempts) if a.status == "http_error"]
    served = [a for a in judged(attempts) if a.status == "ok"]
    assert refused and served
    for attempt in refused:
        assert attempt.http_status == 400 and attempt.failed_layers == ["server"], attempt.error
        assert json.loads(attempt.error_body or "{}")["error"]["message"] == AUTO_REFUSED, attempt.error_body
        assert _turn_tool_choice(attempt, scenarios) != "none"
    assert all(_turn_tool_choice(a, scenarios) == "none" for a in served)
    assert {layer for a in served for layer in a.failed_layers} <= {"model_output", "parser"}
    # Whether a drill's short deadline expires in a 16 s load stage depends on the machine's speed; when one
    # did, its retry carries tools and is refused too: only a turn's fallback (tool_choice none, the shipped
    # timeout-retry scenario's) answers here, and the pillar says how many did not.
    drill = verdict["pillars"]["agent_api"]["numbers"]["timeout_drill"]
    chains: dict[str, list[Attempt]] = {}
    for attempt in sorted(attempts, key=lambda a: a.attempt):
        chains.setdefault(attempt.chain_id, []).append(attempt)
    answered = [c[-1] for c in chains.values() if any(a.drill for a in c) and c[-1].status == "ok" and len(c) > 1]
    assert len(answered) == drill["recovered"] and all(a.path == "fallback" for a in answered), (drill, answered)
    assert (f"timeout drill: only {drill['recovered']} of" in reasons(verdict, "agent_api")) == \
        (drill["judged"] > drill["recovered"]), drill
