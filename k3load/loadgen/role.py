"""The part a Locust process plays in a run: a local runner, a master, or one of its workers.

Why a type: Locust runs the same locustfile in each role, and most of k3load's start-up differs by role
(who opens the run directory, who writes records, who sends them). Spelled as strings, the role was compared
in fifteen places; as a StrEnum the questions the code asks are named once here, and the value still reads
as the plain word where it is written (`run_start`'s `role`, the console's process name).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from locust.runners import MasterRunner, WorkerRunner


class ProcessRole(StrEnum):
    LOCAL = "local"
    MASTER = "master"
    WORKER = "worker"

    @classmethod
    def of(cls, runner: Any) -> ProcessRole:
        """The role of the process running `runner` (None, an Environment built without a runner: local)."""
        if isinstance(runner, MasterRunner):
            return cls.MASTER
        if isinstance(runner, WorkerRunner):
            return cls.WORKER
        return cls.LOCAL

    @property
    def owns_run(self) -> bool:
        """Master or local runner: opens the run directory, writes the records and events, judges the run."""
        return self is not ProcessRole.WORKER

    @property
    def is_worker(self) -> bool:
        """Sends load and its records to a master; owns no run directory."""
        return self is ProcessRole.WORKER

    @property
    def is_master(self) -> bool:
        """Tells its workers the run and each stage; collects their records at the end."""
        return self is ProcessRole.MASTER
