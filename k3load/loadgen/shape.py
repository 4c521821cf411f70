"""The stage shape: Locust's LoadTestShape driven by the plan's flat timeline.

Each tick returns the current stage's user count, spawn rate and user classes (weighted by the
stage's family mix); a new stage is announced to the session (records are tagged with it and the
master tells its workers). The shape ends the run when the plan ends.
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
        stage = session.plan.stage_at(self.get_run_time()) if session.plan else None
        if stage is None:
            return None
        classes = [USER_CLASSES[family] for family in sorted(stage.mix)]
        if session.stage is None or session.stage.name != stage.name:
            if self._must_drain(session.stage, stage) and self.runner.user_count > 0:
                return 0, max(stage.users, 100), None  # finish the old mix's turns first
            session.enter_stage(stage)
        for user_class in classes:
            user_class.weight = stage.mix[user_class.family]
        return stage.users, stage.spawn_rate, classes

    @staticmethod
    def _must_drain(old: Any, new: Any) -> bool:
        """Locust's dispatcher keeps running users of classes a new tick leaves out, so a stage whose
        family mix differs starts from zero users (their current turns finish, within --stop-timeout)."""
        return old is not None and set(old.mix) != set(new.mix)
