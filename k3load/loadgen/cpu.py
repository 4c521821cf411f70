"""Each worker's own CPU, per wall second, to the master and into events.jsonl as it happens.

    worker  test_start -> `CpuReporter.start`: every --k3-sample-interval s, `k3_cpu` {run_id, cpu_pct, cpu_wait_pct,
                          ts, host, pid} to the master (this process's CPU per wall second, 100 = one core; the
                          share of that wall time it waited for a CPU, k3load.sampler.cpu_wait)
    worker  test_stop  -> `CpuReporter.stop`: one last reading, then no more
    master  `k3_cpu`   -> `write_reading`: an events.jsonl line
                          {"ts", "event": "load_generator_cpu", "process": "worker HOST:PID", "role": "worker",
                           "worker": NODE_ID, "cpu_pct", "cpu_wait_pct", "worker_ts"}

Why: a saturated load generator inflates every latency it measures, and under a master the sampler measures
only the master's process, which sends no request. Why events.jsonl and not metrics.jsonl: metrics.jsonl
holds the target's scrapes (every reader of it expects one); events.jsonl is the run's typed, time-stamped
log that the analysis already joins with the stages by `ts`. Why `ts` is the master's clock at receipt:
the stage windows are on the master's clock, and a worker on another machine may not agree with it to the
second; the worker's own time is kept as `worker_ts`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import gevent
from locust.exception import RPCError, RPCSendError
from locust.runners import WorkerRunner

from k3load.clock import now
from k3load.events import Event, Message
from k3load.rundir import JsonlLog
from k3load.sampler.cpu_wait import CpuWaitMeter
from k3load.sampler.loop import CpuMeter

log = logging.getLogger("k3load")


class CpuReporter:
    """A worker's CPU meter; `start` and `stop` follow its users (test_start, test_stop)."""

    def __init__(self, runner: WorkerRunner, run_id: Callable[[], str]) -> None:
        self.runner = runner
        self.run_id = run_id  # a callable: the run this worker is in now
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._meter: CpuMeter | None = None
        self._wait: CpuWaitMeter | None = None
        self._greenlet: gevent.Greenlet | None = None
        self.sent = 0

    def start(self, interval_s: float) -> None:
        if self._greenlet is not None:
            return
        self._meter, self._wait = CpuMeter(), CpuWaitMeter()
        self._greenlet = gevent.spawn(self._loop, max(float(interval_s or 1.0), 0.1))

    def _loop(self, interval_s: float) -> None:
        """Until `stop` kills it (the worker's users stopped) or the process ends."""
        while True:
            gevent.sleep(interval_s)
            self.send()

    def stop(self) -> None:
        """The last reading covers the users' stop; then the meter rests until the next test_start."""
        if self._greenlet is None:
            return
        self._greenlet.kill(block=True)
        self._greenlet = None
        self.send()
        self._meter = self._wait = None

    def send(self) -> None:
        value = self._meter.read() if self._meter is not None else None
        if value is None:
            return
        waited = self._wait.read() if self._wait is not None else None
        try:
            self.runner.send_message(Message.CPU, {"run_id": self.run_id(), "cpu_pct": value, "cpu_wait_pct": waited,
                                                "ts": now(), "host": self.host, "pid": self.pid})
            self.sent += 1
        except (RPCError, RPCSendError) as exc:  # the master is gone: nobody to tell
            log.debug("k3load: CPU reading not sent: %s", exc)


def plain_percent(value: Any) -> float | None:
    """A worker's percentage as sent, or None when it is no finite number in [0, 100] (an old worker that
    sends none, a kernel without schedstat, a peer sending something else)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 100.0:
        return None
    return float(value)


def process_name(host: str, pid: Any) -> str:
    return f"worker {host}:{pid}"


def write_reading(events: JsonlLog | None, worker: str, data: dict[str, Any]) -> None:
    """Master: one worker's reading into the run's events.jsonl (None: no run open), on the master's clock."""
    if events is None or data.get("cpu_pct") is None:
        return
    with contextlib.suppress(ValueError):  # closed: a reading after the run's end has nowhere to go
        events.event(Event.LOAD_GENERATOR_CPU,
                     process=process_name(str(data.get("host") or worker), data.get("pid")),
                     role="worker", worker=worker, cpu_pct=float(data["cpu_pct"]),
                     cpu_wait_pct=plain_percent(data.get("cpu_wait_pct")), worker_ts=data.get("ts"))
