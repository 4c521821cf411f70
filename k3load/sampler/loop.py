"""The side sampler: background loops that write metrics.jsonl.gz, gpu.jsonl, events.jsonl and server.log.

Why plain `threading.Thread`s and `threading.Event` waits: in a plain process they are threads; in a
Locust process `import locust` has gevent-patched `threading`, so the same code runs as greenlets and
every wait yields to the load. Each source has its own loop, so a hung vLLM (scrapes timing out) never
delays the GPU memory curve, which is exactly what an OOM analysis needs around the hang.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from k3load.client.access import Tls, gevent_patched
from k3load.command_name import command_program
from k3load.events import Event
from k3load.evidence import METRICS, SeriesTable
from k3load.private_files import make_run_dir
from k3load.rundir import JsonlLog, WriteGuard
from k3load.sampler.cpu_wait import CpuWaitMeter
from k3load.sampler.fetch import Fetched, fetch, health_url_for, redact_url, same_origin
from k3load.sampler.gpu_poll import DcgmPoller, NvmlPoller
from k3load.sampler.health import HealthWatch
from k3load.sampler.logtail import LogTail
from k3load.sampler.promapi import PrometheusReader
from k3load.sampler.scrape import MetricsWatch

MAX_ERROR_EVENTS = 20  # per loop: a bug that fails every tick must not flood events.jsonl
PROMETHEUS_MIN_POLL_S = 2.0  # a shared Prometheus is asked at most every 2 s (each answer holds every step)


class CpuMeter:
    """CPU used by this whole process (all threads and greenlets) per wall second, in percent of one core.

    Why: a saturated load generator inflates every latency it measures; the analysis flags runs where
    this stays near 100 (one core is all a gevent process gets). Covers this process only: Locust
    workers started with --processes are separate processes.
    """

    MIN_WINDOW_S = 0.05  # the first tick comes right after start(): too short a window to mean anything

    def __init__(self) -> None:
        self._wall, self._cpu = time.monotonic(), time.process_time()

    def read(self) -> float | None:
        """None for a window too short to mean anything (right after start(), or a tick that came just after a
        late one); that window is not dropped: the next reading covers it."""
        wall, cpu = time.monotonic(), time.process_time()
        elapsed = wall - self._wall
        if elapsed < self.MIN_WINDOW_S:
            return None
        value = round((cpu - self._cpu) / elapsed * 100, 1)
        self._wall, self._cpu = wall, cpu
        return value


class Periodic:
    """Calls `tick()` every `interval_s` until `stop` is set, then once more (the final reading)."""

    def __init__(self, name: str, interval_s: float, tick: Callable[[], None], stop: threading.Event,
                 on_error: Callable[[str, BaseException], None]) -> None:
        self.name, self.interval_s, self._tick, self._stop, self._on_error = name, interval_s, tick, stop, on_error
        self.thread = threading.Thread(target=self._run, name=f"k3load-sampler-{name}", daemon=True)

    def _run(self) -> None:
        due = time.monotonic()
        while True:
            final = self._stop.is_set()
            try:
                self._tick()
            except Exception as exc:  # a bad tick is recorded; the loop goes on
                self._on_error(self.name, exc)
            if final:
                return
            due += self.interval_s
            now = time.monotonic()
            due = max(due, now)  # late: skip the missed ticks rather than burst
            self._stop.wait(due - now)


class Sampler:
    """Samples a vLLM server (and its GPUs) into a run directory until `stop()`.

    `metrics_url`: one /metrics URL or several (a gateway's replicas, data-parallel ranks), each scraped by
    its own loop so a slow one never delays another; None or []: no direct scrape (GPUs only, or only
    Prometheus). `health_url`: the API's /health (default: next to the first metrics URL), polled by a
    loop of its own. `prometheus_url` (+ `prometheus_selector`): read the vllm:* series back from a
    Prometheus (k3load/sampler/promapi.py). `nvml`: None (off), "auto" (the real pynvml when it loads and
    finds a driver) or a library object (tests). `api_key` goes as a bearer header only to URLs on the
    same scheme, host and port as `health_url` (the target itself: its /metrics and /health), never to
    another replica, a dcgm-exporter or Prometheus, and never to disk; `headers` (a gateway's) go with it.
    `tls`: the run's TLS trust for every https URL (a private CA bundle, or no verification). `events`:
    share the locust layer's events.jsonl writer (default: open DIR/events.jsonl). `timeout_s`: per
    request (default: the interval, at least 2 s, at most 10 s); `stop()` returns within about twice
    that plus the log tail's few seconds (Prometheus's final read has `timeout_s` more). `guard`
    (k3load.rundir.WriteGuard): where a write that fails goes (a full disk: the run stops), for every file
    the sampler writes; without one such a write raises in the loop that made it (a `sampler_error`).
    """

    def __init__(self, out_dir: Path | str, metrics_url: str | Sequence[str] | None,
                 gpu_metrics_urls: Sequence[str] = (), interval_s: float = 1.0, nvml: Any = None,
                 server_log: Path | str | None = None, server_log_cmd: str | list[str] | None = None,
                 api_key: str | None = None, clock: Callable[[], float] = time.time, *,
                 timeout_s: float | None = None, health_url: str | None = None, events: JsonlLog | None = None,
                 prometheus_url: str | None = None, prometheus_selector: str = "",
                 headers: Mapping[str, str] | None = None, tls: Tls | None = None,
                 guard: WriteGuard | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")  # the CLIs name their option first
        if server_log is not None and server_log_cmd is not None:
            raise ValueError("give server_log or server_log_cmd, not both")
        urls = [metrics_url] if isinstance(metrics_url, str) else list(metrics_url or [])
        self.out_dir, self.metrics_urls = Path(out_dir), list(dict.fromkeys(u for u in urls if u))
        self.metrics_url = self.metrics_urls[0] if self.metrics_urls else None
        self.gpu_metrics_urls = list(dict.fromkeys(gpu_metrics_urls))
        self.interval_s, self.nvml, self.clock = interval_s, nvml, clock
        self.server_log = Path(server_log) if server_log is not None else None
        self.server_log_cmd = server_log_cmd
        self.timeout_s = timeout_s or min(10.0, max(2.0, interval_s))
        self.health_url = health_url or (health_url_for(self.metrics_url) if self.metrics_url else None)
        self.prometheus_url, self.prometheus_selector = prometheus_url or None, prometheus_selector or ""
        self._api_key, self._shared_events, self._headers = api_key, events, dict(headers or {})
        self._tls, self._guard = tls, guard
        self._stop = threading.Event()
        self._loops: list[Periodic] = []
        self._errors: dict[str, int] = {}
        self._redirects_said: set[tuple[str, str, str]] = set()
        self._redirects_lock = threading.Lock()
        self.gpu_rows = 0
        self.started = False

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> Sampler:
        if self.started:
            raise RuntimeError("a Sampler starts once")
        self.started = True
        make_run_dir(self.out_dir)  # 0700, its files 0600 (k3load.private_files)
        guard = self._guard
        self._events = self._shared_events or JsonlLog(self.out_dir / "events.jsonl", guard=guard)
        self._metrics_log = JsonlLog(self.out_dir / METRICS, encode=SeriesTable().encode, guard=guard)
        self._gpu_log = JsonlLog(self.out_dir / "gpu.jsonl", guard=guard)
        self.event(Event.SAMPLER_START, self.clock(), **self._describe())
        self._start_gpu()
        self._watches = [self._start_metrics(url, first=i == 0) for i, url in enumerate(self.metrics_urls)]
        self._health = self._start_health(self.health_url) if self.health_url else None
        self._prometheus = self._start_prometheus() if self.prometheus_url else None
        self._logtail = self._make_logtail()
        for loop in self._loops:
            loop.thread.start()
        if self._logtail is not None:
            self._logtail.start()
        return self

    def stop(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop every loop (each takes one final reading), close the files; returns the counts."""
        if not self.started or self._stop.is_set():
            return {}
        self._stop.set()
        extra = self.timeout_s if self._prometheus is not None else 0.0
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 2 * self.timeout_s + 3 + extra)
        for loop in self._loops:
            loop.thread.join(max(0.0, deadline - time.monotonic()))
        if self._logtail is not None:
            self._logtail.stop()
        if self._nvml is not None:
            self._nvml.close()
        summary = self.summary()
        self.event(Event.SAMPLER_STOP, self.clock(), **summary)
        for log in (self._metrics_log, self._gpu_log) + (() if self._shared_events else (self._events,)):
            log.close()
        return summary

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- pieces ----------------------------------------------------------------------------------------
    def _fetch(self, url: str, with_key: bool) -> Fetched:
        """One GET; the key only when asked for and only to the target's own scheme, host and port (a
        redirect elsewhere goes without it: k3load.sampler.fetch), each redirect said once."""
        target = with_key and same_origin(url, self.health_url or self.metrics_url)
        context = self._tls.context(gevent_patched()) if self._tls is not None and url.startswith("https:") else None
        got = fetch(url, self.timeout_s, self._api_key if target else None, headers=self._headers if target else None,
                    context=context)
        for hop in got.redirects:
            self._redirected(url, hop.to_origin, hop.http_status, hop.action)
        return got

    def _redirected(self, url: str, to_origin: str, status: int, action: str) -> None:
        """One `redirect` event per source (its URL without credentials or query), origin and action."""
        source = redact_url(url).split("?", 1)[0]
        key = (source, to_origin, action)
        with self._redirects_lock:  # the loops are threads outside Locust: one check-and-add at a time
            if key in self._redirects_said:
                return
            self._redirects_said.add(key)
        self.event(Event.REDIRECT, self.clock(), source=source, to_origin=to_origin, http_status=status,
                   action=action)

    def _start_gpu(self) -> None:
        self._nvml = NvmlPoller(self.nvml, self.gpu, self.event, self.clock) if self.nvml is not None else None
        if self._nvml is not None and self._nvml.available:
            self._add_loop("nvml", lambda: self._nvml.tick(self.clock()))  # type: ignore[union-attr]
        for url in self.gpu_metrics_urls:
            if url in self.metrics_urls:
                continue  # read from the same body by that source's metrics loop
            # No API key: a dcgm-exporter is another service; the vLLM key must not travel to it.
            poller = DcgmPoller(url, partial(self._fetch, with_key=False), self.gpu, self.event)
            self._add_loop(poller.name, partial(self._tick_now, poller.tick))

    def _start_metrics(self, metrics_url: str, first: bool) -> MetricsWatch:
        """One source, one loop, its own CPU window (so each line's CPU covers that loop's interval)."""
        notice: tuple[str | None, str] | None = None  # what to say if the first body has no DCGM_FI_* series either
        if metrics_url in self.gpu_metrics_urls:
            notice = (f"dcgm:{redact_url(metrics_url)}", "no DCGM_FI_* series at this URL")
        elif first and self._nvml is None and not self.gpu_metrics_urls:
            notice = (None, "no GPU telemetry: NVML off, no dcgm-exporter URL, no DCGM_FI_* series on /metrics")
        watch = MetricsWatch(metrics_url, partial(self._fetch, with_key=True), self._metrics_log, self.event, self.gpu,
                             no_gpu_notice=notice)
        cpu, wait = CpuMeter(), CpuWaitMeter()
        name = "metrics" if len(self.metrics_urls) == 1 else f"metrics:{watch.source}"
        self._add_loop(name, lambda: watch.tick(self.clock(), cpu.read(), wait.read()))
        return watch

    def _start_health(self, health_url: str) -> HealthWatch:
        """The API's /health, apart from every metrics source: a crash is the target's, not a replica's."""
        health = HealthWatch(health_url, self.event, redact_url(health_url))
        self._add_loop("health", lambda: health.observe(self._fetch(health_url, with_key=True), self.clock()))
        return health

    def _start_prometheus(self) -> PrometheusReader:
        assert self.prometheus_url is not None
        reader = PrometheusReader(self.prometheus_url, self.prometheus_selector, self.clock(), self.interval_s,
                                  partial(self._fetch, with_key=False), self._metrics_log, self.event,
                                  final_budget_s=self.timeout_s)
        self._add_loop("prometheus", lambda: reader.tick(self.clock(), final=self._stop.is_set()),
                       max(self.interval_s, PROMETHEUS_MIN_POLL_S))
        return reader

    def _make_logtail(self) -> LogTail | None:
        if self.server_log is None and self.server_log_cmd is None:
            return None
        return LogTail(self.out_dir / "server.log", self.event, self.clock, path=self.server_log,
                       cmd=self.server_log_cmd, guard=self._guard)

    def _tick_now(self, tick: Callable[[float], object]) -> None:
        """A loop's tick at this sampler's clock's time."""
        tick(self.clock())

    def _add_loop(self, name: str, tick: Callable[[], None], interval_s: float | None = None) -> None:
        self._loops.append(Periodic(name, interval_s or self.interval_s, tick, self._stop, self._loop_error))

    def _loop_error(self, loop: str, exc: BaseException) -> None:
        self._errors[loop] = self._errors.get(loop, 0) + 1
        if self._errors[loop] <= MAX_ERROR_EVENTS:
            self.event(Event.SAMPLER_ERROR, self.clock(), loop=loop, error=f"{type(exc).__name__}: {exc}"[:500])

    # -- sinks -----------------------------------------------------------------------------------------
    def event(self, name: Event, ts: float, /, **fields: Any) -> None:
        """One events.jsonl line, shaped like JsonlLog.event but stamped with `ts` (k3load.events.EventSink);
        a name not in the catalogue raises ValueError, a late write after stop() is dropped."""
        record = {"ts": ts, "event": Event(name).value, **fields}
        with contextlib.suppress(ValueError):  # closed: a late write after stop() has nowhere to go
            self._events.append(record)

    def gpu(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._gpu_log.append(row)
        self.gpu_rows += len(rows)

    def flush(self, settle_s: float | None = None) -> None:
        """Every scrape begun before the call readable from metrics.jsonl.gz on return: a scrape under way is
        waited for (at most `settle_s`, by default the scrape's own timeout: it has ended by then, answered or
        failed, however slow the server's /metrics), then the compressed log flushed (it reaches its file at most
        every half second otherwise). Why: a live search decides a step on the scrapes it reads from the file,
        the analysis later on every scrape stamped within the step; without it the decision missed the step's
        last scrapes and the capacity plan judged the same step on more (a rate step past capacity on 6 of 11
        scrapes queued, held on 6 of 12). One interval was the bound before: a /metrics slower than the interval
        (a busy API server answers in seconds) still left a decision without the step's last scrape. Never
        raises (a failed write goes to the run's guard)."""
        if not self.started or self._stop.is_set():
            return
        asked, deadline = self.clock(), time.monotonic() + (self.timeout_s if settle_s is None else settle_s)
        while any(w.reading_since is not None and w.reading_since <= asked for w in self._watches) \
                and time.monotonic() < deadline:
            time.sleep(0.005)  # a scrape's fetch is I/O: under gevent this yields to it
        self._metrics_log.flush()

    def summary(self) -> dict[str, Any]:
        """Totals over the direct sources (and each source's own), Prometheus's reading, health, GPUs, log."""
        tail, health, prometheus = self._logtail, self._health, self._prometheus
        return {"scrapes": sum(w.scrapes for w in self._watches),
                "scrape_failures": sum(w.failures for w in self._watches),
                "sources": {w.source: {"scrapes": w.scrapes, "failures": w.failures} for w in self._watches},
                "prometheus": prometheus.summary() if prometheus else None,
                "gpu_rows": self.gpu_rows, "health_transitions": health.transitions if health else 0,
                "loop_errors": dict(self._errors),
                "log_lines": tail.lines if tail else None, "log_flags": dict(tail.flagged) if tail else None}

    def _describe(self) -> dict[str, Any]:
        """What sampled what: URLs without credentials, the log command's program only (args may hold tokens)."""
        program = command_program(self.server_log_cmd)
        metrics, health = self.metrics_url, self.health_url
        return {"metrics_url": redact_url(metrics) if metrics else None,
                "metrics_urls": [redact_url(u) for u in self.metrics_urls],
                "health_url": redact_url(health) if health else None,
                "prometheus_url": redact_url(self.prometheus_url) if self.prometheus_url else None,
                "prometheus_selector": self.prometheus_selector or None,
                "gpu_metrics_urls": [redact_url(u) for u in self.gpu_metrics_urls], "interval_s": self.interval_s,
                "timeout_s": self.timeout_s, "nvml": None if self.nvml is None else "auto" if self.nvml == "auto"
                else "injected", "server_log": str(self.server_log) if self.server_log else None,
                "server_log_cmd_program": program, "api_key": "set" if self._api_key else None,
                "headers": sorted(self._headers) or None, "tls": self._tls.describe() if self._tls else None,
                "host": socket.gethostname(), "pid": os.getpid()}
