"""The capacity search's controller: given each step's evidence, the next number of users, or the end.

Why a pure class: the search is a decision procedure over noisy evidence, and its answer must be
repeatable; kept apart from Locust (k3load.loadgen.search_live feeds it, k3load.loadgen.shape runs its
steps) it is tested step by step with made-up evidence, seeded noise included (tests/unit/test_search.py).

The procedure (issue 27, item 3), on `search_on: users` (on `sessions_per_s` the same over the arrival rate,
from start_sessions_per_s to max_sessions_per_s, each step an open-loop stage with max_users session slots,
the bracket halved until within `resolution`; `max_rate_held`):
    grow     from start_users, each held step times `factor` (rounded up, at least one more), up to
             max_users; a held step of max_users ends it (`max_users_held`);
    bisect   after the first failed step, between the largest held and the smallest failed, until they
             are at most `resolution` x the held apart, and at least one user (`resolved`); a failed
             first step bisects down towards 0 (`nothing_held` when 1 user fails);
    repeat   a step still undecided at max_step_s (its goodput interval straddles min_goodput) is
             `near_bound`: run once more and decided on both runs' evidence together; still straddling
             then, the point estimate decides (the evidence is what it is, and the search must go on);
    bound    max_total_s over the whole search (`max_total_s`: the bracket it had is the answer), or
             the run stopped (`stopped`).

A step is decided only after it ran step_s. It fails (`past_capacity`) when requests waited behind a full
batch for most of it (k3load.analysis.pillars.headroom.full_batch, the analysis's own reading), or its KV usage went
above
resources.max_kv_usage, or it preempted more than resources.max_preemptions_per_min; it fails
(`below_goodput`) when its goodput interval's high end is below min_goodput; it holds when the interval's
low end is at or above min_goodput and none of the failures showed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from k3load.analysis.pillars.headroom.arrival_lag import offered_late, offered_short
from k3load.analysis.pillars.headroom.full_batch import BatchQueue
from k3load.analysis.run.stats import Rate, wilson
from k3load.workload.plan import SearchSpec

HELD, PAST_CAPACITY, BELOW_GOODPUT, NEAR_BOUND = "held", "past_capacity", "below_goodput", "near_bound"
ENDS = ("resolved", "max_users_held", "max_rate_held", "max_total_s", "nothing_held", "stopped")


@dataclass(frozen=True)
class ResourceLimits:
    """The plan's resource limits a step is held to (thresholds.resources)."""

    max_kv_usage: float = 0.98
    max_preemptions_per_min: float = 5.0
    max_waiting_sustained_s: float = 10.0

    @classmethod
    def from_limits(cls, limits: dict[str, dict[str, float]]) -> ResourceLimits:
        resources = limits.get("resources", {})
        return cls(max_kv_usage=float(resources.get("max_kv_usage", 0.98)),
                   max_preemptions_per_min=float(resources.get("max_preemptions_per_min", 5.0)),
                   max_waiting_sustained_s=float(resources.get("max_waiting_sustained_s", 10.0)))


@dataclass(frozen=True)
class StepEvidence:
    """One step's evidence so far: its requests (chains) and how many met every SLO, the queue behind a full
    batch over its scrapes (None: no scrape with both gauges), the worst KV usage, the preemptions counted,
    and how long it ran."""

    requests: int = 0
    good: int = 0
    queue: BatchQueue | None = None
    kv_usage_max: float | None = None
    preemptions: float | None = None
    duration_s: float = 0.0
    # the longest stretch requests waited behind running ones (the analysis's resources.waiting_sustained)
    waiting_sustained_s: float | None = None
    # an open-loop step's turns with an intended time, and how many went out late (every session slot busy)
    scheduled: int = 0
    late: int = 0
    arrived: int = 0  # sessions that started (their first turn sent)
    offered: float = 0.0  # the step's rate times its seconds (0: closed-loop)

    @property
    def goodput(self) -> Rate:
        return wilson(self.good, self.requests)

    @property
    def preemptions_per_min(self) -> float | None:
        if self.preemptions is None or self.duration_s <= 0:
            return None
        return self.preemptions / (self.duration_s / 60.0)

    def plus(self, other: StepEvidence) -> StepEvidence:
        """Two runs of the same step as one body of evidence (a near-bound step and its repeat)."""
        return StepEvidence(requests=self.requests + other.requests, good=self.good + other.good,
                            queue=_queues(self.queue, other.queue), kv_usage_max=_most(self.kv_usage_max,
                                                                                        other.kv_usage_max),
                            preemptions=_total(self.preemptions, other.preemptions),
                            duration_s=self.duration_s + other.duration_s,
                            waiting_sustained_s=_most(self.waiting_sustained_s, other.waiting_sustained_s),
                            scheduled=self.scheduled + other.scheduled, late=self.late + other.late,
                            arrived=self.arrived + other.arrived, offered=self.offered + other.offered)


def _queues(a: BatchQueue | None, b: BatchQueue | None) -> BatchQueue | None:
    if a is None or b is None:
        return a or b
    return BatchQueue(a.scrapes + b.scrapes, a.queued + b.queued, a.cap or b.cap, a.cap_from or b.cap_from)


def _most(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _total(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


def past_capacity(evidence: StepEvidence, limits: ResourceLimits) -> bool:
    """Requests queued behind a full batch for most of the step, KV above its limit, preemptions above theirs, or
    requests waiting longer on end than the plan allows, or (open-loop) the rate offered late: the rules the
    analysis holds each step to (analysis/pillars/headroom/stages.py), so the search and the judgment agree on which
    steps held."""
    queued = evidence.queue is not None and evidence.queue.past_capacity
    kv = evidence.kv_usage_max is not None and evidence.kv_usage_max > limits.max_kv_usage
    rate = evidence.preemptions_per_min
    waited = evidence.waiting_sustained_s is not None and evidence.waiting_sustained_s > limits.max_waiting_sustained_s
    short = evidence.offered > 0 and offered_short(evidence.offered, evidence.arrived)
    return queued or kv or waited or short or offered_late(evidence.scheduled, evidence.late) or \
        (rate is not None and rate > limits.max_preemptions_per_min)


def decide_step(evidence: StepEvidence, spec: SearchSpec, limits: ResourceLimits, elapsed_s: float,
                repeat: bool) -> str | None:
    """The step's decision now, or None to keep it running. `evidence` is the repeat's combined evidence when
    `repeat`; `elapsed_s` is how long this run of the step has gone."""
    if elapsed_s < spec.step_s:
        return None
    if past_capacity(evidence, limits):
        return PAST_CAPACITY
    rate = evidence.goodput
    if evidence.requests and rate.high < spec.min_goodput:
        return BELOW_GOODPUT
    if evidence.requests and rate.low >= spec.min_goodput:
        return HELD
    if elapsed_s < spec.max_step_s:
        return None
    if not repeat:
        return NEAR_BOUND
    return HELD if rate.value is not None and rate.value >= spec.min_goodput else BELOW_GOODPUT


@dataclass(frozen=True)
class StepResult:
    """One decided step (a repeat is its own step, its evidence the combined one). `users`: the step's users
    (a rate search's: its session slots); `sessions_per_s`: a rate search's rate, else None."""

    step: int
    users: int
    decision: str
    evidence: StepEvidence
    sessions_per_s: float | None = None


@dataclass
class SearchController:
    """Drives one search stage: `load` is the step to run now (users, or sessions/s on a rate search; None once
    ended); `observe` looks at it."""

    spec: SearchSpec
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    load: float | None = None
    step: int = 1
    last_good: float | None = None
    first_bad: float | None = None
    ended: str | None = None
    results: list[StepResult] = field(default_factory=list)
    _first_try: StepEvidence | None = None  # a near-bound step being repeated: its first run's evidence

    def __post_init__(self) -> None:
        spec = self.spec
        self.load = (min(spec.start_sessions_per_s, spec.max_sessions_per_s) if spec.on_rate
                     else min(spec.start_users, spec.max_users))

    @property
    def users(self) -> int | None:
        """The running step's users: its load on a users search, the session slots (max_users) on a rate search."""
        if self.load is None:
            return None
        return self.spec.max_users if self.spec.on_rate else int(self.load)

    @property
    def sessions_per_s(self) -> float | None:
        return self.load if self.spec.on_rate else None

    @property
    def repeating(self) -> bool:
        return self._first_try is not None

    def observe(self, evidence: StepEvidence, step_elapsed_s: float, total_elapsed_s: float) -> StepResult | None:
        """One look at the running step (its own evidence so far): its result once decided (the controller
        then moves on to the next step, or ends), else None. Past max_total_s the search ends undecided."""
        users = self.users
        if self.ended is not None or users is None:
            return None
        combined = evidence if self._first_try is None else self._first_try.plus(evidence)
        decision = decide_step(combined, self.spec, self.limits, step_elapsed_s, self.repeating)
        if decision is None:
            if total_elapsed_s >= self.spec.max_total_s:
                self._end("max_total_s")
            return None
        result = StepResult(self.step, users, decision, combined, self.sessions_per_s)
        self.results.append(result)
        self._advance(decision, evidence)
        if self.ended is None and total_elapsed_s + self.spec.step_s > self.spec.max_total_s:
            self._end("max_total_s")  # no room left for another step's minimum
        return result

    def stop(self, why: str = "stopped") -> None:
        """The run stopped (or failed) during the search (`stopped`), or the plan's clock passed its reservation
        (`max_total_s`)."""
        if self.ended is None:
            self._end(why)

    def _advance(self, decision: str, evidence: StepEvidence) -> None:
        load = self.load
        assert load is not None
        self.step += 1
        if decision == NEAR_BOUND:
            self._first_try = evidence
            return
        self._first_try = None
        if decision == HELD:
            self.last_good = load if self.last_good is None else max(self.last_good, load)
        else:
            self.first_bad = load if self.first_bad is None else min(self.first_bad, load)
        self.load = self._next_rate(load) if self.spec.on_rate else self._next(int(load))

    def _next(self, users: int) -> int | None:
        spec = self.spec
        if self.first_bad is None:
            if users >= spec.max_users:
                self._end("max_users_held")
                return None
            return min(spec.max_users, max(math.ceil(users * spec.factor), users + 1))
        low = int(self.last_good or 0)
        if self.first_bad - low <= 1:
            self._end("resolved" if self.last_good else "nothing_held")
            return None
        if self.last_good and self.first_bad - low <= spec.resolution * low:
            self._end("resolved")
            return None
        return (low + int(self.first_bad)) // 2

    def _next_rate(self, rate: float) -> float | None:
        """A rate search: grow by `factor` up to max_sessions_per_s, then halve the bracket until it is within
        `resolution` of the largest rate held; a failed first rate halves down to `resolution` of itself."""
        spec = self.spec
        if self.first_bad is None:
            if rate >= spec.max_sessions_per_s:
                self._end("max_rate_held")
                return None
            return min(spec.max_sessions_per_s, rate * spec.factor)
        low = self.last_good or 0.0
        if low and self.first_bad - low <= spec.resolution * low:
            self._end("resolved")
            return None
        if not low and self.first_bad <= spec.resolution * spec.start_sessions_per_s:
            self._end("nothing_held")
            return None
        return round((low + self.first_bad) / 2, 6)

    def _end(self, why: str) -> None:
        self.ended, self.load, self._first_try = why, None, None

