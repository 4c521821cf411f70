"""The live side of the capacity search (k3load/loadgen/search_live.py): goodput counted from record lines as the
analysis counts it, the scrapes of a step, the steps a search stage runs and the events it writes, and what the
web UI shows of it. No sockets, no Locust: record lines, a metrics file and a clock."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from k3load.analysis.pillars.headroom.goodput import Slo
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
from k3load.events import FIELDS, Event
from k3load.loadgen.live import LiveState
from k3load.loadgen.manual import LiveCounts
from k3load.loadgen.search import ResourceLimits
from k3load.loadgen.search_live import LiveGoodput, LiveSearch, Scrapes
from k3load.loadgen.shape import same_search
from k3load.loadgen.webui import tab_rows
from k3load.rundir import JsonlLog
from k3load.workload.plan import parse_plan

SLO = Slo.from_limits(DEFAULT_THRESHOLDS)  # ttft 3000, ttfa 30000, itl 250, e2e 60000 ms


def record(chain: str, stage: str = "s", status: str = "ok", valid: bool = True, ttft_ms: float = 100.0,
           will_retry: bool = False, drill: bool = False) -> str:
    return json.dumps({"chain_id": chain, "stage": stage, "status": status, "valid": valid, "ttft_ms": ttft_ms,
                       "ttfa_ms": ttft_ms, "itl_mean_ms": 20.0, "e2e_ms": 900.0, "will_retry": will_retry,
                       "drill": drill})


def test_live_goodput_counts_requests_as_chains_and_leaves_drills_and_client_errors_out():
    goodput = LiveGoodput(SLO)
    for line in [record("a"), record("b", ttft_ms=5000),  # over the TTFT limit: a request that missed the SLO
                 record("c", valid=False), record("d", status="http_error"),
                 record("e", status="timeout", will_retry=True), record("e"),  # retried: kept its agent waiting
                 record("f", will_retry=True, status="timeout"), record("f", status="client_raised"),
                 record("g", status="client_raised"), record("h", drill=True), record("i", stage="t"), "not json"]:
        goodput.add(line)
    count = goodput.of("s")
    assert (count.requests, count.good) == (6, 1)  # a, b, c, d, e, f; only a met every SLO
    assert (goodput.of("t").requests, goodput.of("nowhere").requests) == (1, 0)


def test_live_goodput_keeps_no_retry_chain_of_a_stage_two_changes_back():
    """A chain cut at its stage's end never sends its last attempt: over a day of stages, such chains are
    dropped once records come from two stages later (a stage's last records still arrive beside the next's)."""
    goodput = LiveGoodput(SLO)
    for step in range(1000):
        goodput.add(record(f"c{step}", stage=f"find-s{step}", status="timeout", will_retry=True))
        goodput.add(record(f"d{step}", stage=f"find-s{step}"))
    assert len(goodput._retrying_bad) == 2  # the last two stages' unfinished chains
    goodput.add(record("c999", stage="find-s999"))  # a chain of the stage before still ends, counted as it was
    assert (goodput.of("find-s999").requests, goodput.of("find-s999").good) == (2, 1)
    goodput.add(record("c998", stage="find-s998", status="timeout", will_retry=True))
    goodput.add(record("c998", stage="find-s998"))  # the stage before the last: still kept, a missed request
    assert (goodput.of("find-s998").requests, goodput.of("find-s998").good) == (2, 1)


def scrape(ts: float, running: float, waiting: float, kv: float = 0.1, preempted: float = 0.0,
           source: str = "http://s/metrics") -> str:
    return json.dumps({"ts": ts, "source": source, "ok": True, "samples": {
        'vllm:num_requests_running{engine="0"}': running, 'vllm:num_requests_waiting{engine="0"}': waiting,
        'vllm:num_requests_waiting_by_reason{reason="capacity"}': 99.0,  # another series: never read as waiting
        'vllm:kv_cache_usage_perc{engine="0"}': kv, 'vllm:num_preemptions_total{engine="0"}': preempted}})


def test_scrapes_of_a_step_read_the_queue_behind_a_full_batch_kv_and_preemptions(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(scrape(1, 8, 5, kv=0.99, preempted=1) + "\n")  # before the step: not its evidence
    scrapes = Scrapes(tmp_path)
    scrapes.begin(2.0)
    with metrics.open("a") as handle:
        handle.write("\n".join([scrape(2, 8, 1, 0.3, 1), scrape(3, 8, 2, 0.4, 2), scrape(4, 7, 0, 0.2, 4),
                                scrape(5, 8, 1, 0.5, 4), json.dumps({"ts": 6, "source": "x", "ok": False})]) + "\n")
    scrapes.read()
    queue = scrapes.queue(None, users=9)  # no cap known: the most it ran at once (8), below the 9 users
    assert (queue.scrapes, queue.queued, queue.cap, queue.past_capacity) == (4, 3, 8, True)
    assert scrapes.kv_usage_max() == 0.5 and scrapes.preemptions() == 3.0
    assert scrapes.queue(None, users=8).past_capacity is False  # 8 users all ran: nothing capped them


class FakeScrapes:
    def __init__(self) -> None:
        self.queued = False
        self.began: list[float] = []

    def begin(self, ts: float) -> None:
        self.began.append(ts)

    def read(self) -> None:
        pass

    def queue(self, cap: Any, users: int) -> Any:
        from k3load.analysis.pillars.headroom.full_batch import BatchQueue
        return BatchQueue(10, 9 if users > 8 else 0, 8, "test")

    def kv_usage_max(self) -> float:
        return 0.2

    def preemptions(self) -> float:
        return 0.0

    def waiting_sustained_s(self) -> float:
        return 0.0


PLAN = parse_plan({"name": "p", "stages": [
    {"name": "find", "kind": "search", "start_users": 4, "max_users": 16, "min_goodput": 0.9, "step_s": 5,
     "max_step_s": 10, "max_total_s": 100, "mix": {"agent": 1}}]}, "p.yaml")


def test_a_live_search_runs_named_steps_on_its_own_clock_and_says_each_decision(tmp_path):
    clock = [0.0]
    goodput, events = LiveGoodput(SLO), JsonlLog(tmp_path / "events.jsonl")
    search = LiveSearch(PLAN.stages[0], goodput, FakeScrapes(), events, ResourceLimits(), None,
                        clock=lambda: clock[0], wall=lambda: 1000 + clock[0])  # type: ignore[arg-type]
    names = []
    for _ in range(200):  # one look a second, as the shape ticks
        step = search.step_now()
        if step is None:
            break
        if not search.entered:
            names.append(step.name)
            assert step.kind == "search" and step.search is PLAN.stages[0].search and step.users == int(
                step.name.rsplit("-c", 1)[1])
            search.enter(step)
        for i in range(40):  # 40 good requests a second
            goodput.add(record(f"{step.name}-{clock[0]}-{i}", stage=step.name))
        clock[0] += 1
    assert names == ["find-s1-c4", "find-s2-c8", "find-s3-c16", "find-s4-c12", "find-s5-c10", "find-s6-c9"]
    assert search.step_now() is None and search.end_said
    search.stop()  # the run's end after the search ended: nothing more said
    events.close()
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert all(set(e) - {"ts", "event"} == FIELDS[Event(e["event"])] for e in lines)
    steps = [e for e in lines if e["event"] == "search_step"]
    assert [(e["users"], e["decision"]) for e in steps] == [(4, "held"), (8, "held"), (16, "past_capacity"),
                                                            (12, "past_capacity"), (10, "past_capacity"),
                                                            (9, "past_capacity")]
    assert steps[0]["requests"] >= 200 and steps[0]["goodput"] == 1.0 and steps[0]["queue_share"] == 0.0
    assert lines[-1] == {**lines[-1], "event": "search_end", "stage": "find", "largest_held_users": 8,
                         "first_failed_users": 9, "ended": "resolved", "steps": 6}


def test_a_search_stopped_midway_says_so_with_its_bracket(tmp_path):
    events = JsonlLog(tmp_path / "events.jsonl")
    search = LiveSearch(PLAN.stages[0], LiveGoodput(SLO), FakeScrapes(), events, ResourceLimits(), None,
                        clock=lambda: 0.0)  # type: ignore[arg-type]
    search.enter(search.step_now())
    search.stop()
    search.stop()
    events.close()
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["ended"], e["largest_held_users"], e["steps"]) for e in lines] == [
        ("search_end", "stopped", None, 0)]


def test_steps_of_one_search_are_not_drained_between():
    plan = parse_plan({"name": "p", "stages": [
        {"name": "a", "kind": "search", "max_users": 8, "step_s": 1, "max_total_s": 10, "mix": {"agent": 1}},
        {"name": "b", "kind": "search", "max_users": 8, "step_s": 1, "max_total_s": 10, "mix": {"agent": 1}}]},
        "p.yaml")
    a, b = plan.stages
    from dataclasses import replace
    a1, a2, b1 = replace(a, step=1), replace(a, step=2), replace(b, step=1)
    assert same_search(a1, a2) and not same_search(a2, b1) and not same_search(a, a1) and not same_search(None, a1)


def test_the_web_ui_shows_the_search_and_each_stages_goodput(tmp_path):
    goodput = LiveGoodput(SLO)
    for i in range(50):
        goodput.add(record(f"c{i}", stage="find-s1-c4", ttft_ms=100.0 if i else 9000.0))
    search = LiveSearch(PLAN.stages[0], goodput, FakeScrapes(), None, ResourceLimits(), None,
                        clock=lambda: 0.0)  # type: ignore[arg-type]
    step = search.step_now()
    search.enter(step)
    search.step_now()
    runner = SimpleNamespace(state="running", user_count=4, stats=None, current_cpu_usage=1.0)
    session = SimpleNamespace(env=SimpleNamespace(runner=runner), run_id="r1", run_dir=tmp_path, stage=step,
                              stage_started=0.0, stage_name=step.name, finished=False, judgment=None,
                              live=LiveCounts(), fatal="", goodput=goodput, search=search)
    state = LiveState(session, judge=lambda run_dir: None).state()  # type: ignore[arg-type,return-value]
    assert state["stage"]["goodput"] == 0.98 and state["stage"]["goodput_requests"] == 50
    assert state["goodput"] == [{"stage": "find-s1-c4", "requests": 50, "good": 49, "goodput": 0.98,
                                 "goodput_ci95": state["stage"]["goodput_ci95"]}]
    assert state["search"]["step"] == "find-s1-c4" and state["search"]["users"] == 4
    assert state["search"]["requests"] == 50 and state["search"]["last_good"] is None
    rows = {r["signal"]: r["value"] for r in tab_rows(state)}
    assert rows["stage goodput"].startswith("98.0% (95% CI ") and rows["stage goodput"].endswith("of 50 requests")
    assert rows["search step"] == "find-s1-c4 (4 users, 0 s)"
    assert rows["search bracket (held / failed)"] == "– / – users"


def test_the_run_dir_of_a_search_is_its_scrapes(tmp_path: Path):
    search = LiveSearch.for_run(PLAN.stages[0], tmp_path, None, DEFAULT_THRESHOLDS, LiveGoodput(SLO))
    assert search.cap is None and search.controller.limits == ResourceLimits(0.98, 5.0)
    assert search.step_now().name == "find-s1-c4"


def test_a_rate_step_counts_the_sessions_its_schedule_started_not_only_the_answers_recorded(tmp_path):
    """A step with every first answer still on its way when it is decided started its sessions: counted from the
    schedule where this process runs the users, it is not short; from the records alone (a master with workers) the
    answers not yet recorded are not counted (the rule's conservative side)."""
    plan = parse_plan({"name": "p", "stages": [
        {"name": "rate", "kind": "search", "search_on": "sessions_per_s", "start_sessions_per_s": 4,
         "max_sessions_per_s": 8, "max_users": 32, "min_goodput": 0.5, "step_s": 5, "max_step_s": 10,
         "max_total_s": 300, "arrival_process": "constant", "mix": {"agent": 1}}]}, "p.yaml")

    class NoQueue(FakeScrapes):
        def queue(self, cap: Any, users: int) -> Any:
            from k3load.analysis.pillars.headroom.full_batch import BatchQueue
            return BatchQueue(10, 0, 8, "test")

    def first_step(started: Any) -> dict:
        clock = [0.0]
        goodput, events = LiveGoodput(SLO), JsonlLog(tmp_path / f"events-{started is None}.jsonl")
        search = LiveSearch(plan.stages[0], goodput, NoQueue(), events, ResourceLimits(), None,  # type: ignore[arg-type]
                            clock=lambda: clock[0], wall=lambda: 1000 + clock[0], started=started)
        step = search.step_now()
        search.enter(step)
        for i in range(8):  # eight answered sessions of the 20 the step offered in 5 s: the rest still answering
            line = json.loads(record(f"s{i}", stage=step.name))
            goodput.add(json.dumps(line | {"turn": 0, "attempt": 1, "intended_send_ts": 1000.0, "send_ts": 1000.1}))
        clock[0] = 5.0
        search.step_now()
        events.close()
        return next(json.loads(line) for line in events.path.read_text().splitlines()
                    if json.loads(line)["event"] == "search_step")

    asked: list[str] = []

    def started(stage: str) -> int:
        asked.append(stage)
        return 20  # the schedule started every session the rate offered

    by_schedule, by_records = first_step(started), first_step(None)
    assert asked and asked[-1] == "rate-s1-r4"
    assert (by_schedule["arrived"], by_schedule["decision"]) == (20, "held")
    assert (by_records["arrived"], by_records["decision"]) == (8, "past_capacity")


def test_live_arrivals_count_a_drills_first_turn_and_not_a_whole_twin_or_a_later_turn():
    """A session whose first turn is a drill started all the same (the judgment counts it: sessions_started); a
    stream pair's whole twin is the same session; a later turn or a retry starts none."""
    goodput = LiveGoodput(SLO)
    base = json.loads(record("a", stage="s"))
    for extra in ({"drill": True}, {}, {"stream_role": "whole"}, {"turn": 1}, {"attempt": 2},
                  {"intended_send_ts": None}):
        goodput.add(json.dumps(base | {"turn": 0, "attempt": 1, "intended_send_ts": 5.0, "send_ts": 5.1} | extra))
    assert goodput.of("s").arrived == 2


def test_a_rate_search_runs_open_loop_steps_named_by_their_rate(tmp_path):
    """search_on sessions_per_s: each step an open-loop stage (its `arrival` at the step's rate, max_users session
    slots), named NAME-sK-rRATE, the bracket in sessions/s in search_end."""
    plan = parse_plan({"name": "p", "stages": [
        {"name": "rate", "kind": "search", "search_on": "sessions_per_s", "start_sessions_per_s": 0.5,
         "max_sessions_per_s": 8, "max_users": 32, "min_goodput": 0.9, "step_s": 5, "max_step_s": 10,
         "max_total_s": 300, "arrival_process": "gamma", "burstiness": 2, "mix": {"agent": 1}}]}, "p.yaml")
    clock, now_rate = [0.0], [0.0]

    class RateScrapes(FakeScrapes):
        def queue(self, cap: Any, users: int) -> Any:
            from k3load.analysis.pillars.headroom.full_batch import BatchQueue
            return BatchQueue(10, 9 if now_rate[0] > 3.0 else 0, 8, "test")

    goodput, events = LiveGoodput(SLO), JsonlLog(tmp_path / "events.jsonl")
    search = LiveSearch(plan.stages[0], goodput, RateScrapes(), events, ResourceLimits(), None,
                        clock=lambda: clock[0], wall=lambda: 1000 + clock[0])  # type: ignore[arg-type]
    steps = []
    for _ in range(400):
        step = search.step_now()
        if step is None:
            break
        if not search.entered:
            assert step.users == 32 and step.arrival is not None and step.arrival.process == "gamma"
            assert step.arrival.burstiness == 2.0
            steps.append((step.name, step.arrival.sessions_per_s))
            now_rate[0] = step.arrival.sessions_per_s
            search.enter(step)
        for i in range(40):  # each a new session's first turn, sent on time
            line = json.loads(record(f"{step.name}-{clock[0]}-{i}", stage=step.name))
            goodput.add(json.dumps(line | {"turn": 0, "attempt": 1, "intended_send_ts": 5.0, "send_ts": 5.1}))
        clock[0] += 1
    assert steps[:4] == [("rate-s1-r0p5", 0.5), ("rate-s2-r1", 1.0), ("rate-s3-r2", 2.0), ("rate-s4-r4", 4.0)]
    events.close()
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert all(set(e) - {"ts", "event"} == FIELDS[Event(e["event"])] for e in lines)
    end = lines[-1]
    assert end["event"] == "search_end" and end["ended"] == "resolved" and end["largest_held_users"] is None
    assert end["largest_held_sessions_per_s"] <= 3.0 < end["first_failed_sessions_per_s"]
    assert end["first_failed_sessions_per_s"] - end["largest_held_sessions_per_s"] <= 0.1 * \
        end["largest_held_sessions_per_s"]


def test_each_decision_reads_the_scrapes_after_the_sampler_flushed_them():
    """The sampler's metrics log is deflated and reaches its file at most every half second: a step decided on
    what the file held then missed its last scrapes, which the analysis then judged it on (Sampler.flush)."""
    calls: list[str] = []

    class Ordered(FakeScrapes):
        def read(self) -> None:
            calls.append("read")

    clock = [0.0]
    goodput = LiveGoodput(SLO)
    search = LiveSearch(PLAN.stages[0], goodput, Ordered(), None, ResourceLimits(), None,  # type: ignore[arg-type]
                        clock=lambda: clock[0], flush=lambda settle: calls.append(f"flush {settle}"))
    step = search.step_now()
    search.enter(step)
    for second in range(6):
        for i in range(40):
            goodput.add(record(f"{second}-{i}", stage=step.name))
        clock[0] += 1
        search.step_now()
    assert search.last is not None and calls[1::2] == ["read"] * (len(calls) // 2), calls
    # a scrape under way waited for only where the step may be decided (from its step_s, 5 s, on)
    assert calls[::2] == [f"flush {second >= 5}" for second in range(1, len(calls) // 2 + 1)], calls
