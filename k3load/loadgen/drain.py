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

Not between the steps of one ramp (`steps`: NAME-cN): a ramp that fell to zero users between steps
would no longer be a ramp; its drain comes after its last step.

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
from typing import TYPE_CHECKING, Any

import gevent

from k3load.client.access import gevent_patched
from k3load.events import Event
from k3load.loadgen.options import metrics_urls, run_access
from k3load.sampler.fetch import fetch, same_origin
from k3load.sampler.prom import parse, split_key
from k3load.workload.plan import Stage

if TYPE_CHECKING:  # the session builds the drain: imported for the annotations only
    from k3load.loadgen.session import HarnessSession

log = logging.getLogger("k3load")
POLL_S = 0.1
FETCH_TIMEOUT_S = 2.0
SERIES = {"running": ("vllm:num_requests_running", None), "waiting": ("vllm:num_requests_waiting", None),
          "kv_usage": ("vllm:kv_cache_usage_perc", None),
          "generation_tokens": ("vllm:generation_tokens_total", None),
          "aborted": ("vllm:request_success_total", {"finished_reason": "abort"})}
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
    """Two steps of one `steps` stage (NAME-cN, NAME-cM): no drain between them."""
    return (new is not None and old.kind == new.kind == "concurrency" and "-c" in old.name and "-c" in new.name
            and old.name.rsplit("-c", 1)[0] == new.name.rsplit("-c", 1)[0])


class StageDrain:
    """Master/local: the drain windows of one run. `read()` gives a Reading or None (tests inject one)."""

    def __init__(self, session: HarnessSession, bound_s: float, read: Callable[[], Reading | None] | None = None,
                 poll_s: float = POLL_S, clock: Callable[[], float] = time.time) -> None:
        self.session, self.bound_s, self.poll_s, self.clock = session, bound_s, poll_s, clock
        self.read = read or self._read_server
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
            event["error"] = "no reading of vllm:num_requests_running on /metrics"
        if self.session.events is not None:
            self.session.events.event(Event.STAGE_DRAIN, **event)
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

    def _read_server(self) -> Reading | None:
        env = self.session.env
        opts, host = env.parsed_options, env.host.rstrip("/")
        secrets, tls = run_access(opts)
        bodies = []
        for url in metrics_urls(opts, host):
            own = same_origin(url, f"{host}/health")
            context = tls.context(gevent_patched()) if url.startswith("https:") else None
            got = fetch(url, FETCH_TIMEOUT_S, secrets.api_key if own else None,
                        headers=dict(secrets.headers) if own else None, context=context)
            if got.ok:
                bodies.append(got.body)
        return reading_of(bodies, self.clock())


def _busy(reading: Reading | None) -> bool:
    """Still running or waiting (a reading without the waiting gauge is judged on running alone)."""
    return reading is not None and ((reading["running"] or 0) > 0 or (reading["waiting"] or 0) > 0)
