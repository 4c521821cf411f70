"""Open-loop sessions (issue 27 item 1): arrival processes and the agents' gaps between turns. No sockets."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.loadgen.arrivals import ArrivalSchedule, Schedules, gap_s
from k3load.workload.plan import ArrivalSpec as Arrival
from k3load.workload.scenario import load_scenario
from k3load.workload.think_time import DEFAULT_TOOL_TIME, DEFAULT_USER_THINK, Duration, called_tools, gap_before

ROOT = Path(__file__).resolve().parents[2]


def _gaps(arrival: Arrival, n: int = 4000) -> list[float]:
    rng = random.Random(7)
    return [gap_s(arrival, rng) for _ in range(n)]


@pytest.mark.parametrize("process, burstiness", [("poisson", 1.0), ("constant", 1.0), ("gamma", 0.5),
                                                 ("gamma", 4.0)])
def test_every_process_arrives_at_the_plans_rate(process: str, burstiness: float) -> None:
    gaps = _gaps(Arrival(5.0, process, burstiness))
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.06)


def test_burstiness_below_one_is_burstier_than_poisson_and_above_steadier() -> None:
    cv = {k: statistics.pstdev(g) / statistics.fmean(g) for k, g in
          (("bursty", _gaps(Arrival(5.0, "gamma", 0.25))), ("poisson", _gaps(Arrival(5.0, "poisson"))),
           ("steady", _gaps(Arrival(5.0, "gamma", 8.0))), ("constant", _gaps(Arrival(5.0, "constant"))))}
    assert cv["bursty"] > 1.5 > cv["poisson"] > 0.8 > 0.5 > cv["steady"] > cv["constant"] == 0.0


def test_a_schedule_keeps_its_intended_times_and_ends_with_its_stage() -> None:
    schedule = ArrivalSchedule(Arrival(10.0, "constant"), start_ts=100.0, end_ts=100.95, seed="s")
    times = []
    while (ts := schedule.take()) is not None:
        times.append(ts)
    assert times == pytest.approx([100.1 + 0.1 * i for i in range(9)]) and schedule.taken == 9
    assert schedule.take() is None  # over for good: bounded by the stage's end
    # sessions started by a time: the tickets taken whose intended time has come
    assert [schedule.started_by(t) for t in (100.0, 100.1, 100.55, 101.0)] == [0, 1, 5, 9]


def test_sessions_started_count_the_tickets_due_not_those_users_hold_for_later() -> None:
    """A user holding the next session's ticket waits for its time: not started yet. The live capacity search reads
    this count, so sessions whose first answers are still on their way are counted (k3load.loadgen.search_live)."""
    schedules = Schedules(1, "run")
    assert schedules.started_by("open", 1e12) is None  # no user asked yet: nothing known here
    schedule = schedules.of("open", Arrival(10.0, "constant"), 0.0, 10.0)
    held = [schedule.take() for _ in range(30)]  # 30 tickets taken: 0.1 s to 3.0 s
    assert held[-1] == pytest.approx(3.0)
    assert schedules.started_by("open", 1.05) == 10 and schedules.started_by("open", 5.0) == 30


def test_the_same_seed_gives_the_same_arrivals_and_one_schedule_per_stage() -> None:
    one, two = Schedules(3), Schedules(3)
    a = one.of("steady", Arrival(2.0), 0.0, 60.0)
    assert one.of("steady", Arrival(99.0), 5.0, 1.0) is a  # made once, when the stage's first user asked
    b = two.of("steady", Arrival(2.0), 0.0, 60.0)
    assert [a.take() for _ in range(20)] == [b.take() for _ in range(20)]


@settings(max_examples=100, deadline=None)
@given(st.floats(0.01, 1000), st.sampled_from(["poisson", "constant", "gamma"]), st.floats(0.05, 20),
       st.floats(0.1, 30))
def test_a_schedule_is_bounded_by_its_rate_and_duration(rate: float, process: str, k: float, duration: float) -> None:
    schedule = ArrivalSchedule(Arrival(rate, process, k), 0.0, duration, "x")
    count, last = 0, 0.0
    while (ts := schedule.take()) is not None:
        count, last = count + 1, ts
        assert count < 100_000
    assert last < duration and schedule.take() is None


def test_a_turn_after_a_tool_call_waits_for_the_longest_of_its_tools() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "agent_parallel_weather.yaml")
    calls = next(i for i, t in enumerate(scenario.turns) if len(called_tools(scenario, i)) > 1)
    rng = random.Random(1)
    gaps = [gap_before(scenario, calls + 1, rng) for _ in range(2000)]
    single = [DEFAULT_TOOL_TIME.draw(random.Random(i)) for i in range(2000)]
    assert statistics.median(gaps) > statistics.median(single)  # the max of several draws
    assert max(gaps) <= DEFAULT_TOOL_TIME.max_s and gap_before(scenario, 0, rng) == 0.0


def test_a_declared_tool_time_and_user_think_are_used(tmp_path: Path) -> None:
    text = (ROOT / "scenarios" / "agent_weather_trip.yaml").read_text()
    text = text.replace("  uber.ride:\n    default:", "  uber.ride:\n    time_s: {median_s: 7, sigma: 0}\n    default:")
    text += "user_think_s: {median_s: 0.25, sigma: 0}\n"
    path = tmp_path / "timed.yaml"
    path.write_text(text)
    scenario = load_scenario(path)
    rng = random.Random(0)
    ride = next(i for i in range(len(scenario.turns)) if called_tools(scenario, i) == ["uber.ride"])
    assert gap_before(scenario, ride + 1, rng) == 7.0
    after_answer = next(i for i in range(1, len(scenario.turns)) if not called_tools(scenario, i - 1))
    assert gap_before(scenario, after_answer, rng) == 0.25
    default = load_scenario(ROOT / "scenarios" / "agent_weather_trip.yaml")
    draws = [gap_before(default, after_answer, rng) for _ in range(2000)]
    assert statistics.median(draws) == pytest.approx(DEFAULT_USER_THINK.median_s, rel=0.1)


def test_a_duration_is_capped_and_never_negative() -> None:
    rng = random.Random(2)
    draws = [Duration(2.0, 3.0, 5.0).draw(rng) for _ in range(2000)]
    assert min(draws) >= 0 and max(draws) == 5.0
    assert Duration.of(None, DEFAULT_USER_THINK) is DEFAULT_USER_THINK
