"""Sessions arriving open-loop: a stage's `arrival` as a schedule of intended start times.

Why open-loop: closed-loop users send their next request when the last one ends, so a slow server is
offered less load and a queue hides behind users who simply wait (coordinated omission). Here agent
sessions arrive at the plan's rate whatever the server does: a Poisson process (exponential gaps), a
constant one, or gamma gaps whose shape is the burstiness (below 1 burstier than Poisson, above 1
steadier; vLLM's `bench serve --burstiness`). Each session is then a closed-loop conversation with its
agent's gaps between turns (k3load.workload.think_time).

The stage's `users` is the most sessions in flight at once (the generator's bound). A session whose
time has come while every slot is busy starts late: its records keep the intended time beside the
actual send (`intended_send_ts`), so a saturated generator shows in the evidence instead of lowering the
offered load unseen. One schedule per stage per process, shared by that process's users; seeded, so a
run's arrival times repeat.
"""

from __future__ import annotations

import random
from array import array
from bisect import bisect_right

from k3load.workload.plan import ArrivalSpec


def gap_s(arrival: ArrivalSpec, rng: random.Random) -> float:
    """The time to the next arrival: mean 1/rate for every process."""
    mean = 1.0 / arrival.sessions_per_s
    if arrival.process == "constant":
        return mean
    if arrival.process == "gamma":
        return rng.gammavariate(arrival.burstiness, mean / arrival.burstiness)
    return rng.expovariate(arrival.sessions_per_s)


class ArrivalSchedule:
    """The intended start times of one stage's sessions in this process, taken in order by free users."""

    def __init__(self, arrival: ArrivalSpec, start_ts: float, end_ts: float, seed: str) -> None:
        self.arrival, self.end_ts = arrival, end_ts
        self._rng = random.Random(seed)
        self._next = start_ts + gap_s(arrival, self._rng)
        self.taken = 0
        self._times = array("d")  # every taken ticket's time, in order (8 bytes each: the stage's rate x its length)

    def take(self) -> float | None:
        """The next session's intended start (epoch seconds; it may be past: the session is late), or None
        when the stage's arrivals are over."""
        if self._next >= self.end_ts:
            return None
        ts = self._next
        self._next += gap_s(self.arrival, self._rng)
        self.taken += 1
        self._times.append(ts)
        return ts

    def started_by(self, ts: float) -> int:
        """Sessions started by `ts`: tickets taken whose intended time has come (a user holding a later one is still
        waiting for it; one taken late went out at once). What the records will say once every session's first
        turn has ended: the live capacity search counts arrivals here, not from records that come when an answer
        ends, so a step is not called short by the sessions whose first answers are still on their way."""
        return bisect_right(self._times, ts)


class Schedules:
    """One schedule per stage, made when the stage's first user asks, from the stage's entry."""

    def __init__(self, seed: int | str, run_id: str = "") -> None:
        self.seed, self.run_id = seed, run_id  # one set per run: a second test of the same plan starts afresh
        self._by_stage: dict[str, ArrivalSchedule] = {}

    def started_by(self, stage_name: str, ts: float) -> int | None:
        """Sessions of the stage this process started by `ts`; None before its first user asked (no schedule)."""
        found = self._by_stage.get(stage_name)
        return None if found is None else found.started_by(ts)

    def of(self, stage_name: str, arrival: ArrivalSpec, start_ts: float, duration_s: float) -> ArrivalSchedule:
        found = self._by_stage.get(stage_name)
        if found is None:
            found = self._by_stage[stage_name] = ArrivalSchedule(arrival, start_ts, start_ts + duration_s,
                                                                 f"{self.seed}:{stage_name}:arrivals")
        return found
