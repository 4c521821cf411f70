"""SIGTERM ends a headless k3load run the way Ctrl-C does: the users finish their turns (within
--stop-timeout) and are recorded, `run_end` is written, the analysis runs, verdict.json and the report
are written, and the exit code is the verdict's.

    init           -> on a headless master or local runner with a shape: gevent SIGTERM and SIGINT handlers
    test_stopping  -> the run is ending: a later SIGTERM changes nothing

Why: Locust 2.47 (`locust/main.py::main`) installs its own SIGTERM handler only after
`start_automatic_run()` returns, and with a shape class that call blocks in `shape_greenlet.join()`
for the whole test, so until then SIGTERM has its default action and kills the process. Ctrl-C works
because its KeyboardInterrupt reaches the main greenlet there, where Locust catches it and quits the
runner (users stopped gracefully) before `shutdown()` fires `quitting` (our judgment). This handler
throws the same KeyboardInterrupt into the main greenlet. Workers keep Locust's own handler, which a
worker installs before its test starts (its users stop and it leaves the master, as on Ctrl-C).
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import gevent
from greenlet import getcurrent
from locust.runners import WorkerRunner

log = logging.getLogger("k3load")


class SigtermStop:
    """One per Locust process; `register(environment)` installs it where it applies."""

    def __init__(self, environment: Any) -> None:
        self.env = environment
        self.main = getcurrent()  # `init` fires in the greenlet that runs Locust's main()
        self.stopping = False
        self.handler: Any = None
        self.int_handler: Any = None

    def install(self) -> SigtermStop:
        self.env.events.test_stopping.add_listener(self._on_test_stopping)
        self.handler = gevent.signal_handler(signal.SIGTERM, self._on_sigterm, signal.SIGTERM)
        # Ctrl-C the same way: Python's own SIGINT handler raises KeyboardInterrupt in whichever greenlet
        # runs when the signal lands, and a sampler loop is a gevent-patched `threading.Thread`, whose
        # excepthook swallows it (a --processes run once ignored Ctrl-C for 90 s). gevent's handler
        # runs in the hub and throws into the main greenlet, where Locust quits the runner.
        self.int_handler = gevent.signal_handler(signal.SIGINT, self._on_sigterm, signal.SIGINT)
        return self

    def _on_test_stopping(self, **_kwargs: Any) -> None:
        self.stopping = True

    def _on_sigterm(self, signum: int = signal.SIGTERM) -> None:
        if self.stopping:
            log.warning("k3load: signal: the run is already stopping; its verdict follows")
            return
        if getattr(self.env.runner, "shape_greenlet", None) is None:
            log.warning("k3load: signal before the run started: nothing to judge, exiting")
            gevent.kill(self.main, SystemExit(128 + signum))
            return
        self.stopping = True
        log.warning("k3load: signal: stopping the run as Ctrl-C does (users finish their turns, then the verdict)")
        gevent.kill(self.main, KeyboardInterrupt)  # what gevent does with a Ctrl-C: thrown into main


def register(environment: Any) -> SigtermStop | None:
    """From an `init` listener. Only where Locust's own handler comes too late: a headless run with a
    shape, on the process that owns the run (local runner or master)."""
    opts = environment.parsed_options
    if (environment.shape_class is None or not getattr(opts, "headless", False)
            or environment.runner is None or isinstance(environment.runner, WorkerRunner)):
        return None
    return SigtermStop(environment).install()
