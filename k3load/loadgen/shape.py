"""The stage shape: Locust's LoadTestShape driven by the plan's flat timeline.

Each tick returns the current stage's user count, spawn rate and user classes (weighted by the
stage's family mix); a new stage is announced to the session (records are tagged with it and the
master tells its workers). The shape ends the run when the plan ends.

After each plan stage the users stop and the server is given a bounded drain window
(k3load.loadgen.drain); a `restart` stage with --k3-restart-cmd restarts the server on purpose first
(k3load.loadgen.restart_drill). The plan's clock stands still during both, so no stage is cut short.
"""

from __future__ import annotations

from typing import Any

from locust import LoadTestShape

from k3load.loadgen.users import USER_CLASSES


class PlanShape(LoadTestShape):
    def tick(self) -> tuple[int, float, list[Any]] | None:
        session = getattr(self.runner.environment, "k3_session", None)
        if session is None:
            return None
        if session.fatal:
            return None
        try:
            if (session.run_dir is None or session.finished) and session.role != "worker":  # a new test: a new run
                session.ensure_started()
                self.reset_time()  # the plan's clock starts when the run directory and observers are ready
            session.ensure_started()
        except (RuntimeError, ValueError, OSError) as exc:
            session.fail(str(exc))  # a dead server or a bad scenario/plan: say so and end the run cleanly
            return None
        stage = self._planned(session)
        drain = session.drain
        if drain is not None and drain.due(session.stage, stage):
            if self.runner.user_count > 0:
                return 0, max(stage.users if stage else 0, 100), None  # every client of the stage leaves first
            drain.run(session.stage)  # bounded; the plan's clock waits
            stage = self._planned(session)
        if stage is None:
            return None
        if session.stage is None or session.stage.name != stage.name:
            drill = session.restart_drill
            drills = drill is not None and drill.due(stage)
            if (self._must_drain(session.stage, stage) or drills) and self.runner.user_count > 0:
                return 0, max(stage.users, 100), None  # finish the old mix's turns first
            if drills:
                before, stage = session.stage, drill.held(stage, session.stage)
                session.enter_stage(stage)
                drill.run(stage, before)  # restart on purpose, then hold the load before it; the clock waits
            else:
                session.enter_stage(stage)
        stage = session.stage  # as entered (a drilled restart stage holds the load before it)
        classes = [USER_CLASSES[family] for family in sorted(stage.mix)]
        for user_class in classes:
            user_class.weight = stage.mix[user_class.family]
        return stage.users, stage.spawn_rate, classes

    def _planned(self, session: Any) -> Any:
        """The plan's stage now, on a clock that stood still during drain windows and restart drills."""
        paused = sum(getattr(x, "paused_s", 0.0) for x in (session.drain, session.restart_drill) if x is not None)
        return session.plan.stage_at(self.get_run_time() - paused) if session.plan else None

    @staticmethod
    def _must_drain(old: Any, new: Any) -> bool:
        """Locust's dispatcher keeps running users of classes a new tick leaves out, so a stage whose
        family mix differs starts from zero users (their current turns finish, within --stop-timeout)."""
        return old is not None and set(old.mix) != set(new.mix)
