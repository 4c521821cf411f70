"""One HarnessSession per Locust process: run identity, scenarios, stage, and where records go.

Why a session object: Locust runs the same locustfile as local runner, master and workers. Only the
master (or local runner) owns the run directory; workers send each record to the master the moment
it ends (k3load.loadgen.worker: counted, with a spool copy only where they share the master's disk), and
the master writes `records.jsonl.gz` once per attempt id. At the end the master waits until every worker's
count of records has arrived (k3load.loadgen.delivery), so workers on other machines lose nothing either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gevent
import gevent.event

from k3load.analysis.pillars.agent.agreement import reference_record
from k3load.analysis.pillars.headroom.goodput import Slo
from k3load.analysis.pillars.pillar import thresholds
from k3load.client.origin import key_origin
from k3load.disk_full import FULL, stopped_line
from k3load.events import Event, Message
from k3load.evidence import RECORDS
from k3load.loadgen import delivery, held_secrets, observe
from k3load.loadgen.arrivals import Schedules
from k3load.loadgen.drain import StageDrain
from k3load.loadgen.hold import RunHold, stop_load
from k3load.loadgen.inputs import harness_error_line, load_inputs
from k3load.loadgen.long_inputs import LongInputs
from k3load.loadgen.manual import LiveCounts, ManualStages
from k3load.loadgen.open_run import OpenRun
from k3load.loadgen.options import locust_late_outputs
from k3load.loadgen.recovery import RecoveryHold
from k3load.loadgen.request_events import fire_request_events
from k3load.loadgen.restart_drill import RestartDrill
from k3load.loadgen.role import ProcessRole
from k3load.loadgen.run_files import files_in_use, new_run_id, run_info, str_or_none, write_start_files
from k3load.loadgen.search_live import LiveGoodput, LiveSearch
from k3load.loadgen.target import TargetApi, TargetUnusable
from k3load.loadgen.worker import WorkerLink, tell_master
from k3load.loadgen.worker_count import WorkerCount
from k3load.private_files import narrow_existing
from k3load.records import Attempt
from k3load.rundir import JsonlLog, set_aside_previous_run, write_guarded
from k3load.sampler import Sampler
from k3load.workload.long_input import estimate_tokens
from k3load.workload.plan import ArrivalSpec, Plan, Stage
from k3load.workload.reuse_design import http_tokenizer, measure_into
from k3load.workload.scenario import Scenario
from k3load.workload.stage_kind import StageKind
from k3load.yamlfile import one_line

if TYPE_CHECKING:  # the analysis is loaded where a run is judged (k3load.loadgen.listeners)
    from k3load.analysis.analyze import Judgment

log = logging.getLogger("k3load")
ROOT = Path(__file__).resolve().parents[2]
# How long a run's end waits for its design measurement (reuse_design.json) before stopping it: /tokenize of a few
# dozen variants takes seconds; a server that never answers it leaves the reuse inconclusive, not the run hung
DESIGN_WAIT_S = 120.0


class HarnessSession:
    """State shared by the users of one process; attached to the environment as `k3_session`."""

    def __init__(self, environment: Any) -> None:
        self.env = environment
        self.run_id = ""
        self.run: OpenRun | None = None  # master/local: the run opened last (kept after its end: it is judged)
        self._ended: OpenRun | None = None  # the run whose records were closed: one arriving now is not written
        self.model = ""
        self.max_model_len: int | None = None
        self.plan: Plan | None = None
        self.scenarios: dict[str, list[Scenario]] = {}
        self.stage: Stage | None = None
        self.stage_started = 0.0
        self._pending_stage: str | None = None  # worker: a stage announced before test_start loaded the plan
        self.master_workers: int | None = None  # worker: the master's worker count at its last stage entry
        self.workers = delivery.Workers()  # master: each worker's records, as it counted them and as they arrived
        # worker: its records' path to the master; --k3-worker-spool read now, from its own command line
        self.link = WorkerLink(environment.runner, getattr(environment.parsed_options, "k3_worker_spool", "auto")) \
            if self.role.is_worker else None
        self.ready = gevent.event.Event()
        # sized by the server's own token count (a test may replace `_count_tokens`): the long input's document,
        # and whether a scenario fits the server's context at all
        self.long_inputs = LongInputs(lambda: self.max_model_len, lambda s: self._count_tokens(s), lambda: self.events)
        self.long_context, self.fits = self.long_inputs.document, self.long_inputs.fits
        self.attempts_written = 0
        self._lost = 0  # the last run's records never kept (its log closed: JsonlLog.lost as it ended)
        self.sampler: Sampler | None = None
        self.reuse_design: gevent.Greenlet | None = None  # measuring the designed prefix reuse (reuse_design.json)
        self.fatal = ""  # why the run could not start or go on (a dead server, a bad file, a full disk): no verdict
        self.hold = RunHold(self._write_failed)  # master/local: the run directory's lock, its writers' guard
        self.previous_run_moved_to: Path | None = None  # an earlier run found in the run directory went here
        self.tests = 0  # runs this process opened: the web UI opens one per test it starts
        self.finished = False  # master/local: this run's records are closed (the web UI judges it at test stop)
        self.finisher: gevent.Greenlet | None = None  # the greenlet judging the last run (web UI); a new run waits
        self.judgment: Judgment | None = None  # the last finished run's judgment
        self.manual = ManualStages()  # stages `manual-N` when no plan shape drives the users
        self.live = LiveCounts()  # per-run counts the web UI shows (attempts, failures by layer)
        self.load_skipped = False  # the precheck said rebuild: no load runs (k3load.loadgen.observe.precheck)
        self.workers_seen = WorkerCount()  # the master's workers, a drop said as worker_lost
        self.drain: StageDrain | None = None  # master/local: the drain window after each plan stage
        self.restart_drill: RestartDrill | None = None  # master/local with --k3-restart-cmd: the restart stage's drill
        self.recovery: RecoveryHold | None = None  # master/local: the crash stage's load again once the server is back
        self.goodput = LiveGoodput(Slo.from_limits(self.limits))  # master/local: requests meeting the SLO, per stage
        self.search: LiveSearch | None = None  # master/local: the last search stage's (k3load.loadgen.shape)

    @property
    def role(self) -> ProcessRole:
        return ProcessRole.of(self.env.runner)

    @property
    def run_dir(self) -> Path | None:
        return self.run.run_dir if self.run is not None else None

    @property
    def events(self) -> JsonlLog | None:
        """The open (or last) run's events.jsonl; None before a run was opened here (always on a worker)."""
        return self.run.events if self.run is not None else None

    @property
    def target(self) -> TargetApi:
        """The target's own API as Locust's host and options say now (the web UI may change them between tests)."""
        return TargetApi(self.env.host, self.env.parsed_options)

    @property
    def limits(self) -> dict[str, dict[str, float]]:
        """The plan's thresholds over the defaults (the run needs a few: the tool-call silence limit)."""
        return thresholds(self.plan.thresholds if self.plan else None)

    @property
    def stage_name(self) -> str:
        return self.stage.name if self.stage else "setup"

    # -- set-up ---------------------------------------------------------------------------------
    def ensure_started(self) -> None:
        """Idempotent: inputs loaded; on the master/local runner the run directory opened and, on a
        master, the run identity sent to the workers. Called by test_start and by the shape's first
        tick (Locust may tick the shape before test_start fires)."""
        plan = self.plan
        if plan is None:
            plan = self.load_inputs()
            if self._pending_stage is not None:
                self.set_stage_by_name(self._pending_stage)
        if self.role.owns_run and (self.run is None or self.finished):
            try:
                self.start_run(plan)
            except OSError as exc:  # a full disk already at the start: the same one line as later on
                if exc.errno in FULL and self.hold.guard is not None:
                    self.hold.guard.failed(Path(exc.filename or self.hold.run_dir or "."), exc)
                raise
            if self.role.is_master:
                self.env.runner.send_message(Message.RUN, self.run_message())

    def load_inputs(self) -> Plan:
        """Scenarios and plan (also checked at `init` on the master; loaded again here because the web UI
        may change the options, and a worker gets them only now)."""
        self.scenarios, self.plan = load_inputs(self.env.parsed_options, ROOT / "plans")
        return self.plan

    def start_run(self, plan: Plan) -> None:
        """Master/local: create the run directory and everything known before the first request. A test
        started again from the web UI is a new run: the last one's judging is waited for, then it is
        set aside like any earlier run found in the directory."""
        opts = self.env.parsed_options
        bound = held_secrets.held(opts).origin
        if held_secrets.held(opts) and key_origin(self.env.host) != bound:  # ui_guard refuses it first
            raise TargetUnusable(f"the target is now {key_origin(self.env.host) or 'none'}, and k3load was "
                                 f"started for {bound}: the key goes only there; restart k3load with --host")
        if self.finisher is not None:
            self.finisher.join()
        self._new_run_state()
        self.run_id = new_run_id(opts, self.tests)
        run_dir = Path(opts.k3_out).resolve()
        if getattr(opts, "k3_insecure", False):
            log.warning("k3load: TLS certificate verification is OFF (--k3-insecure): the target's identity is "
                        "not checked; run.json says so")
        reference = reference_record(Path(opts.k3_reference)) if getattr(opts, "k3_reference", "") else None
        self._discover_server()  # first: a server that does not answer leaves no run directory behind
        guard = self.hold.open(run_dir, self.run_id)  # 0700, locked: a live run's directory is refused, never moved
        self.previous_run_moved_to = set_aside_previous_run(run_dir, files_in_use(opts, run_dir))
        narrow_existing(run_dir / p for p in locust_late_outputs(opts, run_dir))  # opened before init
        if self.previous_run_moved_to is not None:
            log.warning("k3load: %s held an earlier run; moved it to %s", run_dir, self.previous_run_moved_to)
        records = JsonlLog(run_dir / RECORDS, guard=guard)  # a failed write stops the run
        run = self.run = OpenRun(self.run_id, run_dir, plan, records, JsonlLog(run_dir / "events.jsonl", guard=guard),
                                 guard, self.target)
        run.events.event(Event.RUN_START, run_id=self.run_id, role=self.role,
                         previous_run_moved_to=str_or_none(self.previous_run_moved_to))
        self.manual.active = self.env.shape_class is None  # no plan shape: the user count set by hand
        info = run_info(run, self.model, self.max_model_len, [s.name for g in self.scenarios.values() for s in g],
                        self.previous_run_moved_to)
        playable = [s for group in self.scenarios.values() for s in group if self.fits(s)]  # says each misfit
        write_start_files(run, self.manual.plan_source(plan) if self.manual.active else plan.source, info, reference,
                          playable, self.model, self.long_context)
        # designed prefix reuse, tokenized by the server beside the load, never before it (issue 15)
        self.reuse_design = gevent.spawn(self.hold.guarded, measure_into, self.hold.write_json, playable, self.run_id,
                                         self.model, self.long_context,
                                         http_tokenizer(run.target.client, self.env.host, self.model))
        self.load_skipped = observe.precheck(run, lambda: stop_load(self.env))
        observe.watch_restarts(run, self._drilling)
        self.recovery = observe.watch_recoveries(run, lambda: self.stage, self._drilling)
        self.sampler = observe.start_sampler(run)
        self.drain, self.restart_drill = observe.stage_ends(run)
        self.ready.set()

    def _drilling(self) -> bool:
        """The restart drill has the server down on purpose: no crash for the restarter or the recovery hold."""
        return self.restart_drill is not None and self.restart_drill.active

    def _new_run_state(self) -> None:
        self.tests += 1
        self.finished, self.judgment, self.stage, self.previous_run_moved_to = False, None, None, None
        self.load_skipped = False  # the precheck said rebuild: no load runs (k3load.loadgen.observe.precheck)
        self.workers_seen = WorkerCount()  # the master's workers, a drop said as worker_lost
        self.attempts_written, self._lost = 0, 0
        self.workers.clear()
        self.manual = ManualStages()
        self.live = LiveCounts()
        self.goodput, self.search = LiveGoodput(Slo.from_limits(self.limits)), None

    def fail(self, why: str) -> None:
        """The run cannot start or go on: said once, now, as one line on stderr (the web UI's terminal too);
        the master's `quitting` then exits 2 without a verdict."""
        if self.fatal:
            return
        self.fatal = why
        print(harness_error_line(why), file=sys.stderr, flush=True)
        if self.events is not None:
            with contextlib.suppress(ValueError):  # closed already (a failure at the run's very end): said above
                self.events.event(Event.HARNESS_ERROR, error=one_line(why)[:2000])
        if self.role.is_worker:
            tell_master(self.env, f"harness error: {one_line(why)[:2000]}")  # the master stops the run: exit 2

    def _write_failed(self, path: Path, exc: OSError, stopped_at: float) -> None:
        """The run's first write that failed (k3load.loadgen.hold): fatal, said in one line; the load stops."""
        shown = Path(getattr(self.env.parsed_options, "k3_out", "") or self.run_dir or ".")
        self.fail(stopped_line(shown, path, exc, self.records_kept(), stopped_at))
        if not self.finished:  # at the run's end (its verdict's files) the load has stopped already
            stop_load(self.env)

    def _open_records(self) -> JsonlLog | None:
        return self.run.records if self.run is not None and self.run is not self._ended else None

    def records_kept(self) -> int:
        """Records in records.jsonl.gz (as of its last flush)."""
        records = self._open_records()
        return records.kept if records is not None else self.attempts_written

    def records_lost(self) -> int:
        """Records that ended after a write failed (or were waiting for the flush that failed): never kept."""
        records = self._open_records()
        return records.lost if records is not None else self._lost

    def open_logs(self) -> list[JsonlLog]:
        return [x for x in (self._open_records(), self.events) if x is not None]

    def _discover_server(self) -> None:
        """Which model to send and its context (raises TargetUnusable: a dead server leaves no run directory)."""
        self.model, self.max_model_len = self.target.discover(self.env.parsed_options.k3_model)

    def run_message(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "run_dir": str(self.run_dir), "model": self.model,
                "max_model_len": self.max_model_len}

    def join_run(self, data: dict[str, Any]) -> None:
        """Worker: the master's run identity; its records' path to the master opens (k3load.loadgen.worker)."""
        self.run_id, self.model, self.max_model_len = data["run_id"], data["model"], data["max_model_len"]
        if self.link is not None:  # a worker always has one (only a worker registers k3_run)
            self.link.join(self.run_id, Path(data["run_dir"]))
        self.ready.set()

    # -- during the run ----------------------------------------------------------------------------
    def playable(self, family: str) -> list[Scenario]:
        """The family's scenarios this stage plays: a prefix_control stage plays the cache-control pair
        scenarios (`prefix_salt: pair`), other stages the rest (each falls back to all while the family
        has none of its kind); long-input scenarios that cannot fit the server are left out."""
        group = [s for s in self.scenarios.get(family, []) if self.fits(s)]
        control = self.stage is not None and self.stage.kind == StageKind.PREFIX_CONTROL
        chosen = [s for s in group if (s.prefix_salt == "pair") == control]
        return chosen or group

    def _count_tokens(self, scenario: Scenario) -> Callable[[str], int]:
        fallback = estimate_tokens((scenario.long_input or {}).get("chars_per_token", 3.5))
        return self.target.token_counter(self.model, fallback)

    def enter_stage(self, stage: Stage) -> None:
        self.stage, self.stage_started = stage, time.monotonic()
        mix = ", ".join(f"{k} {v}" for k, v in sorted(stage.mix.items()))
        log.info("k3load: stage %s (%s, %d users: %s, %.0f s)", stage.name, stage.kind, stage.users, mix,
                    stage.duration_s)
        if self.events is not None:
            self.workers_seen.check(self.env.runner, self.events, stage.name)
            self.events.event(Event.STAGE_START, stage=stage.name, kind=stage.kind, users=stage.users,
                              mix=stage.mix, workers=self.workers_seen.now(self.env.runner),
                              **({"sessions_per_s": stage.arrival.sessions_per_s} if stage.arrival else {}),
                              **({"search": self.search.stage.name} if stage.step is not None and self.search
                                 else {}))
        if self.role.is_master:  # a manual stage or a search step is in no plan: it goes whole to the workers
            whole = dataclasses.asdict(dataclasses.replace(stage, search=None)) \
                if self.manual.active or stage.step is not None or stage.kind == StageKind.RECOVERY else None
            self.env.runner.send_message(Message.STAGE, {"name": stage.name, "stage": whole,
                                                         "workers": self.workers_seen.now(self.env.runner)})

    def search_step(self, stage: Stage) -> Stage | None:
        """Master/local: the step to run now of the search stage `stage` (its search begun at the first call),
        None once that search ended (k3load.loadgen.search_live)."""
        if self.search is None or self.search.stage.name != stage.name:
            if self.run is None:
                return None  # no run open (the shape opens one first): nothing to search
            self.search = LiveSearch.for_run(stage, self.run.run_dir, self.run.events, self.limits, self.goodput,
                                             self._sessions_started, self._flush_scrapes)
        return self.search.step_now()

    def _flush_scrapes(self, settle: bool) -> None:
        """The sampler's scrapes so far into metrics.jsonl.gz (a search step's decision reads them there); with
        `settle`, a scrape under way too (waited for, at most the sampler's scrape timeout)."""
        if self.sampler is not None:
            self.sampler.flush(None if settle else 0.0)

    def _sessions_started(self, stage: str) -> int | None:
        """An open-loop stage's sessions this process has started (its users' schedules, k3load.loadgen.users, on
        their clock: time.time, as the records' send_ts); None where no user of this run took one here (a master
        with workers)."""
        schedules = getattr(self.env, "k3_arrivals", None)
        if not isinstance(schedules, Schedules) or schedules.run_id != self.run_id:
            return None
        return schedules.started_by(stage, time.time())

    def enter_manual_stage(self, users: int, spawn_rate: float) -> None:
        """Master/local, no plan shape: the user count was set (a test started, or changed from the
        web UI): a new stage `manual-N` of kind concurrency, so the ramp report judges each step."""
        run = self.run
        if not self.manual.active or run is None or self.finished:
            return
        mix = {getattr(c, "family", c.__name__): int(c.weight) for c in self.env.user_classes}
        self.enter_stage(self.manual.next(users, spawn_rate, mix))
        write_guarded(run.run_dir / "plan.yaml", self.manual.plan_source(run.plan), run.guard)

    def set_stage_by_name(self, name: str, spec: dict[str, Any] | None = None) -> None:
        """Worker: the master's shape entered `name`. The master announces a stage before the spawn
        that fires a worker's test_start, so before the plan is loaded it is kept until then. A manual
        stage comes whole (`spec`): it is in no plan."""
        if spec is not None:
            whole = Stage(**{**spec, "arrival": ArrivalSpec.of(spec.get("arrival"))})  # asdict made it a dict
            self.stage, self.stage_started = whole, time.monotonic()
            return
        if self.plan is None:
            self._pending_stage = name
            return
        self._pending_stage = None
        stage = next((s for s in self.plan.stages if s.name == name), None)
        if stage is None:
            log.error("k3load: the master's stage %r is not in this worker's plan %s", name, self.plan.name)
            return
        self.stage, self.stage_started = stage, time.monotonic()

    def record(self, attempt: Attempt) -> None:
        """Called as each attempt ends, in the process that sent it."""
        fire_request_events(self.env, attempt)
        line = attempt.to_json()
        if self.link is not None:
            self.link.send(line)
        else:
            self.write_record_line(attempt.attempt_id, line)

    def write_record_line(self, attempt_id: str, line: str) -> bool:
        """Master/local: the attempt into records.jsonl.gz; True when written (False: the run's records are closed).
        Each attempt comes here once: from the process that sent it, or a worker's message, or its spool where
        that message never came (k3load.loadgen.delivery: no set of every id written is kept over a day)."""
        records = self._open_records()
        if records is None:
            return False
        records.append_line(line)
        self.attempts_written += 1
        self.live.add(line)
        self.goodput.add(line)
        return True

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        if not self.ready.wait(timeout_s):
            raise RuntimeError("k3load: run identity never arrived from the master")
        gevent.idle()

    def end_manual_stages(self) -> None:
        """At the run's end: the last manual stage ends now; plan.yaml holds the stages as they ran."""
        if self.manual.active and self.run is not None:
            self.manual.stop()
            write_guarded(self.run.run_dir / "plan.yaml", self.manual.plan_source(self.run.plan), self.run.guard)

    def close(self) -> None:
        if self.search is not None:  # a search the run's end cut short says so (search_end, ended: stopped)
            self.search.stop()
        if self.reuse_design is not None:  # reuse_design.json is written before the run is judged
            self.reuse_design.join(timeout=DESIGN_WAIT_S)
            if not self.reuse_design.dead:  # never left to write into the next web UI test's run
                log.warning("k3load: the designed prefix reuse was not measured within %.0f s of the run's end: "
                            "stopped (reuse is judged inconclusive)", DESIGN_WAIT_S)
                self.reuse_design.kill(block=True, timeout=5)
            self.reuse_design = None
        if self.recovery is not None:  # a hold the run's end cut short says so (recovery_hold, ended: run_ended)
            self.recovery.close()
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
        records = self._open_records()
        for handle in (records, self.events):
            if handle is not None:
                handle.close()  # a failure here goes to the guard: the run is then fatal
        if records is not None:
            self._lost = records.lost
        self._ended = self.run  # a record arriving after the end is not this run's to write

