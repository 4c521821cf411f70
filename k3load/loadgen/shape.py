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
        if session is None or session.plan is None:
            return None
        stage = session.plan.stage_at(self.get_run_time())
        if stage is None:
            return None
        if session.stage is None or session.stage.name != stage.name:
            session.enter_stage(stage)
        classes = []
        for family, weight in sorted(stage.mix.items()):
            user_class = USER_CLASSES[family]
            user_class.weight = weight
            classes.append(user_class)
        return stage.users, stage.spawn_rate, classes
