"""One vLLM `/metrics` endpoint over time: a metrics.jsonl line per scrape, events when something changes.

Why stateful here and pure in prom.py: what the verdict needs from a *sequence* of scrapes is the
changes — a counter that went down (server restart: deltas must restart from zero, never go
negative), the engine's gauges vanishing (`--disable-log-stats`: "metrics missing", never zeros, even
though vLLM 0.32 keeps serving its tool-parser counter, which is still written), the cache
geometry (`vllm:cache_config_info`: block size, KV capacity) — and those are said once, as events,
while each line stays self-contained (a full snapshot) so the analysis can subtract any two lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3load.events import Event, EventSink
from k3load.rundir import JsonlLog
from k3load.sampler.dcgm import dcgm_rows
from k3load.sampler.fetch import Fetched, redact_url
from k3load.sampler.prom import REQUIRED_SERIES, Parsed, absent_required, counter_resets, parse, series_names
from k3load.sampler.vllm_metrics import VllmMetric

GpuSink = Callable[[list[dict[str, Any]]], None]
RESET_EXAMPLES = 5
REMAINING_EXAMPLES = 3


class MetricsWatch:
    """Scrape, parse, write; remembers only the previous scrape (memory stays one body's worth)."""

    def __init__(self, url: str, fetcher: Callable[[str], Fetched] | None, lines: JsonlLog, event: EventSink,
                 gpu_sink: GpuSink | None = None, no_gpu_notice: tuple[str | None, str] | None = None, *,
                 source: str | None = None) -> None:
        self.url = url
        self.source = source or redact_url(url)
        self._fetch, self._lines, self._event, self._gpu_sink = fetcher, lines, event, gpu_sink
        self._no_gpu_notice = no_gpu_notice  # (source, reason), said once if the first body has no DCGM_FI_*
        self.previous: dict[str, float | None] = {}
        self.monotonic: set[str] = set()
        self.types: dict[str, str] | None = None
        self.infos: dict[str, list[dict[str, str]]] = {}
        self.process_start_ts: float | None = None
        self.missing = False
        self.scrapes = self.failures = 0
        self.reading_since: float | None = None  # the `ts` of the scrape under way (Sampler.flush waits for it)

    def tick(self, ts: float, cpu_pct: float | None, cpu_wait_pct: float | None = None) -> None:
        if self._fetch is None:
            raise RuntimeError(f"{self.source}: fed by another reader (take/fail), it has no fetcher")
        self.reading_since = ts
        try:
            self._read(ts, cpu_pct, cpu_wait_pct)
        finally:
            self.reading_since = None

    def _read(self, ts: float, cpu_pct: float | None, cpu_wait_pct: float | None) -> None:
        assert self._fetch is not None
        result = self._fetch(self.url)
        base = {"ts": ts, "source": self.source, "ok": result.ok, "scrape_ms": result.elapsed_ms,
                "load_generator_cpu_pct": cpu_pct, "load_generator_cpu_wait_pct": cpu_wait_pct}
        if not result.ok:
            self.fail(base, result.error or "failed", result.status)
            return
        try:
            parsed = parse(result.body)
        except ValueError as exc:  # not the Prometheus text format (an HTML error page, garbage)
            self.fail({**base, "ok": False}, f"parse error: {exc}"[:300], result.status)
            return
        self._gpu(parsed, ts)
        self.take(parsed, base, ts)

    def take(self, parsed: Parsed, base: dict[str, Any], ts: float) -> None:
        """One reading already parsed (a scrape here, or a Prometheus query rebuilt as one): the line and
        the events. Why public: the Prometheus path feeds the same code so its events are the same."""
        self.scrapes += 1
        absent = absent_required(parsed)
        if parsed.vllm_series == 0:
            self._missing(ts, parsed, absent)
            self._lines.append({**base, "vllm_series": 0, "samples": {}, "legacy": {}, "process_start_ts": None})
            return
        if absent:
            self._missing(ts, parsed, absent)  # the series that are there are still written: never thrown away
        elif self.missing:
            self.missing = False
            self._event(Event.METRICS_BACK, ts, source=self.source, vllm_series=parsed.vllm_series)
        self._present(parsed, ts)
        self._lines.append(self._line(base, parsed))
        self.previous, self.monotonic = parsed.samples, parsed.monotonic

    def fail(self, base: dict[str, Any], error: str, status: int | None) -> None:
        """A reading that did not happen: an `ok: false` line with the reason."""
        self.scrapes += 1
        self.failures += 1
        self._lines.append({**base, "error": error, "http_status": status})

    def _missing(self, ts: float, parsed: Parsed, absent: list[str]) -> None:
        """The engine's gauges are not on /metrics: said once per spell, naming what is absent."""
        if not self.missing:
            self.missing = True
            self._event(Event.METRICS_MISSING, ts, source=self.source, reason=missing_reason(parsed, absent),
                        absent=absent, vllm_series=parsed.vllm_series)

    def _present(self, parsed: Parsed, ts: float) -> None:
        self._resets(parsed, ts)
        for family, label_sets in sorted(parsed.infos.items()):
            if self.infos.get(family) != label_sets:
                name = Event.CACHE_CONFIG if family == VllmMetric.CACHE_CONFIG_INFO else Event.VLLM_INFO
                self._event(name, ts, source=self.source, family=family, labels=label_sets)
        self.infos = parsed.infos

    def _resets(self, parsed: Parsed, ts: float) -> None:
        down = counter_resets(self.previous, parsed.samples, self.monotonic | parsed.monotonic)
        restarted = (self.process_start_ts is not None and parsed.process_start_ts is not None
                     and parsed.process_start_ts > self.process_start_ts)
        if down or restarted:
            self._event(Event.COUNTER_RESET, ts, source=self.source, series_down=len(down),
                        examples=sorted(down)[:RESET_EXAMPLES], process_start_ts_before=self.process_start_ts,
                        process_start_ts_after=parsed.process_start_ts)
        if parsed.process_start_ts is not None:
            self.process_start_ts = parsed.process_start_ts

    def _line(self, base: dict[str, Any], parsed: Parsed) -> dict[str, Any]:
        line = {**base, "vllm_series": parsed.vllm_series, "samples": parsed.samples, "legacy": parsed.legacy,
                "process_start_ts": parsed.process_start_ts}
        if parsed.types and parsed.types != self.types:  # the query API has no types: none, never made up
            line["types"] = parsed.types
            self.types = parsed.types
        return line

    def _gpu(self, parsed: Parsed, ts: float) -> None:
        """dcgm-style gauges on the same body (the sim serves them; so would a federating proxy)."""
        if parsed.dcgm and self._gpu_sink is not None:
            self._gpu_sink(dcgm_rows(parsed.dcgm, ts, self.source))
        elif self._no_gpu_notice is not None:
            source, reason = self._no_gpu_notice
            self._event(Event.GPU_UNAVAILABLE, ts, source=source, reason=reason)
        self._no_gpu_notice = None


def missing_reason(parsed: Parsed, absent: list[str]) -> str:
    """What is absent and what few vllm:* series remain, e.g. 'no vllm:num_requests_running / ... on
    /metrics (only 12 vllm:tool_call_parser_invocations_total series): vLLM started with --disable-log-stats?'"""
    if parsed.vllm_series == 0:
        return "no vllm:* series on /metrics (vLLM started with --disable-log-stats?)"
    remaining = series_names(parsed)
    shown = [f"{count} {name}" for name, count in list(remaining.items())[:REMAINING_EXAMPLES]]
    if len(remaining) > REMAINING_EXAMPLES:
        shown.append(f"{len(remaining) - REMAINING_EXAMPLES} more names")
    what = f"{shown[0]} series" if len(remaining) == 1 else f"{parsed.vllm_series} vllm:* series: {', '.join(shown)}"
    if len(absent) == len(REQUIRED_SERIES):
        return f"no {' / '.join(absent)} on /metrics (only {what}): vLLM started with --disable-log-stats?"
    return f"no {' / '.join(absent)} on /metrics ({what}): renamed in this vLLM version?"
