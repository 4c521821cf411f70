"""The stage shape: Locust's LoadTestShape driven by the plan's flat timeline.

Each tick returns the current stage's user count, spawn rate and user classes (weighted by the
stage's family mix); a new stage is announced to the session (records are tagged with it and the
master tells its workers). The shape ends the run when the plan ends.

After each plan stage the users stop and the server is given a bounded drain window
(k3load.loadgen.drain); a `restart` stage with --k3-restart-cmd restarts the server on purpose first
(k3load.loadgen.restart_drill). The plan's clock stands still during both, and while a stage's users
finish their current turns before the next stage (up to --stop-timeout), so no stage is cut short or
skipped: a 2 s stage after a stage whose answers take 5 s to end would otherwise never run. A tick that comes
late (Locust's runner blocks the shape while users spawn or stop) still enters the next stage, whole.

A `kind: search` stage reserves max_total_s of the plan; while the plan's clock is in it, the tick runs
the search's current step (k3load.loadgen.search_live: each step a stage NAME-sK-cUSERS, no drain
between them), and when the search ends the clock jumps to the end of the reservation, so the plan goes
on with its next stage at once. A plan clock that passes the reservation first ends the search there.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from locust import LoadTestShape, User

from k3load.loadgen.inputs import STARTUP_ERRORS, bug_at_start
from k3load.loadgen.users import USER_CLASSES
from k3load.workload.plan import Stage
from k3load.workload.stage_kind import StageKind

if TYPE_CHECKING:  # the session is the environment's (k3load.loadgen.listeners): for the annotations only
    from k3load.loadgen.session import HarnessSession


class PlanShape(LoadTestShape):
    def __init__(self) -> None:
        super().__init__()
        self._left_s = 0.0  # the plan's clock stood still this long while users left between stages
        self._leaving_since: float | None = None  # perf_counter when the current departure began
        self._skipped_s = 0.0  # what ended searches left of their reservations: the plan's clock jumped it
        self._behind_s = 0.0  # the plan's clock set back so that a stage it ran past is still entered whole

    def reset_time(self) -> None:
        """A new test: its clock from zero, no departure time carried over."""
        super().reset_time()
        self._left_s, self._leaving_since, self._skipped_s, self._behind_s = 0.0, None, 0.0, 0.0

    def tick(self) -> tuple[int, float, list[type[User]] | None] | None:
        runner = self.runner
        session = getattr(runner.environment, "k3_session", None) if runner is not None else None
        if runner is None or session is None:
            return None
        if session.fatal:
            return None
        try:
            if (session.run is None or session.finished) and session.role.owns_run:  # a new test: a new run
                session.ensure_started()
                self.reset_time()  # the plan's clock starts when the run directory and observers are ready
            session.ensure_started()
        except STARTUP_ERRORS as exc:
            session.fail(str(exc))  # a dead server or a bad scenario/plan: say so and end the run cleanly
            return None
        except Exception as exc:  # a bug: its traceback whole, and no verdict on a run that never started
            bug_at_start(session, exc)
            return None
        if session.load_skipped:
            return None  # the precheck said rebuild: the run ends before its first stage (exit 4)
        session.workers_seen.check(runner, session.events, session.stage.name if session.stage else None)
        stage = self._next(session)
        drain = session.drain
        if drain is not None and drain.due(session.stage, stage) and not same_search(session.stage, stage):
            if runner.user_count > 0:
                return self._users_leave(stage)  # every client of the stage leaves first
            self._users_left()
            drain.run(session.stage)  # bounded; the plan's clock waits
            stage = self._next(session)
        if stage is None:
            return None
        if session.stage is None or session.stage.name != stage.name:
            drill = session.restart_drill
            drills = drill is not None and drill.due(stage)
            if (self._must_drain(session.stage, stage) or drills) and runner.user_count > 0:
                return self._users_leave(stage)  # finish the old mix's turns first
            self._users_left()
            if drills:
                before, stage = session.stage, drill.held(stage, session.stage)
                session.enter_stage(stage)
                drill.run(stage, before)  # restart on purpose, then hold the load before it; the clock waits
            else:
                recovery = getattr(session, "recovery", None)
                if recovery is not None and stage.kind == StageKind.RECOVERY:
                    recovery.begin(session.stage)  # before entering: a down while the master tells its workers ends it
                session.enter_stage(stage)
                if stage.step is not None and session.search is not None:
                    session.search.enter(stage)  # the step's clock starts with its users
        # users told to leave for a change that did not come (a hold armed, then its server died again before it
        # began): they stay, and the plan's clock runs again (left standing, it froze the plan in this stage)
        self._users_left()
        stage = session.stage  # as entered (a drilled restart stage holds the load before it)
        # a replay stage has no mix: its users (of the agent class) play the trace's rows (k3load.loadgen.replay)
        classes = [USER_CLASSES[family] for family in sorted(stage.mix) or ["agent"]]
        for user_class in classes:
            user_class.weight = stage.mix.get(user_class.family, 1)
        return stage.users, stage.spawn_rate, list(classes)  # as Locust's list[type[User]]

    def _users_leave(self, stage: Stage | None) -> tuple[int, float, None]:
        """Zero users, fast; the plan's clock stops from the first such tick until they are gone."""
        if self._leaving_since is None:
            self._leaving_since = time.perf_counter()
        return 0, max(stage.users if stage else 0, 100), None

    def _users_left(self) -> None:
        if self._leaving_since is not None:
            self._left_s += time.perf_counter() - self._leaving_since
            self._leaving_since = None

    def _next(self, session: HarnessSession) -> Stage | None:
        """The stage to run now: a recovery hold after a crash (k3load.loadgen.recovery) while it lasts, else the
        plan's, never one past a stage not entered yet, a search's step in its place."""
        recovery = getattr(session, "recovery", None)
        if recovery is not None:
            hold = recovery.hold_now()
            if hold is not None:
                return hold
            cut = _plan_index(session.plan.stages if session.plan else (), recovery.take_interrupted())
            if cut is not None and session.plan is not None:  # the stage the hold cut short ends with it
                self._skipped_s += max(session.plan.stages[cut].end_s - self._plan_clock(session), 0.0)
        return self._searching(session, self._in_order(session, self._planned(session)))

    def _in_order(self, session: HarnessSession, stage: Stage | None) -> Stage | None:
        """The plan's next stage when the clock ran past it before it was entered: entered now, whole (the clock
        is set back to its start). Why: a tick is late whenever Locust's runner blocks the shape (it waits for
        users to spawn or to finish their turns), and a plan clock that ran on meanwhile skipped a whole ramp
        step on a slow machine (CI: a 5 s step of 4 users never ran, so its ramp ended at 1 user). Stages the
        plan does not hold (manual stages) are left to the clock."""
        stages = session.plan.stages if session.plan is not None else ()
        current = _plan_index(stages, session.stage)
        if session.stage is not None and current is None:
            return stage
        due = 0 if current is None else current + 1
        wanted = len(stages) if stage is None else _plan_index(stages, stage)
        if wanted is None or wanted <= due or due >= len(stages):
            return stage
        self._behind_s += self._plan_clock(session) - stages[due].start_s
        return stages[due]

    def _planned(self, session: HarnessSession) -> Stage | None:
        """The plan's stage now, on a clock that stood still during drain windows, restart drills and
        the departures before them, and jumped the rest of each search that ended early."""
        return session.plan.stage_at(self._plan_clock(session)) if session.plan else None

    def _plan_clock(self, session: HarnessSession) -> float:
        """Seconds into the plan: run time less the pauses, plus the reservations ended searches skipped."""
        paused = sum(getattr(x, "paused_s", 0.0) for x in (session.drain, session.restart_drill,
                                                            getattr(session, "recovery", None)) if x is not None)
        leaving = 0.0 if self._leaving_since is None else time.perf_counter() - self._leaving_since
        return self.get_run_time() - paused - self._left_s - leaving + self._skipped_s - self._behind_s

    def _searching(self, session: HarnessSession, stage: Stage | None) -> Stage | None:
        """A search stage's current step in its place; once its search ended, what follows its reservation.
        Bounded: each pass ends one search stage, and there are no more of them than stages."""
        running = session.search
        if running is not None and (stage is None or stage.name != running.stage.name):
            running.stop("max_total_s")  # the plan's clock passed the reservation before the search ended
        if stage is None or stage.search is None or session.plan is None:
            return stage
        for _ in range(len(session.plan.stages) + 1):
            if stage is None or stage.search is None:
                return stage
            step = session.search_step(stage)
            if step is not None:
                return step
            self._skipped_s += max(stage.end_s - self._plan_clock(session), 0.0)  # the rest of its reservation
            stage = self._planned(session)
        return stage

    @staticmethod
    def _must_drain(old: Stage | None, new: Stage) -> bool:
        """Locust's dispatcher keeps running users of classes a new tick leaves out, so a stage whose
        family mix differs starts from zero users (their current turns finish, within --stop-timeout)."""
        return old is not None and set(old.mix) != set(new.mix)


def _plan_index(stages: tuple[Stage, ...], stage: Stage | None) -> int | None:
    """Where `stage` stands in the plan: by name, a search's step by its search's stage; None when not there."""
    if stage is None:
        return None
    for i, planned in enumerate(stages):
        if planned.name == stage.name or (stage.search is not None and planned.search is stage.search):
            return i
    return None


def same_search(old: Stage | None, new: Stage | None) -> bool:
    """Two steps of one search (the same plan stage's settings): no drain between them, as between a ramp's steps."""
    return (old is not None and new is not None and old.step is not None and new.step is not None
            and old.search is not None and old.search is new.search)
