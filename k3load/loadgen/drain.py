"""The drain window at the end of each plan stage: the users stop, then the server's own gauges are
polled until nothing runs or waits, at most `resources.max_drain_s` (the plan's threshold).

Why a window: stages follow one another without a gap, so the server never has to be idle while the
harness looks, and a request the server keeps decoding for a client that left (a gateway that does
not pass the disconnect on) hides among live ones. With every client of the stage gone, whatever the
server still runs, or still generates, is for nobody. The window is cheap: the users finish their
current turn (Locust's --stop-timeout, as a change of family mix always did), then a healthy server
reads 0 at the first poll. The plan's clock stands still while the users leave (k3load.loadgen.shape)
and while the server is polled, so a server that does not drain delays the next stage by the bound,
never eats it.

Not between the steps of one ramp (a plan's concurrency `steps`, told by `Stage.step_of`): a ramp that fell
to zero users between steps would no longer be a ramp; its drain comes after its last step.

Writes one `stage_drain` event per window (events.jsonl), the readings being the server's own:
    stage, users_stopped_ts (every client of the stage had left), bound_s, waited_s, polls,
    drained (true / false / null: metrics missing), first and last reading, each
    {ts, running, waiting, kv_usage, generation_tokens, aborted} (None where a series is absent;
    counters summed over the metrics sources, kv_usage the worst source's), error (why no reading).
k3load.analysis.pillars.headroom.drain_audit judges them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import gevent

from k3load.client.access import gevent_patched
from k3load.events import Event
from k3load.loadgen.options import metrics_urls, run_access
from k3load.loadgen.target import TargetApi
from k3load.rundir import JsonlLog
from k3load.sampler.fetch import fetch, same_origin
from k3load.sampler.prom import parse, split_key
from k3load.sampler.vllm_metrics import VllmMetric
from k3load.workload.plan import Stage
from k3load.workload.stage_kind import StageKind

log = logging.getLogger("k3load")
POLL_S = 0.1
FETCH_TIMEOUT_S = 2.0
SERIES: dict[str, tuple[str, dict[str, str] | None]] = {
    "running": (VllmMetric.NUM_REQUESTS_RUNNING, None), "waiting": (VllmMetric.NUM_REQUESTS_WAITING, None),
    "kv_usage": (VllmMetric.KV_CACHE_USAGE, None), "generation_tokens": (VllmMetric.GENERATION_TOKENS_TOTAL, None),
    "aborted": (VllmMetric.REQUEST_SUCCESS_TOTAL, {"finished_reason": "abort"})}
Reading = dict[str, Any]


def reading_of(bodies: list[str], ts: float) -> Reading | None:
    """One reading over every source's body: counters and request counts summed, KV the worst source's
    (one replica at its limit is a limit); None when no body has the engine's running gauge."""
    out: Reading = {"ts": ts} | {key: None for key in SERIES}
    for body in bodies:
        try:
            samples = parse(body).samples
        except ValueError:
            continue
        for key, (name, match) in SERIES.items():
            values = [v for k, v in samples.items() if v is not None and _matches(k, name, match)]
            if not values:
                continue
            total = sum(values)
            out[key] = max(out[key] or 0.0, total) if key == "kv_usage" else (out[key] or 0.0) + total
    return out if out["running"] is not None else None


def _matches(key: str, name: str, match: dict[str, str] | None) -> bool:
    sample, labels = split_key(key)
    return sample == name and (not match or match.items() <= labels.items())


def same_ramp(old: Stage, new: Stage | None) -> bool:
    """Two steps of one concurrency `steps` stage (NAME-cN, NAME-cM: the same `step_of`): no drain between them."""
    return (new is not None and old.kind == new.kind == StageKind.CONCURRENCY and old.step_of is not None
            and old.step_of == new.step_of)


class StageDrain:
    """Master/local: the drain windows of one run, said into `events`. `read()` gives a Reading or None
    (`server_reader`'s on a run; tests inject one)."""

    def __init__(self, events: JsonlLog | None, bound_s: float, read: Callable[[], Reading | None],
                 poll_s: float = POLL_S, clock: Callable[[], float] = time.time) -> None:
        self.events, self.bound_s, self.poll_s, self.clock = events, bound_s, poll_s, clock
        self.read = read
        self.done: set[str] = set()
        self.paused_s = 0.0  # the plan's clock stood still this long (server polled after users stopped)

    def due(self, old: Stage | None, new: Stage | None) -> bool:
        """A window after `old` before `new` (None: the plan ended)."""
        return (old is not None and self.bound_s > 0 and old.name not in self.done
                and (new is None or new.name != old.name) and not same_ramp(old, new))

    def run(self, stage: Stage) -> dict[str, Any]:
        """Every user of `stage` has stopped: poll until running and waiting are 0 or the bound; say it."""
        self.done.add(stage.name)
        start = self.clock()
        first = last = self._safe_read()
        polls = 1
        while _busy(last) and self.clock() - start < self.bound_s:
            gevent.sleep(self.poll_s)
            last = self._safe_read()
            polls += 1
        waited = self.clock() - start
        self.paused_s += waited
        drained = None if first is None or last is None else not _busy(last)
        event = {"stage": stage.name, "users_stopped_ts": start, "bound_s": self.bound_s,
                 "waited_s": round(waited, 3), "polls": polls, "drained": drained, "first": first, "last": last}
        if first is None:
            event["error"] = f"no reading of {VllmMetric.NUM_REQUESTS_RUNNING} on /metrics"
        if self.events is not None:
            self.events.event(Event.STAGE_DRAIN, **event)
        if drained is False:
            log.warning("k3load: stage %s did not drain within %.0f s: %s running, %s waiting after every client "
                        "left", stage.name, self.bound_s, last["running"], last["waiting"])  # type: ignore[index]
        return event

    def _safe_read(self) -> Reading | None:
        try:
            return self.read()
        except Exception as exc:  # a drain that cannot read says so; it never stops the run
            log.warning("k3load: drain reading failed: %s", exc)
            return None


def server_reader(target: TargetApi, clock: Callable[[], float] = time.time) -> Callable[[], Reading | None]:
    """One reading of every metrics source of the run's target (its key and headers to its own origin only)."""
    def read() -> Reading | None:
        opts, host = target.options, target.host.rstrip("/")
        secrets, tls = run_access(opts)
        bodies = []
        for url in metrics_urls(opts, host):
            own = same_origin(url, f"{host}/health")
            context = tls.context(gevent_patched()) if url.startswith("https:") else None
            got = fetch(url, FETCH_TIMEOUT_S, secrets.api_key if own else None,
                        headers=dict(secrets.headers) if own else None, context=context)
            if got.ok:
                bodies.append(got.body)
        return reading_of(bodies, clock())

    return read


def _busy(reading: Reading | None) -> bool:
    """Still running or waiting (a reading without the waiting gauge is judged on running alone)."""
    return reading is not None and ((reading["running"] or 0) > 0 or (reading["waiting"] or 0) > 0)
