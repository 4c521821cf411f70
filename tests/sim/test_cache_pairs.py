"""Prefix-cache control pairs (cold, then its warm twin with the same bytes) and long-input scenarios
that cannot fit the server's context (said once, never sent).

Why pairs: a warm request that asks a different question than the cold one compares unlike answers;
the twin of a cold request must hit exactly its prefix, so latency, hits and answers compare like for
like. Unit tests first (no sockets), then the sim, then one whole Locust run (marker `slow`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult
from k3load.evidence import records_file
from k3load.loadgen.session import HarnessSession
from k3load.records import Attempt, read_records
from k3load.rundir import JsonlLog
from k3load.workload.conversation import RunContext, run_scenario
from k3load.workload.long_input import estimate_tokens, fit_long_input
from k3load.workload.plan import Stage, load_plan
from k3load.workload.scenario import ScenarioError, load_scenario, load_scenarios, parse_scenario
from k3load.workload.stored_requests import build_request

ROOT = Path(__file__).resolve().parents[2]
CONTROL = ROOT / "scenarios" / "shared_prefix_control.yaml"
LONG = ROOT / "scenarios" / "long_input_policy.yaml"


def _stage(kind: str, name: str = "s") -> Stage:
    return Stage(name=name, kind=kind, start_s=0, duration_s=10, users=1, spawn_rate=1, mix={"shared_prefix": 1})


def _offline_session(max_model_len: int | None = None, events: Path | None = None) -> HarnessSession:
    """A session with no Locust, no server: enough to ask what a stage plays."""
    session = HarnessSession(SimpleNamespace(runner=None, host="http://127.0.0.1:9", parsed_options=None))
    session.max_model_len = max_model_len
    session.run = SimpleNamespace(events=JsonlLog(events)) if events else None  # only the events of a run
    session._count_tokens = lambda scenario: estimate_tokens()  # type: ignore[method-assign]
    return session


def _check_pairs(attempts: list[Attempt], pairs: int) -> None:
    """In order: cold 1, warm 1, cold 2, ...; each warm the same bytes as its cold twin, sent after it."""
    assert [(a.control_pair, a.control_role) for a in attempts] == \
        [(n, role) for n in range(1, pairs + 1) for role in ("cold", "warm")]
    colds, warms = attempts[0::2], attempts[1::2]
    for cold, warm in zip(colds, warms, strict=True):
        assert (warm.request_sha256, warm.prefix_sha256) == (cold.request_sha256, cold.prefix_sha256)
        assert warm.send_ts >= cold.end_ts
    assert len({c.prefix_sha256 for c in colds}) == pairs  # each cold prefix is new to the cache


# -- parsing (no sockets) -------------------------------------------------------------------------

def test_pair_is_a_prefix_salt_and_a_bad_one_names_the_field():
    control = load_scenario(CONTROL)
    assert control.prefix_salt == "pair" and control.family == "shared_prefix" and len(control.turns) >= 8
    data = yaml.safe_load(CONTROL.read_text())
    data["prefix_salt"] = "twice"
    with pytest.raises(ScenarioError, match=r"bad\.yaml: prefix_salt: 'twice' is not one of"):
        parse_scenario(data, Path("scenarios/bad.yaml"))


@pytest.mark.parametrize(("plan", "least"), [("smoke", 6), ("acceptance", 8)])
def test_shipped_plans_play_enough_pairs(plan, least):
    stages = [s for s in load_plan(ROOT / "plans" / f"{plan}.yaml").stages if s.kind == "prefix_control"]
    turns = len(load_scenario(CONTROL).turns)
    assert [s.users for s in stages] == [1]
    assert stages[0].mix == {"shared_prefix": 1} and stages[0].iterations_per_user * turns >= least


def test_the_control_stage_plays_pairs_and_no_other_stage_does():
    session = _offline_session()
    session.scenarios = {"shared_prefix": load_scenarios([CONTROL, ROOT / "scenarios" / "shared_prefix_support.yaml"])}
    for kind, expected in [("prefix_control", ["shared_prefix_control"]), ("soak", ["shared_prefix_support"]),
                           ("load", ["shared_prefix_support"])]:
        session.stage = _stage(kind)
        assert [s.name for s in session.playable("shared_prefix")] == expected, kind
    session.scenarios = {"shared_prefix": load_scenarios([CONTROL])}  # a family of the control only
    session.stage = _stage("soak")
    assert [s.name for s in session.playable("shared_prefix")] == ["shared_prefix_control"]


class FakeClient:
    """Answers at once on a fake clock; with `flaky`, every other request times out (a retry follows)."""

    transport = "fake"

    def __init__(self, flaky: bool = False) -> None:
        self.sent: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.clock = 1000.0
        self.flaky = flaky

    def send(self, body: bytes, deadline_s: float, *, headers: dict[str, str] | None = None) -> StreamResult:
        self.sent.append(body)
        self.headers.append(dict(headers or {}))
        self.clock += 1.0
        usage = {"prompt_tokens": 100, "completion_tokens": 5}
        if self.flaky and len(self.sent) % 2:
            return StreamResult(status="timeout", transport="fake", send_ts=self.clock, end_ts=self.clock + 0.5)
        return StreamResult(status="ok", transport="fake", send_ts=self.clock, end_ts=self.clock + 0.5,
                            content="fine", finish_reason="stop", usage=usage)


def test_pairs_keep_number_and_role_across_retries():
    data = yaml.safe_load(CONTROL.read_text())
    data["turns"] = [{"user": f"question {i}", "expect": {"kind": "any"}} for i in range(3)]
    data["defaults"]["retry"] = {"max_attempts": 2, "when": ["timeout"]}
    scenario = parse_scenario(data, Path("pairs.yaml"))
    client, attempts = FakeClient(flaky=True), []
    run_scenario(client, RunContext(run_id="r", model="m", user_id="u"), scenario, attempts.append)
    assert [(a.control_pair, a.control_role, a.attempt, a.status) for a in attempts] == [
        (n, role, number, status) for n in (1, 2, 3) for role in ("cold", "warm")
        for number, status in ((1, "timeout"), (2, "ok"))]
    _check_pairs([a for a in attempts if a.status == "ok"], 3)  # the warm twin waits for the cold retry
    assert len(set(client.sent)) == 3  # each pair: one body, sent four times


def test_every_attempt_sends_its_own_request_id_and_a_conversation_its_session_id():
    """The X-Request-Id is the record's (k3load-<attempt_id>: one grep finds vLLM's and the gateway's line);
    under --k3-session-header every turn of one conversation, cold and warm twins and retries, sends one id."""
    data = yaml.safe_load(CONTROL.read_text())
    data["turns"] = [{"user": f"question {i}", "expect": {"kind": "any"}} for i in range(2)]
    data["defaults"]["retry"] = {"max_attempts": 2, "when": ["timeout"]}
    scenario = parse_scenario(data, Path("pairs.yaml"))
    client, attempts = FakeClient(flaky=True), []
    ctx = RunContext(run_id="r", model="m", user_id="u", session_header="X-Session-Id")
    run_scenario(client, ctx, scenario, attempts.append)
    run_scenario(client, ctx, scenario, attempts.append)  # a second conversation: its own session id
    assert [h["X-Request-Id"] for h in client.headers] == [a.request_id for a in attempts]
    assert all(a.request_id == f"k3load-{a.attempt_id}" for a in attempts)
    assert len({a.request_id for a in attempts}) == len(attempts) == 16
    sessions = [h["X-Session-Id"] for h in client.headers]
    assert len(set(sessions[:8])) == len(set(sessions[8:])) == 1 and sessions[0] != sessions[8]
    client = FakeClient()
    run_scenario(client, RunContext(run_id="r", model="m", user_id="u"), scenario, [].append)
    assert all(set(h) == {"X-Request-Id"} for h in client.headers)  # no session header unless asked


def test_other_scenarios_carry_no_control_fields():
    scenario = load_scenario(ROOT / "scenarios" / "shared_prefix_support.yaml")
    attempts: list[Attempt] = []
    run_scenario(FakeClient(), RunContext(run_id="r", model="m", user_id="u"), scenario, attempts.append)
    assert attempts and all(a.control_pair is None and a.control_role is None for a in attempts)


def test_long_input_that_cannot_fit_is_said_once_and_not_played(tmp_path):
    long_input = load_scenario(LONG)
    small = fit_long_input(long_input, 512, estimate_tokens())
    assert not small.fits and small.document == "" and small.fixed_tokens + small.max_tokens > 512
    session = _offline_session(512, tmp_path / "events.jsonl")
    session.scenarios, session.stage = {"long_input": [long_input]}, _stage("long_input")
    assert session.playable("long_input") == [] and session.playable("long_input") == []
    session.events.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in e.items() if k != "ts"} for e in events] == [
        {"event": "long_input_unfit", "scenario": "long_input_policy", "fixed_tokens": small.fixed_tokens,
         "max_tokens": 64, "max_model_len": 512}]


def test_long_input_is_played_when_the_server_does_not_say_its_context():
    session = _offline_session(None)
    session.scenarios, session.stage = {"long_input": [load_scenario(LONG)]}, _stage("long_input")
    assert [s.name for s in session.playable("long_input")] == ["long_input_policy"]


# -- against the sim ---------------------------------------------------------------------------------

def test_control_pairs_on_the_sim_hit_only_when_warm(sim):
    control = load_scenario(CONTROL)
    attempts: list[Attempt] = []
    with ChatClient(sim.base_url) as client:
        run_scenario(client, RunContext(run_id="pairs-test", model="tiny", user_id="u1"), control, attempts.append)
    assert all(a.status == "ok" for a in attempts), Counter((a.status, a.error) for a in attempts)
    _check_pairs(attempts, len(control.turns))
    for cold, warm in zip(attempts[0::2], attempts[1::2], strict=True):
        assert warm.prompt_tokens == cold.prompt_tokens > 1000  # spans many cache blocks
        assert cold.cached_tokens < 0.05 * cold.prompt_tokens  # at most the head shared before the salt
        assert warm.cached_tokens >= 0.8 * warm.prompt_tokens, (cold.control_pair, warm.cached_tokens)


def _session_on(sim: Any, events: Path) -> HarnessSession:
    options = SimpleNamespace(k3_api_key=None, k3_model=None)
    session = HarnessSession(SimpleNamespace(runner=None, host=sim.base_url, parsed_options=options))
    session._discover_server()
    session.run = SimpleNamespace(events=JsonlLog(events))  # only the events of a run
    return session


def test_a_small_server_context_skips_the_long_input_once(start_sim, tmp_path):
    session = _session_on(start_sim("--max-model-len", "512"), tmp_path / "events.jsonl")
    session.scenarios, session.stage = {"long_input": [load_scenario(LONG)]}, _stage("long_input")
    assert session.max_model_len == 512
    assert session.playable("long_input") == [] and session.playable("long_input") == []
    session.events.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["long_input_unfit"]
    assert events[0]["fixed_tokens"] + events[0]["max_tokens"] > events[0]["max_model_len"] == 512


def test_a_large_server_context_sizes_the_document_below_it(start_sim, tmp_path):
    sim = start_sim("--max-model-len", "16384")
    session = _session_on(sim, tmp_path / "events.jsonl")
    scenario = load_scenario(LONG)
    assert session.fits(scenario) and session.long_context(scenario)
    prepared = build_request(scenario, 0, session.model, "salt", session.long_context(scenario))
    with ChatClient(sim.base_url) as client:
        result = client.send(prepared.body, 60)
    assert result.status == "ok" and 0.5 * 16384 < result.prompt_tokens + 64 <= 16384, result.prompt_tokens
    session.events.close()
    assert (tmp_path / "events.jsonl").read_text() == ""


# -- one whole Locust run --------------------------------------------------------------------------

PLAN = {"name": "pairs", "stages": [
    {"name": "prefix-control", "kind": "prefix_control", "duration_s": 6, "users": 1, "mix": {"shared_prefix": 1},
     "iterations_per_user": 1},
    {"name": "long-input", "kind": "long_input", "duration_s": 3, "users": 1, "mix": {"long_input": 1}},
    {"name": "soak", "kind": "soak", "duration_s": 3, "users": 2, "mix": {"shared_prefix": 1, "long_input": 1}},
]}


def _scenarios_with_an_unfit_long_input(folder: Path) -> str:
    """The control, the shared-prefix traffic, the long input, and a copy of it whose answer budget
    alone exceeds the sim's 2,048-token context."""
    folder.mkdir()
    for name in ("shared_prefix_control", "shared_prefix_support", "long_input_policy"):
        (folder / f"{name}.yaml").write_text((ROOT / "scenarios" / f"{name}.yaml").read_text())
    data = yaml.safe_load(LONG.read_text())
    data["name"], data["defaults"]["max_tokens"] = "long_input_huge", 4000
    (folder / "long_input_huge.yaml").write_text(yaml.safe_dump(data))
    return str(folder / "*.yaml")


def _locust(host: str, out: Path, plan: Path, scenarios: str, timeout_s: float = 120) -> int:
    """The run in its own process group, killed whole if it overruns."""
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
           "--host", host, "--k3-out", str(out), "--k3-plan", str(plan), "--k3-scenarios", scenarios,
           "--stop-timeout", "10", "--only-summary", "--k3-recipe", "recipes/local-dev.yaml"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        return proc.wait(timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_run_plays_the_control_as_pairs_and_skips_what_cannot_fit(sim, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN))
    out = tmp_path / "run"
    _locust(sim.base_url, out, plan, _scenarios_with_an_unfit_long_input(tmp_path / "scenarios"))
    attempts = read_records(records_file(out))
    control = [a for a in attempts if a.stage == "prefix-control"]
    assert {a.scenario for a in control} == {"shared_prefix_control"}
    _check_pairs(control, 8)
    assert all(a.cached_tokens >= 0.8 * a.prompt_tokens for a in control[1::2])
    later = [a for a in attempts if a.stage != "prefix-control"]
    assert {a.scenario for a in later} == {"shared_prefix_support", "long_input_policy"}
    assert all(a.control_pair is None and a.control_role is None for a in later)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    unfit = [e for e in events if e["event"] == "long_input_unfit"]
    assert [(e["scenario"], e["max_tokens"], e["max_model_len"]) for e in unfit] == [("long_input_huge", 4000, 2048)]
    assert not (out / "samples" / "long_input_huge").exists()

