"""The capacity search (issue 27, item 3): the plan's `kind: search` stage and the pure controller, step by
step over made-up evidence; seeded noise must not flip its answer. The live run against the sim is
tests/sim/test_search_sim.py."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from k3load.analysis.pillars.headroom.full_batch import BatchQueue
from k3load.loadgen.search import (
    BELOW_GOODPUT,
    HELD,
    NEAR_BOUND,
    PAST_CAPACITY,
    ResourceLimits,
    SearchController,
    StepEvidence,
    decide_step,
)
from k3load.workload.plan import PlanError, SearchSpec, parse_plan

SEARCH = {"name": "find", "kind": "search", "max_users": 32, "step_s": 5, "max_total_s": 120, "mix": {"agent": 1}}
LOAD = {"name": "load", "kind": "load", "duration_s": 3, "users": 2, "mix": {"agent": 1}}


# -- the plan ---------------------------------------------------------------------------------------------
def test_a_search_stage_reserves_max_total_s_with_its_defaults():
    plan = parse_plan({"name": "p", "stages": [LOAD, SEARCH, {**LOAD, "name": "after"}],
                       "capacity": {"target_users": [2000], "headroom": 0.3, "gpu_hour_cost": 2.5}}, "p.yaml")
    search = plan.stages[1]
    assert (search.name, search.kind, search.start_s, search.duration_s, search.users) == ("find", "search", 3, 120, 1)
    assert search.search == SearchSpec(max_users=32, step_s=5, max_total_s=120, start_users=1, factor=2.0,
                                       resolution=0.1, min_goodput=0.99, max_step_s=15, search_on="users")
    assert search.step is None and plan.stages[2].start_s == 123
    assert plan.capacity == {"target_users": [2000], "headroom": 0.3, "gpu_hour_cost": 2.5}
    assert parse_plan({"name": "p", "stages": [LOAD]}, "p.yaml").capacity == {}


@pytest.mark.parametrize(("change", "says"), [
    ({"duration_s": 3}, "stages[0].duration_s: not for a search stage"),
    ({"users": 3}, "stages[0].users: not for a search stage"),
    ({"steps": [1, 2]}, "stages[0].steps: not for a search stage"),
    ({"max_users": None}, "'max_users' is a required property"),
    ({"step_s": None}, "'step_s' is a required property"),
    ({"max_total_s": None}, "'max_total_s' is a required property"),
    ({"search_on": "sessions_per_s"}, "stages[0].max_sessions_per_s: required for a search on sessions_per_s"),
    ({"search_on": "tokens"}, "stages[0].search_on"),
    ({"factor": 1}, "stages[0].factor"),
    ({"resolution": 1}, "stages[0].resolution"),
    ({"min_goodput": 1.5}, "stages[0].min_goodput"),
    ({"start_users": 40}, "stages[0].start_users: 40 is above max_users 32"),
    ({"max_step_s": 2}, "stages[0].max_step_s: 2 is below step_s 5"),
    ({"max_total_s": 3}, "stages[0].max_total_s: 3 leaves no room"),
    ({"bisect": True}, "Additional properties"),
])
def test_a_bad_search_stage_is_one_line_naming_the_field(change, says):
    stage = {k: v for k, v in {**SEARCH, **change}.items() if v is not None}
    with pytest.raises(PlanError, match=r"p\.yaml: ") as caught:
        parse_plan({"name": "p", "stages": [stage]}, "p.yaml")
    assert says in str(caught.value)


def test_search_keys_belong_to_search_stages_and_the_capacity_block_is_strict():
    with pytest.raises(PlanError, match=r"stages\[0\]\.step_s: only for a search stage"):
        parse_plan({"name": "p", "stages": [{**LOAD, "step_s": 3}]}, "p.yaml")
    with pytest.raises(PlanError, match=r"stages\[0\]: 'duration_s' is a required property"):
        parse_plan({"name": "p", "stages": [{k: v for k, v in LOAD.items() if k != "duration_s"}]}, "p.yaml")
    for bad in ({"headroom": 1}, {"target_users": [0]}, {"target_sessions_per_s": [0]}, {"gpus_per_replica": 0},
                {"gpu_hour_cost": -1}, {"replicas": 3}):
        with pytest.raises(PlanError, match="capacity"):
            parse_plan({"name": "p", "stages": [LOAD], "capacity": bad}, "p.yaml")


# -- one step's decision ------------------------------------------------------------------------------------
SPEC = SearchSpec(max_users=32, step_s=10, max_total_s=600, start_users=2, max_step_s=30)
LIMITS = ResourceLimits(max_kv_usage=0.98, max_preemptions_per_min=5)
QUEUED = BatchQueue(scrapes=10, queued=8, cap=8, cap_from="the most it ran at once in the step")
CALM = BatchQueue(scrapes=10, queued=1, cap=8, cap_from="the most it ran at once in the step")


@pytest.mark.parametrize(("evidence", "elapsed", "repeat", "decision"), [
    (StepEvidence(500, 500, CALM), 5, False, None),  # before step_s: never decided
    (StepEvidence(500, 500, CALM), 10, False, HELD),  # interval clear above 0.99
    (StepEvidence(500, 500, QUEUED), 10, False, PAST_CAPACITY),  # a queue behind a full batch, however good
    (StepEvidence(500, 500, CALM, kv_usage_max=0.99), 10, False, PAST_CAPACITY),
    (StepEvidence(500, 500, CALM, preemptions=2, duration_s=10), 10, False, PAST_CAPACITY),  # 12 per minute
    (StepEvidence(500, 500, CALM, preemptions=0, duration_s=10), 10, False, HELD),
    (StepEvidence(100, 80, CALM), 10, False, BELOW_GOODPUT),  # the interval's high end below 0.99
    (StepEvidence(100, 100, CALM), 10, False, None),  # (0.963, 1): straddles, extended
    (StepEvidence(100, 100, CALM), 30, False, NEAR_BOUND),  # still straddling at max_step_s: repeated
    (StepEvidence(200, 199, CALM), 30, True, HELD),  # the repeat, still straddling: the point estimate
    (StepEvidence(200, 196, CALM), 30, True, BELOW_GOODPUT),
    (StepEvidence(0, 0, None), 30, True, BELOW_GOODPUT),  # nothing answered in two whole steps
])
def test_a_step_is_decided_by_its_interval_and_the_full_batch_queue(evidence, elapsed, repeat, decision):
    assert decide_step(evidence, SPEC, LIMITS, elapsed, repeat) == decision


def test_two_runs_of_a_step_combine_their_evidence():
    first = StepEvidence(100, 99, CALM, kv_usage_max=0.5, preemptions=1, duration_s=30)
    both = first.plus(StepEvidence(150, 150, QUEUED, kv_usage_max=0.6, preemptions=None, duration_s=30))
    assert (both.requests, both.good, both.kv_usage_max, both.preemptions, both.duration_s) == (250, 249, 0.6, 1, 60)
    assert both.queue == BatchQueue(20, 9, 8, CALM.cap_from) and not both.queue.past_capacity


# -- the whole search over a made-up server ------------------------------------------------------------------
World = Callable[[int, int, random.Random], StepEvidence]  # (users, seconds run, rng) -> evidence


def queue_world(capacity: int, rate_per_user: float = 10.0, p_good: float = 0.9995) -> World:
    """A server that runs `capacity` at once: more users queue behind the full batch, latency still in SLO."""
    def evidence(users: int, seconds: int, rng: random.Random) -> StepEvidence:
        n = int(rate_per_user * users * seconds)
        good = sum(rng.random() < p_good for _ in range(n))
        queued = seconds * 2 if users > capacity else 0
        return StepEvidence(n, good, BatchQueue(seconds * 2, queued, capacity, "test"), 0.3, 0.0, float(seconds))
    return evidence


def goodput_world(capacity: int, below: float = 0.9, rate_per_user: float = 10.0) -> World:
    """No queue shows (no gauges): the SLO breaks above `capacity` users, `below` of requests still good."""
    def evidence(users: int, seconds: int, rng: random.Random) -> StepEvidence:
        n = int(rate_per_user * users * seconds)
        p = 0.9995 if users <= capacity else below
        return StepEvidence(n, sum(rng.random() < p for _ in range(n)), None, None, None, float(seconds))
    return evidence


def run(controller: SearchController, world: World, seed: int = 0,
        noise: Callable[[int, StepEvidence], StepEvidence] = lambda step, e: e) -> list[tuple[int, str]]:
    """Look at each step once a second as the shape does, on a clock that only the steps advance."""
    rng, total, trail = random.Random(seed), 0, []
    for _ in range(1000):  # bounded: a controller that never ends fails the test
        if controller.users is None:
            return trail
        users, step = controller.users, controller.step
        for seconds in range(1, 10_000):
            total += 1
            result = controller.observe(noise(step, world(users, seconds, rng)), seconds, total)
            if result is not None or controller.ended:
                break
        if result is not None:
            trail.append((result.users, result.decision))
    raise AssertionError("the search never ended")


def test_grows_by_factor_then_bisects_to_the_queue_bound():
    controller = SearchController(SPEC)
    trail = run(controller, queue_world(8))
    assert trail == [(2, HELD), (4, HELD), (8, HELD), (16, PAST_CAPACITY), (12, PAST_CAPACITY),
                     (10, PAST_CAPACITY), (9, PAST_CAPACITY)]
    assert (controller.last_good, controller.first_bad, controller.ended) == (8, 9, "resolved")
    assert [r.step for r in controller.results] == list(range(1, 8))


def test_resolution_stops_the_bisection_once_the_bracket_is_narrow_enough():
    controller = SearchController(SearchSpec(max_users=1000, step_s=10, max_total_s=10_000, start_users=50,
                                             max_step_s=30, resolution=0.1))
    run(controller, queue_world(130))
    assert controller.ended == "resolved" and controller.last_good <= 130 < controller.first_bad
    assert controller.first_bad - controller.last_good <= 0.1 * controller.last_good


def test_growth_rounds_up_by_at_least_one_user_and_stops_at_max_users():
    controller = SearchController(SearchSpec(max_users=7, step_s=10, max_total_s=10_000, factor=1.2, max_step_s=30,
                                             min_goodput=0.95))
    trail = run(controller, queue_world(64))
    assert [users for users, _ in trail] == [1, 2, 3, 4, 5, 6, 7]
    assert controller.ended == "max_users_held" and controller.last_good == 7 and controller.first_bad is None


def test_a_first_step_that_fails_bisects_down_to_nothing_held():
    controller = SearchController(SearchSpec(max_users=32, step_s=10, max_total_s=10_000, start_users=4,
                                             max_step_s=30))
    trail = run(controller, goodput_world(0, below=0.5))
    assert trail == [(4, BELOW_GOODPUT), (2, BELOW_GOODPUT), (1, BELOW_GOODPUT)]
    assert (controller.last_good, controller.first_bad, controller.ended) == (None, 1, "nothing_held")


def test_max_total_s_cuts_the_search_with_the_bracket_it_had():
    controller = SearchController(SearchSpec(max_users=32, step_s=10, max_total_s=45, start_users=2, max_step_s=30))
    trail = run(controller, queue_world(8, rate_per_user=50))
    assert trail == [(2, HELD), (4, HELD), (8, HELD), (16, PAST_CAPACITY)]  # 10 s each; no room for a fifth
    assert (controller.last_good, controller.first_bad, controller.ended) == (8, 16, "max_total_s")


def test_a_step_undecided_at_max_total_s_is_not_counted():
    controller = SearchController(SearchSpec(max_users=32, step_s=10, max_total_s=25, start_users=1, max_step_s=30,
                                             min_goodput=0.99))
    trail = run(controller, goodput_world(8, rate_per_user=2))  # 1 user: 20 requests in 10 s, straddling
    assert trail == [] and controller.ended == "max_total_s" and controller.last_good is None


def test_stop_ends_the_search_as_stopped():
    controller = SearchController(SPEC)
    controller.stop()
    assert controller.ended == "stopped" and controller.users is None
    assert controller.observe(StepEvidence(500, 500), 10, 10) is None


def test_the_goodput_bound_is_found_where_no_queue_shows():
    controller = SearchController(SPEC)
    run(controller, goodput_world(8))
    assert (controller.last_good, controller.first_bad, controller.ended) == (8, 9, "resolved")


@pytest.mark.parametrize("seed", range(20))
def test_seeded_noise_never_flips_the_answer(seed):
    """Binomial noise in every step, and one step (the first run of 8 users) hit by a burst of failures that
    leaves its interval straddling min_goodput: it is repeated, and the combined evidence holds it."""
    def burst(step: int, evidence: StepEvidence) -> StepEvidence:
        if step == 3:  # 2, 4, then the first run of 8
            lost = min(evidence.good, max(evidence.requests // 50, 1))  # 2% failed: straddles 0.98 throughout
            return StepEvidence(evidence.requests, evidence.good - lost, evidence.queue, evidence.kv_usage_max,
                                evidence.preemptions, evidence.duration_s)
        return evidence
    controller = SearchController(SearchSpec(max_users=32, step_s=10, max_total_s=10_000, start_users=2,
                                             max_step_s=30, min_goodput=0.98))
    trail = run(controller, goodput_world(8, below=0.9), seed=seed, noise=burst)
    assert (8, NEAR_BOUND) in trail and trail.index((8, NEAR_BOUND)) + 1 == trail.index((8, HELD))
    assert (controller.last_good, controller.first_bad, controller.ended) == (8, 9, "resolved")


def test_requests_waiting_longer_on_end_than_the_plan_allows_fail_a_step_as_the_analysis_does() -> None:
    """The analysis holds every step to resources.waiting_sustained; the search holds it to the same limit, so
    the two agree on which steps held (a 5.5 s wait against a 5 s limit failed a step the search had held)."""
    from k3load.loadgen.search import ResourceLimits, StepEvidence, past_capacity

    limits = ResourceLimits.from_limits({"resources": {"max_waiting_sustained_s": 5}})
    assert past_capacity(StepEvidence(requests=9, good=9, waiting_sustained_s=5.5), limits)
    assert not past_capacity(StepEvidence(requests=9, good=9, waiting_sustained_s=4.0), limits)
    both = StepEvidence(waiting_sustained_s=2.0).plus(StepEvidence(waiting_sustained_s=6.0))
    assert both.waiting_sustained_s == 6.0 and past_capacity(both, limits)


# -- a search on the arrival rate (search_on: sessions_per_s) --------------------------------------------------
RATE_SPEC = SearchSpec(max_users=64, step_s=10, max_total_s=2000, search_on="sessions_per_s",
                       start_sessions_per_s=0.5, max_sessions_per_s=16.0, resolution=0.1, max_step_s=30)


def rate_world(capacity_per_s: float) -> Callable[[float, int, random.Random], StepEvidence]:
    """A server whose batch fills above `capacity_per_s` sessions a second."""
    def evidence(rate: float, seconds: int, rng: random.Random) -> StepEvidence:
        n = int(60 * rate * seconds)
        queued = seconds * 2 if rate > capacity_per_s else 0
        return StepEvidence(n, n, BatchQueue(seconds * 2, queued, 8, "test"), 0.3, 0.0, float(seconds))
    return evidence


def run_rate(controller: SearchController, world: Callable[[float, int, random.Random], StepEvidence]
             ) -> list[tuple[float, int, str]]:
    rng, total, trail = random.Random(0), 0, []
    for _ in range(1000):
        if controller.load is None:
            return trail
        rate = controller.load
        assert controller.sessions_per_s == rate and controller.users == 64  # the session slots, every step
        for seconds in range(1, 10_000):
            total += 1
            result = controller.observe(world(rate, seconds, rng), seconds, total)
            if result is not None or controller.ended:
                break
        if result is not None:
            trail.append((result.sessions_per_s, result.users, result.decision))
    raise AssertionError("the search never ended")


def test_a_rate_search_grows_then_halves_the_bracket_to_its_resolution():
    controller = SearchController(RATE_SPEC)
    trail = run_rate(controller, rate_world(3.1))
    rates = [t[0] for t in trail]
    assert rates[:4] == [0.5, 1.0, 2.0, 4.0] and trail[3][2] == PAST_CAPACITY
    assert controller.ended == "resolved" and controller.last_good <= 3.1 < controller.first_bad
    assert controller.first_bad - controller.last_good <= 0.1 * controller.last_good
    assert abs(controller.last_good - 3.1) / 3.1 < 0.1  # within the resolution of the true bound


def test_a_rate_search_ends_at_its_top_rate_or_at_nothing_held():
    top = SearchController(RATE_SPEC)
    assert [t[0] for t in run_rate(top, rate_world(100.0))] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert top.ended == "max_rate_held" and top.last_good == 16.0
    none = SearchController(RATE_SPEC)
    run_rate(none, rate_world(0.01))
    assert none.ended == "nothing_held" and none.last_good is None and none.first_bad <= 0.05


def test_an_open_loop_step_that_sent_its_turns_late_did_not_offer_its_rate() -> None:
    from k3load.loadgen.search import ResourceLimits, StepEvidence, past_capacity

    limits = ResourceLimits()
    assert past_capacity(StepEvidence(requests=50, good=50, scheduled=50, late=6), limits)  # 12% late
    assert not past_capacity(StepEvidence(requests=50, good=50, scheduled=50, late=5), limits)  # 10%: not above
    assert not past_capacity(StepEvidence(requests=9, good=9, scheduled=9, late=9), limits)  # too few to say
    both = StepEvidence(scheduled=20, late=1).plus(StepEvidence(scheduled=20, late=4))
    assert (both.scheduled, both.late) == (40, 5) and past_capacity(both, limits)


def test_an_open_loop_step_whose_sessions_never_started_did_not_offer_its_rate() -> None:
    """One session slot at 8 sessions/s: the schedule's tickets wait untaken, so too few turns are sent to show
    as late; fewer sessions began than the rate offered (seen on the sim: the step was held before this rule)."""
    from k3load.analysis.pillars.headroom.arrival_lag import offered_short
    from k3load.loadgen.search import ResourceLimits, StepEvidence, past_capacity

    assert offered_short(48.0, 6) and not offered_short(48.0, 40) and not offered_short(3.0, 0)
    assert past_capacity(StepEvidence(requests=6, good=6, arrived=6, offered=48.0), ResourceLimits())
    assert not past_capacity(StepEvidence(requests=45, good=45, arrived=45, offered=48.0), ResourceLimits())
    assert not past_capacity(StepEvidence(requests=9, good=9), ResourceLimits())  # closed-loop: nothing offered
