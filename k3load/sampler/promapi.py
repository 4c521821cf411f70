"""The engine's `vllm:*` series read back from a Prometheus that already scrapes the fleet.

Why: behind a gateway (only /v1 forwarded), with many replicas or data-parallel ranks, the engines'
/metrics may be out of the load generator's reach while the cluster's Prometheus scrapes each of them.
Its HTTP query API (`/api/v1/query_range`) gives the same series over the run's window; each answer is
rebuilt into the metrics.jsonl line a direct scrape writes (same keys: `prom.rebuild`), one line per
(evaluation timestamp, `instance`) with `"source": "prometheus:<instance>"`, and fed through the same
`MetricsWatch.take`, so `cache_config`, `metrics_missing` and `counter_reset` come out as they do there.

Why live and a few seconds behind: every tick asks for the grid points (start + k × step) that are at
least `settle_s` old — by then Prometheus has ingested every scrape stamped before them, so a point once
written never changes — and the final tick at stop reads up to the stop time. Bounds: one query per tick
and one answer in memory, at most `MAX_POINTS` points per series (Prometheus refuses more than 11,000)
and about `VALUE_BUDGET` values per answer (the points per query shrink as the fleet's series grow);
a backlog (Prometheus down a while) is caught up one chunk per tick, and what the final tick cannot read
in its time is said as `prometheus_incomplete`. An unreachable or failing Prometheus is one
`prometheus_error` event per spell (then `prometheus_back`) and `ok: false` lines, never an exception.

The target's API key never goes to Prometheus (another service).
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from k3load.events import Event, EventSink
from k3load.rundir import JsonlLog
from k3load.sampler.fetch import Fetched, redact_url
from k3load.sampler.prom import number, rebuild
from k3load.sampler.scrape import MetricsWatch

QUERY_PATH = "/api/v1/query_range"
NAMES = "vllm:.+|up|process_start_time_seconds"  # up: Prometheus's own "the target answered" per instance
TARGET_LABELS = ("instance", "job")  # Prometheus's own labels: dropped so keys read as a direct scrape's
MAX_POINTS = 10_000
VALUE_BUDGET = 200_000
FIRST_SERIES_GUESS = 1_000
SETTLE_S = 5.0
SOURCE_PREFIX = "prometheus:"

Series = list[tuple[str, dict[str, str], float | None]]  # (name, labels, value) of one instance at one ts


def query_expr(selector: str = "") -> str:
    """`{__name__=~"vllm:.+|up|process_start_time_seconds",job="vllm"}`; the selector with or without braces."""
    extra = selector.strip().removeprefix("{").removesuffix("}").strip().strip(",")
    return "{" + f'__name__=~"{NAMES}"' + (f",{extra}" if extra else "") + "}"


def query_url(base_url: str, expr: str, start_ts: float, end_ts: float, step_s: float) -> str:
    params = {"query": expr, "start": f"{start_ts:.3f}", "end": f"{end_ts:.3f}", "step": f"{step_s:g}"}
    return base_url.rstrip("/") + QUERY_PATH + "?" + urllib.parse.urlencode(params)


def answer_series(text: str) -> list[dict[str, Any]]:
    """The `result` of a query_range answer (a matrix); ValueError, with Prometheus's words, otherwise."""
    try:
        answer = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(answer, dict):
        raise ValueError("not a Prometheus API answer")
    if answer.get("status") != "success":
        raise ValueError(f"{answer.get('errorType') or 'error'}: {answer.get('error') or 'no reason given'}")
    data = answer.get("data") or {}
    if data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
        raise ValueError(f"expected a matrix, got {data.get('resultType')!r}")
    return data["result"]


def by_time_and_instance(result: list[dict[str, Any]]) -> dict[float, dict[str, Series]]:
    """{ts: {instance: [(name, labels without __name__/instance/job, value)]}} from a matrix."""
    grouped: dict[float, dict[str, Series]] = {}
    for series in result:
        labels = dict(series.get("metric") or {})
        name, instance = labels.pop("__name__", ""), labels.get("instance", "")
        for key in TARGET_LABELS:
            labels.pop(key, None)
        for ts, raw in series.get("values") or []:
            grouped.setdefault(round(float(ts), 3), {}).setdefault(instance, []).append((name, labels, number(raw)))
    return grouped


class PrometheusReader:
    """Reads the run's window in grid steps from `start_ts`; one `MetricsWatch` per instance seen."""

    def __init__(self, url: str, selector: str, start_ts: float, step_s: float,
                 fetcher: Callable[[str], Fetched], lines: JsonlLog, event: EventSink, *,
                 settle_s: float = SETTLE_S, final_budget_s: float = 10.0) -> None:
        self.url, self.source, self.expr = url, redact_url(url), query_expr(selector)
        self.start_ts = math.floor(start_ts * 1000) / 1000  # on the ms grid of the answers, never after start
        self.step_s, self.settle_s, self.final_budget_s = step_s, settle_s, final_budget_s
        self._fetch, self._lines, self._event = fetcher, lines, event
        self.next_k = 0  # the next grid point to read: start_ts + next_k * step_s
        self.watches: dict[str, MetricsWatch] = {}
        self.series_guess = FIRST_SERIES_GUESS
        self.error: str | None = None
        self.queries = self.failures = 0

    def tick(self, now: float, final: bool = False) -> None:
        """Live: one chunk up to `now - settle_s`. Final: chunks up to `now` while time allows."""
        if not final:
            self._chunk(now, now - self.settle_s)
            return
        deadline = time.monotonic() + self.final_budget_s
        while self._chunk(now, now) and time.monotonic() < deadline:
            pass
        if self._grid(self.next_k) <= now:
            self._event(Event.PROMETHEUS_INCOMPLETE, now, source=self.source, unread_from_ts=self._grid(self.next_k),
                        unread_to_ts=now, reason=self.error or f"not read within {self.final_budget_s:g} s at stop")

    def _grid(self, k: int) -> float:
        return round(self.start_ts + k * self.step_s, 3)

    def _chunk(self, now: float, end_ts: float) -> bool:
        """Read the next chunk ending at or before `end_ts`; True when it was read and more remains."""
        if self._grid(self.next_k) > end_ts:
            return False
        points = min(MAX_POINTS, max(1, VALUE_BUDGET // self.series_guess))
        last_k = min(self.next_k + points - 1, math.floor((end_ts - self.start_ts) / self.step_s + 1e-9))
        grouped = self._query(now, self._grid(self.next_k), self._grid(last_k))
        if grouped is None:
            return False
        self._write(grouped)
        self.next_k = last_k + 1
        return self._grid(self.next_k) <= end_ts

    def _query(self, now: float, start_ts: float, end_ts: float) -> dict[float, dict[str, Series]] | None:
        self.queries += 1
        result = self._fetch(query_url(self.url, self.expr, start_ts, end_ts, self.step_s))
        try:
            if not result.ok:
                detail = _error_words(result.body)
                raise ValueError(f"{result.error}: {detail}" if detail else result.error or "failed")
            series = answer_series(result.body)
            grouped = by_time_and_instance(series)
        except (ValueError, TypeError, AttributeError) as exc:
            self._failed(now, str(exc)[:300], result.status)
            return None
        self.series_guess = max(1, len(series))
        if self.error is not None:
            self._event(Event.PROMETHEUS_BACK, now, source=self.source, down_reason=self.error)
            self.error = None
        return grouped

    def _write(self, grouped: dict[float, dict[str, Series]]) -> None:
        for ts in sorted(grouped):
            for instance in sorted(grouped[ts]):
                readings = grouped[ts][instance]
                up = next((value for name, _labels, value in readings if name == "up"), None)
                watch = self._watch(instance)
                base = {"ts": ts, "source": watch.source, "ok": True, "scrape_ms": None,
                        "load_generator_cpu_pct": None}
                if up == 0:
                    watch.fail({**base, "ok": False}, "up=0: Prometheus's own scrape of this target failed", None)
                else:
                    watch.take(rebuild(readings), base, ts)

    def _watch(self, instance: str) -> MetricsWatch:
        if instance not in self.watches:
            source = SOURCE_PREFIX + instance
            self.watches[instance] = MetricsWatch(source, None, self._lines, self._event, source=source)
        return self.watches[instance]

    def _failed(self, now: float, reason: str, status: int | None) -> None:
        """Said once per spell; an `ok: false` line per instance known (or one for Prometheus itself)."""
        self.failures += 1
        if self.error is None:
            self._event(Event.PROMETHEUS_ERROR, now, source=self.source, reason=reason, http_status=status)
        self.error = reason
        base = {"ts": now, "ok": False, "scrape_ms": None, "load_generator_cpu_pct": None}
        for watch in self.watches.values() or [self._watch_for_errors()]:
            watch.fail({**base, "source": watch.source}, f"prometheus: {reason}", status)

    def _watch_for_errors(self) -> MetricsWatch:
        """No instance known yet: the failure is written under the Prometheus URL itself."""
        source = SOURCE_PREFIX + self.source
        return MetricsWatch(source, None, self._lines, self._event, source=source)

    def summary(self) -> dict[str, Any]:
        return {"url": self.source, "queries": self.queries, "query_failures": self.failures,
                "instances": sorted(self.watches), "lines": sum(w.scrapes for w in self.watches.values()),
                "read_to_ts": self._grid(self.next_k - 1) if self.next_k else None}


def _error_words(body: str) -> str:
    """Prometheus's `error` field from an error answer ("exceeded maximum resolution ..."), else ''."""
    try:
        answer = json.loads(body)
    except ValueError:
        return body.strip()[:200]
    if not isinstance(answer, dict) or not answer.get("error"):
        return ""
    return f"{answer.get('errorType') or 'error'}: {answer['error']}"[:200]
