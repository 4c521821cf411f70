"""The capacity search as it runs: the live evidence of each step and the steps themselves.

    LiveGoodput  per stage, the requests (chains of attempts) and how many met every SLO, counted as each
                 record is written on the master/local process (k3load.loadgen.session.write_record_line: a
                 worker's records arrive there as they end, so distributed runs count the same). Drill
                 attempts and `client_raised` ones are left out, as the analysis leaves them out
                 (k3load.analysis.pillars.headroom.goodput: the same `attempt_good`, so the live search and the report
                 agree on
                 what a good request is). Memory: counts per stage, and only the chains still retrying.
    Scrapes      the sampler's scrapes as metrics.jsonl.gz grows (k3load.loadgen.tail.Tail): per source the
                 running and waiting gauges, KV usage and the preemption counter since a step began.
    LiveSearch   one `kind: search` plan stage: builds each step's Stage (NAME-sK-cUSERS, kind search), asks
                 the controller (k3load.loadgen.search) once per shape tick, and writes `search_step` and
                 `search_end` (k3load.events). The shape (k3load.loadgen.shape) only enters the step it returns.

Nothing here imports Locust: tests drive it with record lines, a scrape file and a clock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from k3load.analysis.pillars.headroom.arrival_lag import LATE_S
from k3load.analysis.pillars.headroom.full_batch import RUNNING, WAITING, BatchQueue, EngineCap, batch_queue, engine_cap
from k3load.analysis.pillars.headroom.goodput import STATUS_CLIENT_RAISED, Slo, attempt_good
from k3load.analysis.run.timeline import MetricIndex
from k3load.clock import now
from k3load.events import Event
from k3load.evidence import METRICS, SeriesTable
from k3load.loadgen.search import ResourceLimits, SearchController, StepEvidence, StepResult, past_capacity
from k3load.loadgen.tail import Tail
from k3load.rundir import JsonlLog
from k3load.sampler.prom import split_key
from k3load.sampler.vllm_metrics import VllmMetric
from k3load.workload.plan import ArrivalSpec, Stage

KV = VllmMetric.KV_CACHE_USAGE
PREEMPTIONS = VllmMetric.NUM_PREEMPTIONS_TOTAL


@dataclass
class StageCount:
    requests: int = 0
    good: int = 0
    scheduled: int = 0  # open-loop turns with an intended time (analysis/pillars/headroom/arrival_lag.py)
    late: int = 0  # of them, sent more than LATE_S after it
    arrived: int = 0  # open-loop sessions started (their first turn's first attempt)


STAGES_KEPT = 2  # a stage's records still arrive while the next one's begin (turns finishing at its end)


class LiveGoodput:
    """Requests and good requests per stage, from record lines as they are written."""

    def __init__(self, slo: Slo) -> None:
        self.slo = slo
        self.stages: dict[str, StageCount] = {}
        self._retrying_bad: set[tuple[str, str]] = set()  # (stage, chain) whose earlier attempt missed the SLO
        self._recent: list[str] = []  # the last STAGES_KEPT stages records came from, the newest last

    def add(self, line: str) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if not isinstance(record, dict):
            return
        stage, chain = str(record.get("stage")), str(record.get("chain_id"))
        intended, sent = record.get("intended_send_ts"), record.get("send_ts")
        lag = sent - intended if isinstance(intended, (int, float)) and isinstance(sent, (int, float)) else None
        if lag is not None and record.get("turn") == 0 and record.get("attempt") == 1 and \
                record.get("stream_role") != "whole":  # a session started (a drill's too; its twin is the same one)
            self.stages.setdefault(stage, StageCount()).arrived += 1
        if record.get("drill"):
            return
        key, retrying = (stage, chain), bool(record.get("will_retry"))
        self._note_stage(stage)
        if lag is not None:
            count = self.stages.setdefault(stage, StageCount())
            count.scheduled += 1
            count.late += int(lag > LATE_S)
        if record.get("status") == STATUS_CLIENT_RAISED:  # nothing known of the answer: not counted
            if not retrying and key in self._retrying_bad:
                self._retrying_bad.discard(key)
                self.stages.setdefault(stage, StageCount()).requests += 1  # its earlier attempts count, bad
            return
        good = attempt_good(self.slo, str(record.get("status")), bool(record.get("valid")), record.get("ttft_ms"),
                            record.get("ttfa_ms"), record.get("itl_mean_ms"), record.get("e2e_ms"))
        if retrying:
            if not good:
                self._retrying_bad.add(key)
            return
        count = self.stages.setdefault(stage, StageCount())
        count.requests += 1
        count.good += int(good and key not in self._retrying_bad)
        self._retrying_bad.discard(key)

    def of(self, stage: str) -> StageCount:
        return self.stages.get(stage, StageCount())

    def _note_stage(self, stage: str) -> None:
        """A retry chain's last attempt comes in its stage or, cut at the stage's end, never: once records come
        from a stage two changes later, the older stages' unfinished chains are dropped, so a day of stages
        (search steps, recovery holds, manual stages) keeps no chain that will never end."""
        if self._recent and self._recent[-1] == stage:
            return
        if stage in self._recent:
            self._recent.remove(stage)
        self._recent.append(stage)
        if len(self._recent) > STAGES_KEPT:
            del self._recent[:-STAGES_KEPT]
            self._retrying_bad = {key for key in self._retrying_bad if key[0] in self._recent}


def _sum(samples: dict[str, float], name: str) -> float | None:
    values = [v for k, v in samples.items() if v is not None and split_key(k)[0] == name]
    return float(sum(values)) if values else None


def _max(samples: dict[str, float], name: str) -> float | None:
    values = [v for k, v in samples.items() if v is not None and split_key(k)[0] == name]
    return float(max(values)) if values else None


@dataclass
class SourcePoints:
    """One metrics source's readings since the window began."""

    running: list[tuple[float, float]] = field(default_factory=list)
    waiting: list[tuple[float, float]] = field(default_factory=list)
    kv_max: float | None = None
    preempt_first: float | None = None
    preempt_last: float | None = None


class Scrapes:
    """The sampler's scrapes since `begin(ts)`, read as metrics.jsonl.gz grows."""

    def __init__(self, run_dir: Path) -> None:
        self.tail = Tail(run_dir, METRICS, SeriesTable())
        self.since = float("inf")
        self.sources: dict[str, SourcePoints] = {}

    def begin(self, ts: float) -> None:
        self.read()  # what came before belongs to the last step
        self.since, self.sources = ts, {}

    def read(self) -> None:
        for line in self.tail.lines(since=self.since):  # the scrapes before the step read past, never kept
            ts = line.get("ts")
            if not line.get("ok") or not isinstance(ts, (int, float)) or ts < self.since:
                continue
            self._add(str(line.get("source")), float(ts), line.get("samples") or {})

    def _add(self, source: str, ts: float, samples: dict[str, float]) -> None:
        points = self.sources.setdefault(source, SourcePoints())
        running, waiting, kv = _sum(samples, RUNNING), _sum(samples, WAITING), _max(samples, KV)
        if running is not None:
            points.running.append((ts, running))
        if waiting is not None:
            points.waiting.append((ts, waiting))
        if kv is not None:
            points.kv_max = kv if points.kv_max is None else max(points.kv_max, kv)
        preempted = _sum(samples, PREEMPTIONS)
        if preempted is not None:
            points.preempt_first = preempted if points.preempt_first is None else points.preempt_first
            points.preempt_last = preempted

    def queue(self, cap: EngineCap | None, users: int) -> BatchQueue | None:
        """The worst source's queue behind a full batch (as
        k3load.analysis.pillars.headroom.full_batch.stage_batch_queue)."""
        readings = [batch_queue(p.running, p.waiting, cap, users) for p in self.sources.values()]
        readings = [r for r in readings if r.scrapes]
        return max(readings, key=lambda r: (r.past_capacity, r.share or 0.0, r.scrapes)) if readings else None

    def waiting_sustained_s(self) -> float | None:
        """The longest stretch requests waited behind running ones, worst source (as the analysis's
        MetricIndex.sustained_queue_s: a waiting request with none running is no queue)."""
        values = []
        for p in self.sources.values():
            running = dict(p.running)
            waiting = [(ts, w if running.get(ts, 0) > 0 else 0) for ts, w in p.waiting] if running else p.waiting
            values.append(MetricIndex.sustained(waiting))
        known = [v for v in values if v is not None]
        return max(known) if known else None

    def kv_usage_max(self) -> float | None:
        values = [p.kv_max for p in self.sources.values() if p.kv_max is not None]
        return max(values) if values else None

    def preemptions(self) -> float | None:
        """Preemptions counted in the window, over the sources (a counter reset reads as none)."""
        deltas = [max(p.preempt_last - p.preempt_first, 0.0) for p in self.sources.values()
                  if p.preempt_first is not None and p.preempt_last is not None]
        return sum(deltas) if deltas else None


def step_name(search: Stage, step: int, users: int, sessions_per_s: float | None = None) -> str:
    """NAME-sK-cUSERS, or on a rate search NAME-sK-rRATE (the rate's point a `p`: 1.5/s is r1p5)."""
    if sessions_per_s is not None:
        return f"{search.name}-s{step}-r{f'{sessions_per_s:.4g}'.replace('.', 'p')}"
    return f"{search.name}-s{step}-c{users}"


class LiveSearch:
    """One search stage as it runs; `step_now()` once per shape tick gives the step to run, None once ended."""

    def __init__(self, stage: Stage, goodput: LiveGoodput, scrapes: Scrapes, events: JsonlLog | None,
                 limits: ResourceLimits, cap: EngineCap | None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = now,
                 started: Callable[[str], int | None] | None = None,
                 flush: Callable[[bool], None] | None = None) -> None:
        assert stage.search is not None
        self.stage, self.goodput, self.scrapes, self.events = stage, goodput, scrapes, events
        # sessions a step's schedule has started, where this process runs the users
        # (k3load.loadgen.arrivals.Schedules.started_by); None: counted from the records
        self.sessions_started = started
        # the sampler's scrapes so far into the file before each reading (Sampler.flush), a scrape under way
        # waited for (True) once the step may be decided: a decision sees the scrapes the analysis will judge
        # the step on
        self.flush = flush
        self.cap, self.clock, self.wall = cap, clock, wall
        self.controller = SearchController(stage.search, limits)
        self.started = clock()
        self.step: Stage | None = None
        self.step_started = self.started
        self.last: StepResult | None = None  # the last decided step
        self.evidence = StepEvidence()  # the running step's, as last read
        self.entered = False  # the running step's users were asked for (its clock runs from then)
        self.end_said = False

    @classmethod
    def for_run(cls, stage: Stage, run_dir: Path, events: JsonlLog | None, limits: dict[str, dict[str, float]],
                goodput: LiveGoodput, started: Callable[[str], int | None] | None = None,
                flush: Callable[[bool], None] | None = None) -> LiveSearch:
        """A search of the run in `run_dir`: its scrapes, the plan's resource limits, the engine's batch cap where
        the start-up log the precheck saved says it (else the most the engine ran at once in the step)."""
        return cls(stage, goodput, Scrapes(run_dir), events, ResourceLimits.from_limits(limits), engine_cap(run_dir),
                   started=started, flush=flush)

    def step_now(self) -> Stage | None:
        """The step to run now: the running one until it is decided, then the next; None once the search ended
        (search_end written once)."""
        if self.step is not None and self.entered and self.controller.ended is None:
            result = self.controller.observe(self._read(), self.clock() - self.step_started,
                                             self.clock() - self.started)
            if result is not None:
                self._say_step(result)
        if self.controller.ended is not None:
            self._say_end()
            return None
        users, rate = self.controller.users, self.controller.sessions_per_s
        if self.step is None or self.step.step != self.controller.step:
            assert users is not None
            spec = self.stage.search
            arrival = (ArrivalSpec(rate, spec.arrival_process, spec.burstiness) if spec is not None and rate is not None
                       else None)  # a rate search's step: sessions arriving open-loop at its rate
            self.step = replace(self.stage, name=step_name(self.stage, self.controller.step, users, rate), users=users,
                                step=self.controller.step, arrival=arrival,
                                duration_s=spec.max_step_s if spec else 0.0)
            self.step_started, self.evidence, self.entered = self.clock(), StepEvidence(), False
        return self.step

    def enter(self, step: Stage) -> None:
        """The shape entered `step` (its users asked for, the stage announced): its clock and its scrapes start
        now, not while the last stage's users were leaving or the server drained; so does the search's own."""
        if self.step is None or step.name != self.step.name or self.entered:
            return
        if not self.controller.results and not self.controller.repeating:
            self.started = self.clock()
        self.step_started, self.evidence, self.entered = self.clock(), StepEvidence(), True
        self.scrapes.begin(self.wall())

    def stop(self, why: str = "stopped") -> None:
        """The run stopped during the search (`stopped`), or the plan moved past its reservation
        (`max_total_s`): said once, with the bracket it had."""
        self.controller.stop(why)
        self._say_end()

    def _read(self) -> StepEvidence:
        assert self.step is not None
        if self.flush is not None:
            spec = self.step.search
            self.flush(spec is None or self.clock() - self.step_started >= spec.step_s)  # decidable (decide_step)
        self.scrapes.read()
        count = self.goodput.of(self.step.name)
        elapsed = self.clock() - self.step_started
        rate = self.step.arrival.sessions_per_s if self.step.arrival is not None else 0.0
        self.evidence = StepEvidence(requests=count.requests, good=count.good, scheduled=count.scheduled,
                                     late=count.late, arrived=self._arrived(count.arrived), offered=rate * elapsed,
                                     queue=self.scrapes.queue(self.cap, self.step.users),
                                     kv_usage_max=self.scrapes.kv_usage_max(), preemptions=self.scrapes.preemptions(),
                                     duration_s=self.clock() - self.step_started,
                                     waiting_sustained_s=self.scrapes.waiting_sustained_s())
        return self.evidence

    def _arrived(self, recorded: int) -> int:
        """Sessions the step started: by its schedule where this process runs the users (a session counts from
        its first send, as the analysis counts it from the records the step's sessions leave), else by the
        first answers recorded so far (a master with workers: those still on their way are not counted yet)."""
        assert self.step is not None
        started = self.sessions_started(self.step.name) if self.sessions_started else None
        return recorded if started is None else max(recorded, started)

    def _say_step(self, result: StepResult) -> None:
        self.last = result
        assert self.step is not None
        if self.events is not None:
            self.events.event(Event.SEARCH_STEP, **step_fields(self.step.name, self.stage.name, result, self.evidence,
                                                               self.controller.limits))

    def _say_end(self) -> None:
        if self.end_said:
            return
        self.end_said = True
        c = self.controller
        if self.events is not None:
            rate = c.spec.on_rate
            self.events.event(Event.SEARCH_END, stage=self.stage.name, ended=c.ended, steps=len(c.results),
                              largest_held_users=None if rate else c.last_good,
                              first_failed_users=None if rate else c.first_bad,
                              largest_held_sessions_per_s=c.last_good if rate else None,
                              first_failed_sessions_per_s=c.first_bad if rate else None)

    def snapshot(self) -> dict[str, Any]:
        """For the web UI: the step, its evidence so far, the bracket, the last decision."""
        c, e = self.controller, self.evidence
        rate = e.goodput
        return {"stage": self.stage.name, "step": self.step.name if self.step else None,
                "step_index": c.step if c.ended is None else None, "users": c.users,
                "sessions_per_s": c.sessions_per_s, "search_on": c.spec.search_on,
                "repeat": c.repeating, "elapsed_s": round(self.clock() - self.step_started, 1),
                "step_s": self.stage.search.step_s if self.stage.search else None,
                "max_step_s": self.stage.search.max_step_s if self.stage.search else None,
                "min_goodput": self.stage.search.min_goodput if self.stage.search else None,
                "requests": e.requests, "goodput": rate.value,
                "goodput_ci95": [rate.low, rate.high] if e.requests else None,
                "queue_share": e.queue.share if e.queue else None, "kv_usage_max": e.kv_usage_max,
                "last_good": c.last_good, "first_bad": c.first_bad, "ended": c.ended,
                "last_decision": ({"users": self.last.users, "sessions_per_s": self.last.sessions_per_s,
                                   "decision": self.last.decision}
                                  if self.last else None),
                "total_s": round(self.clock() - self.started, 1),
                "max_total_s": self.stage.search.max_total_s if self.stage.search else None}


def step_fields(step: str, search: str, result: StepResult, own: StepEvidence,
                limits: ResourceLimits) -> dict[str, Any]:
    """The `search_step` event's fields: the decision's evidence (combined for a repeat), this run's duration."""
    e = result.evidence
    rate = e.goodput
    return {"stage": step, "search": search, "users": result.users, "sessions_per_s": result.sessions_per_s,
            "step": result.step,
            "goodput": round(rate.value, 6) if rate.value is not None else None,
            "goodput_ci95": [round(rate.low, 6), round(rate.high, 6)] if e.requests else None,
            "requests": e.requests, "queue_share": round(e.queue.share, 4) if e.queue and e.queue.share is not None
            else None, "past_capacity": past_capacity(e, limits), "kv_usage_max": e.kv_usage_max,
            "decision": result.decision, "duration_s": round(own.duration_s, 3),
            # the rest of what past_capacity read, so a step the judgment holds otherwise shows why it differed
            "waiting_sustained_s": e.waiting_sustained_s, "preemptions_per_min": e.preemptions_per_min,
            "scheduled": e.scheduled, "late": e.late, "arrived": e.arrived, "offered": round(e.offered, 3)}
