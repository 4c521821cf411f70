"""The acceptance plan run against a real vLLM CPU server, shared by the real-server setups
(tests/real/test_real_server_*.py) and the real instruct model's (tests/real/test_real_model.py): the plan
scaled to a 2-core CPU server, its CPU-scaled SLOs and the setups' server configurations, `locust -f
locustfiles/agent.py --headless` with the local-dev recipe and the server's own log as startup and followed log,
and the verdict.json readers. Each run's verdict.json, validation_summary.json, compat.json and report.md are
kept under runs/real-server/SETUP/ (docs/real-server-results.md is written from them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from k3load.outcomes import LAYERS
from k3load.records import Attempt
from tests.target_fixtures import ServerConfig, VllmTarget

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
