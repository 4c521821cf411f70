"""Cluster intervals against a simulated design with known truth: what a 95% interval claims, it covers.

The design is a temperature-0 run: 40 distinct requests, each with its own chance of a valid answer
(drawn from a Beta: most prompts nearly always pass, a few nearly always fail), each repeated 1-200
times. The truth is the Beta's mean (the deployment's rate over prompts like these). Over many seeded
repeats the cluster interval covers it about 95% of the time; Wilson's over the attempts, which takes
every repeat for a new trial, covers it far less often.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from k3load.analysis.run.clusters import attempt_key, cluster_key, rate_by_keys
from k3load.analysis.run.stats import MIN_DISTINCT_REQUESTS, cluster_rate, decide_rate, more_requests_to_decide, wilson
from k3load.client.result import StreamResult
from k3load.outcomes import INCONCLUSIVE, PASS
from k3load.workload.conversation import RunContext, make_attempt
from k3load.workload.plan import PlanError, parse_plan
from k3load.workload.scenario import load_scenarios
from k3load.workload.stored_requests import build_request

ROOT = Path(__file__).resolve().parents[2]

REPEATS = 600


def _design(rng: np.random.Generator, a: float, b: float, clusters: int = 40) -> tuple[np.ndarray, np.ndarray]:
    chance = rng.beta(a, b, size=clusters)
    sizes = rng.integers(1, 201, size=clusters)
    return rng.binomial(sizes, chance), sizes


def _coverage(a: float, b: float) -> tuple[float, float]:
    truth = a / (a + b)
    rng = np.random.default_rng(25)
    ours = naive = 0
    for _ in range(REPEATS):
        successes, sizes = _design(rng, a, b)
        rate = cluster_rate(successes, sizes)
        plain = wilson(int(successes.sum()), int(sizes.sum()))
        ours += rate.low <= truth <= rate.high
        naive += plain.low <= truth <= plain.high
    return ours / REPEATS, naive / REPEATS


def test_the_cluster_interval_covers_the_true_rate_about_95_percent_of_the_time():
    """Near-deterministic prompts (temperature 0: ICC about 0.8), 90% of them valid on average."""
    ours, naive = _coverage(0.225, 0.025)
    assert 0.92 <= ours <= 0.98, ours
    assert naive < 0.5, naive  # attempts taken for trials: the interval is several times too narrow


def test_with_flakier_prompts_the_interval_still_covers_at_least_as_claimed():
    """ICC about 0.1 (answers vary between repeats): the bound at one trial per distinct request makes
    the interval cautious there, never overconfident."""
    ours, naive = _coverage(9.0, 1.0)
    assert ours >= 0.92, ours
    assert naive < 0.7, naive


def test_37_requests_repeated_4373_times_give_a_much_wider_interval_than_wilson():
    sizes = np.full(37, 4373 // 37)
    sizes[: 4373 - int(sizes.sum())] += 1
    rate = cluster_rate(sizes, sizes)  # every attempt valid, as in the demo
    plain = wilson(4373, 4373)
    assert rate.n == 4373 and rate.clusters == 37
    assert rate.text() == "100.0% of 37 distinct requests (95% CI 90.6%-100.0%), 4,373 attempts"
    assert (1 - rate.low) > 50 * (1 - plain.low)  # Wilson claimed 99.9%-100.0%
    assert rate.to_dict()["distinct_requests"] == 37


def test_the_issues_example_reads_as_written():
    sizes = np.full(50, 87)
    successes = np.where(np.arange(50) < 46, sizes, 0)  # 46 prompts always pass, 4 always fail
    rate = cluster_rate(successes, sizes)
    assert rate.text() == "92.0% of 50 distinct requests (95% CI 81.2%-96.8%), 4,350 attempts"


def test_fewer_than_the_minimum_distinct_requests_decide_nothing():
    few = cluster_rate([100] * (MIN_DISTINCT_REQUESTS - 1), [100] * (MIN_DISTINCT_REQUESTS - 1))
    assert decide_rate(few, 0.5) == INCONCLUSIVE
    enough = cluster_rate([100] * 60, [100] * 60)
    assert decide_rate(enough, 0.9) == PASS
    more = more_requests_to_decide(cluster_rate([100] * 20, [100] * 20), 0.95)
    assert more is not None and 50 <= more <= 60  # as for 20 independent attempts: one trial a request


def test_temperature_above_0_makes_every_attempt_its_own_draw():
    assert cluster_key("bytes", "a1", 0.0, None) == "bytes"
    assert cluster_key("bytes", "a1", None, None) == "bytes"  # older records: by their bytes
    assert cluster_key("bytes", "a1", 0.7, None) == "a1"
    assert cluster_key("bytes", "a1", 0.7, 42) == "bytes"  # a fixed seed repeats its draw
    keys = [cluster_key("same", f"a{i}", 0.7, None) for i in range(200)]
    rate = rate_by_keys(keys, [True] * 200)
    assert rate.clusters == 200 and rate.low == wilson(200, 200).low
    mixed = rate_by_keys([f"a{i}" for i in range(50)], [i % 5 != 0 for i in range(50)])
    assert (mixed.low, mixed.high) == (wilson(40, 50).low, wilson(40, 50).high)  # each its own request: Wilson's
    drawn = [SimpleNamespace(request_sha256="x", attempt_id=str(i), temperature=t, seed=seed)
             for i, (t, seed) in enumerate([(0.0, None), (0.7, None), (0.7, 3)], start=1)]
    assert [attempt_key(a) for a in drawn] == ["x", "2", "x"]


def test_a_plan_sets_temperature_and_seed_per_family_and_the_body_carries_them():
    scenarios = load_scenarios(sorted((ROOT / "scenarios").glob("*.yaml")))
    agent = next(s for s in scenarios if s.family == "agent")
    stage = {"name": "load", "kind": "load", "duration_s": 5, "users": 1, "mix": {"agent": 1}}
    plain = parse_plan({"name": "p", "stages": [stage]}, "p.yaml")
    assert plain.sampled(agent) is agent  # as written: temperature 0, no seed
    plan = parse_plan({"name": "p", "stages": [stage], "sampling": {"agent": {"temperature": 0.7, "seed": 7}}},
                      "p.yaml")
    body = json.loads(build_request(plan.sampled(agent), 0, "m").body)
    assert body["temperature"] == 0.7 and body["seed"] == 7
    assert "seed" not in json.loads(build_request(agent, 0, "m").body)
    with pytest.raises(PlanError, match="sampling"):
        parse_plan({"name": "p", "stages": [stage], "sampling": {"agent": {"top_k": 3}}}, "p.yaml")


def test_each_attempt_records_the_temperature_and_seed_it_was_sent_with():
    scenarios = load_scenarios(sorted((ROOT / "scenarios").glob("*.yaml")))
    agent = next(s for s in scenarios if s.family == "agent")
    drawn = replace(agent, turns=tuple(replace(t, settings={**t.settings, "temperature": 0.5}) for t in agent.turns))
    prepared = build_request(drawn, 0, "m")
    result = StreamResult(transport="t", status="ok", send_ts=1.0, end_ts=2.0)
    ctx = RunContext(run_id="r", model="m", user_id="u")
    attempt = make_attempt(ctx, drawn, drawn.turns[0], prepared, result, [], "c", 1, False, {})
    assert (attempt.temperature, attempt.seed) == (0.5, None)
    assert json.loads(attempt.to_json())["temperature"] == 0.5
    assert attempt_key(attempt) == attempt.attempt_id  # a fresh draw: its own distinct request
