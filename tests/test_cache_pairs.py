"""Prefix-cache control pairs (cold, then its warm twin with the same bytes).

Why pairs: a warm request that asks a different question than the cold one compares unlike answers;
the twin of a cold request must hit exactly its prefix, so latency, hits and answers compare like for
like. Unit tests first (no sockets), then the sim, then one whole Locust run (marker `slow`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from k3load.client.chat import ChatClient
from k3load.client.result import StreamResult
from k3load.loadgen.session import HarnessSession
from k3load.plan import Stage, load_plan
from k3load.records import Attempt
from k3load.runner import RunContext, run_scenario
from k3load.scenario import ScenarioError, load_scenario, load_scenarios, parse_scenario

ROOT = Path(__file__).resolve().parents[1]
CONTROL = ROOT / "scenarios" / "shared_prefix_control.yaml"
LONG = ROOT / "scenarios" / "long_input_policy.yaml"


def _stage(kind: str, name: str = "s") -> Stage:
    return Stage(name=name, kind=kind, start_s=0, duration_s=10, users=1, spawn_rate=1, mix={"shared_prefix": 1})


def _offline_session() -> HarnessSession:
    """A session with no Locust, no server: enough to ask what a stage plays."""
    return HarnessSession(SimpleNamespace(runner=None, host="http://127.0.0.1:9", parsed_options=None))


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
        self.clock = 1000.0
        self.flaky = flaky

    def send(self, body: bytes, deadline_s: float) -> StreamResult:
        self.sent.append(body)
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


def test_other_scenarios_carry_no_control_fields():
    scenario = load_scenario(ROOT / "scenarios" / "shared_prefix_support.yaml")
    attempts: list[Attempt] = []
    run_scenario(FakeClient(), RunContext(run_id="r", model="m", user_id="u"), scenario, attempts.append)
    assert attempts and all(a.control_pair is None and a.control_role is None for a in attempts)


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
