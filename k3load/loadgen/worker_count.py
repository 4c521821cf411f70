"""The master's workers, counted: how many each stage started with, and an event when one leaves mid-run.

Why: with --processes, remote workers or Kubernetes, a worker that dies or is evicted takes its users (and
perhaps a whole family, or the control pairs) with it, and Locust's master only logs "failed to send
heartbeat". Said as `worker_lost` (events.jsonl) and per stage (`stage_start`'s `workers`), the analysis
can name it (analysis/decision/checklist.py): no pillar passes on part of the intended load without saying so.
"""

from __future__ import annotations

import logging
from typing import Any

from locust.runners import MasterRunner

from k3load.events import Event

log = logging.getLogger("k3load")


class WorkerCount:
    """The most workers seen so far this run; each drop below it said once."""

    def __init__(self) -> None:
        self.seen = 0

    @staticmethod
    def now(runner: Any) -> int | None:
        """The workers connected and not missing (None: not a master)."""
        if not isinstance(runner, MasterRunner):
            return None
        return int(runner.worker_count)

    def check(self, runner: Any, events: Any, stage: str | None) -> None:
        """A drop since the last check is an event and a console line; a new worker raises the count."""
        count = self.now(runner)
        if count is None:
            return
        if count < self.seen and events is not None:
            log.warning("k3load: a worker left during stage %s: %d of %d workers remain (its users' load is lost)",
                        stage, count, self.seen)
            events.event(Event.WORKER_LOST, stage=stage, workers_before=self.seen, workers_now=count)
        self.seen = count
