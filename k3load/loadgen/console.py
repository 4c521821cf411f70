"""What reaches the console: each kind of harness error said once with its count, library request logs kept out.

Usage::

    console.register(events)                                        # locustfiles/agent.py: quiets library logs at init
    ctx = RunContext(..., on_unjudged=console.harness_errors(env).unjudged)   # k3load.loadgen.users
    console.harness_errors(env).turn_failed(exc)                    # an exception that left a turn

Why: a hostile server made 398 answers raise in one stage, and Locust printed 398 tracebacks; at start-up
against a server without /tokenize, httpx printed one INFO line per probe ("HTTP Request: POST .../tokenize
"HTTP/1.1 404 Not Found""). An operator needs neither: one line per kind of error, with its count and where
the details are, and the harness's own lines.

- An answer the harness could not judge (recorded as received with a `harness.error` finding,
  k3load.workload.harness_error) is said on the console at the 1st, 10th, 100th, 1,000th ... of its kind in
  this process ("k3load: 398 answers: RecursionError while validating the answer (...); first at attempt
  4f2c1a9e…, see events.jsonl"), and written as an `answer_unjudged` event at the same counts where this
  process holds events.jsonl (local or master; a worker's are said on its console, and every one is counted
  from the records at the run's end: k3load.summary). At most log10(N) + 1 lines per kind.
- An exception that left a turn without a record (the request could not be built, the record could not be
  written) is said the same way as `turn_failed`, never as a traceback.
- Distinct kinds are capped at MAX_KINDS per process; further ones count as one "other" kind.
- httpx's and httpcore's per-request INFO lines are held to WARNING unless Locust's --loglevel is DEBUG.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from k3load.events import Event
from k3load.loadgen.role import ProcessRole
from k3load.outcomes import HARNESS_ERROR
from k3load.records import Attempt
from k3load.workload.harness_error import HarnessFault, kind_of

log = logging.getLogger("k3load")
QUIETED = ("httpx", "httpcore")  # one INFO line per request
MAX_KINDS = 50
OTHER = "other kinds"
PHASE_TURN = "playing a turn"


def register(events: Any) -> None:
    events.init.add_listener(_on_init)


def _on_init(**_kwargs: Any) -> None:
    quiet_library_logs()


def quiet_library_logs(root: logging.Logger | None = None) -> None:
    """Library request logs to WARNING, unless the console was asked for DEBUG (Locust sets the root level
    from --loglevel before `init`)."""
    if (root or logging.getLogger()).getEffectiveLevel() > logging.DEBUG:
        for name in QUIETED:
            logging.getLogger(name).setLevel(logging.WARNING)


def milestone(count: int) -> bool:
    """1, 10, 100, 1,000 ...: the counts at which a kind is said again."""
    while count % 10 == 0 and count > 1:
        count //= 10
    return count == 1


class HarnessErrors:
    """This process's harness errors, counted by kind per run; said at each milestone. `events` gives the
    run's events.jsonl writer (None where this process has none); `logger` is where the lines go."""

    def __init__(self, events: Callable[[], Any], process: str, logger: logging.Logger = log) -> None:
        self.events, self.process, self.logger = events, process, logger
        self.counts: Counter[str] = Counter()
        self.first: dict[str, str] = {}
        self.run_id: str | None = None

    def _count(self, kind: str, first: str) -> tuple[str, int]:
        if kind not in self.counts and len(self.counts) >= MAX_KINDS:
            kind = OTHER
        self.counts[kind] += 1
        self.first.setdefault(kind, first)
        return kind, self.counts[kind]

    def unjudged(self, attempt: Attempt) -> None:
        """An attempt recorded with a `harness.error` finding (RunContext.on_unjudged). Never raises."""
        try:
            if attempt.run_id != self.run_id:  # the web UI's next test is another run
                self.counts.clear()
                self.first.clear()
                self.run_id = attempt.run_id
            detail = next((f.detail for f in attempt.findings if f.check == HARNESS_ERROR), "")
            kind, count = self._count(kind_of(detail) or "unknown", attempt.attempt_id)
            if not milestone(count):
                return
            events = self.events()
            where = "see events.jsonl" if events is not None else "see its harness.error finding in records.jsonl.gz"
            self.logger.warning("k3load: %s answer%s: %s; first at attempt %s…, %s", f"{count:,}",
                                "" if count == 1 else "s", kind, self.first[kind][:8], where)
            if events is not None:
                events.event(Event.ANSWER_UNJUDGED, kind=kind, count=count, first_attempt_id=self.first[kind],
                             attempt_id=attempt.attempt_id, detail=detail, process=self.process)
        except Exception as exc:  # the console must never cost a turn
            self.logger.error("k3load: could not count a harness error: %s: %s", type(exc).__name__, exc)

    def turn_failed(self, exc: BaseException) -> None:
        """An exception that left a turn without a record (`turn_failed`). Never raises."""
        try:
            fault = HarnessFault.of(exc, PHASE_TURN)
            kind, count = self._count(fault.kind, "")
            if not milestone(count):
                return
            events = self.events()
            self.logger.error("k3load: %s turn%s ended without a record: %s: %s%s", f"{count:,}",
                              "" if count == 1 else "s", kind, fault.message,
                              ", see events.jsonl" if events is not None else "")
            if events is not None:
                events.event(Event.TURN_FAILED, kind=kind, count=count, message=fault.message, process=self.process)
        except Exception as inner:
            self.logger.error("k3load: could not count a harness error: %s: %s", type(inner).__name__, inner)


def harness_errors(environment: Any) -> HarnessErrors:
    """The process's one `HarnessErrors`, kept on the environment (a fresh one per Environment)."""
    found = getattr(environment, "k3_harness_errors", None)
    if found is None:
        session = getattr(environment, "k3_session", None)
        role = getattr(session, "role", ProcessRole.LOCAL)
        found = HarnessErrors(lambda: getattr(session, "events", None), f"{role} {os.getpid()}")
        environment.k3_harness_errors = found
    return found
