"""The server's timeline from `metrics.jsonl.gz` (an older run's `metrics.jsonl`): counter deltas per
window, gauge statistics, histograms.

Why windows: counters are cumulative since the server started, so a run's figures are differences
between scrapes in the same window; a counter that goes down is a restart, whose new value counts
from zero (never a negative delta). A window with no scrape carrying vllm:* series says "metrics
missing" (None), never 0.

Why per source: an engine behind a gateway, several replicas or data-parallel ranks are scraped
separately (`--k3-metrics-url`, or a Prometheus); each line names its `source`. Counter deltas are
taken per source and summed (the fleet's work), gauges are judged per source (one replica at its KV
limit is a limit, whatever the others do). A delta that must cover a window exactly (the cache
control) needs a good scrape bracketing each edge of it on every source; `bracketed_delta` says why
not when there is none (a scrape that timed out, a gap), so the rule becomes inconclusive.
"""

from __future__ import annotations

import itertools
import statistics
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from k3load.analysis.run.rundata import gc_paused
from k3load.analysis.run.scrape_samples import Labels, Layouts, SampleLayout
from k3load.sampler.vllm_metrics import VllmMetric

EDGE_INTERVALS = 3  # a bracketing scrape may be this many scrape intervals away from the window's edge
MIN_EDGE_S = 2.5


_EMPTY = SampleLayout((), {})  # a scrape that carried no sample with a value


@dataclass(slots=True)
class Scrape:
    """One good scrape: its samples' layout (shared by every scrape that carried the same keys) and its values
    in the layout's grouped order (analysis/run/scrape_samples.py)."""

    ts: float
    layout: SampleLayout
    floats: Sequence[float]

    @property
    def series(self) -> dict[str, tuple[Labels, int, int]]:
        """Series name -> (its label sets in the order scraped, start, stop in `floats`)."""
        return self.layout.series


@dataclass
class Bracketed:
    """A counter's increase over a window, or why it is unknown (`missing` says it, value is None)."""

    value: float | None
    missing: str | None = None
    sources: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class QuantileBucket:
    """Where a histogram's q-quantile lies: in (low, high] of its buckets (high may be inf), of `count`."""

    q: float
    low: float
    high: float
    count: int

    def text(self, unit_ms: bool = True) -> str:
        scale, unit = (1000.0, "ms") if unit_ms else (1.0, "s")
        high = "+Inf" if self.high == float("inf") else f"{self.high * scale:g}"
        return f"p{self.q * 100:g} in ({self.low * scale:g}, {high}] {unit} of {self.count:,} observed"


def _le(text: str) -> float:
    """A bucket's upper bound as Prometheus writes it ("0.005", "+Inf")."""
    try:
        return float(text)
    except ValueError:
        return float("inf")


# Inside `shared_indexes()`, the index built of a list of lines: built again of the same (unchanged)
# list, it is the same index. Why: the verdict and the HTML report's plots each index the run's
# metrics, and at an hour of 1 Hz scrapes that is seconds and a million tuples each time.
_SHARED: ContextVar[dict[int, tuple[list[dict[str, Any]], int, MetricIndex]] | None] = ContextVar(
    "k3load_shared_metric_indexes", default=None)


@contextmanager
def shared_indexes() -> Iterator[None]:
    """One MetricIndex per metrics list within the block (one analysis); forgotten when it ends."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


class MetricIndex:
    """The ok scrapes of one run, indexed by series name once (keys are parsed a single time)."""

    def __new__(cls, lines: list[dict[str, Any]]) -> MetricIndex:
        shared = _SHARED.get()
        found = shared.get(id(lines)) if shared is not None else None
        if found is not None and found[0] is lines and found[1] == len(lines):
            return found[2]
        return super().__new__(cls)

    def __init__(self, lines: list[dict[str, Any]]) -> None:
        if "_times" in self.__dict__:
            return  # the shared index of these lines, already built
        self.scrapes: list[Scrape] = []  # every source, in time order
        self.by_source: dict[str, list[Scrape]] = defaultdict(list)
        self.failed: dict[str, list[tuple[float, str]]] = defaultdict(list)  # source -> [(ts, why)]
        self._layouts = Layouts()  # for lines whose samples are plain dicts (a run's are held as Samples already)
        with gc_paused():  # a few hundred series a scrape, an hour at 1 Hz: a million small tuples
            self._index(lines)
        # Each source's scrape times, when in order (a run's are): a window is then found by bisection
        # instead of a walk over the whole run, which every query of every stage paid.
        self._times: dict[str, list[float]] = {}
        for source, scrapes in self.by_source.items():
            times = [s.ts for s in scrapes]
            if all(a <= b for a, b in itertools.pairwise(times)):
                self._times[source] = times
        shared = _SHARED.get()
        if shared is not None:
            shared[id(lines)] = (lines, len(lines), self)

    def _index(self, lines: list[dict[str, Any]]) -> None:
        # A key is parsed once however many scrapes carry it, and a scrape's layout (its keys, their labels,
        # each name's place) is shared by every scrape with the same keys: an hour at 1 Hz repeats each of a
        # few hundred series 3,600 times. The labels are shared between scrapes and only ever read.
        layouts = self._layouts
        for line in lines:
            source = str(line.get("source") or "")
            if not line.get("ok"):
                self.failed[source].append((line.get("ts", 0.0), str(line.get("error") or "failed")))
                continue
            if not line.get("vllm_series"):
                continue
            view = layouts.index_view(line.get("samples"))
            scrape = Scrape(line["ts"], _EMPTY, ()) if view is None else Scrape(line["ts"], *view)
            self.scrapes.append(scrape)
            self.by_source[source].append(scrape)

    @property
    def sources(self) -> list[str]:
        return sorted(self.by_source)

    def present(self, t0: float, t1: float) -> bool:
        return any(t0 <= s.ts <= t1 for s in self.scrapes)

    def _total(self, scrape: Scrape, name: str, match: dict[str, str] | None) -> float | None:
        series = scrape.layout.series.get(name)
        if series is None:
            return None
        labels, start, stop = series
        if not match:
            return sum(scrape.floats[start:stop])
        wanted = match.items()
        return sum(v for labels, v in zip(labels, scrape.floats[start:stop], strict=True)
                   if wanted <= labels.items())

    def points(self, name: str, t0: float, t1: float, match: dict[str, str] | None = None,
               baseline: bool = False, source: str | None = None) -> list[tuple[float, float]]:
        """(ts, value summed over matching label sets) of one source (default: the first that has the
        series); with `baseline`, the last scrape before t0 too."""
        if source is None:
            source = next((s for s in self.sources if any(name in x.series for x in self.by_source[s])), "")
        scrapes = self.by_source.get(source, [])
        times = self._times.get(source)
        start, stop = (bisect_left(times, t0), bisect_right(times, t1)) if times is not None else (0, len(scrapes))
        out: list[tuple[float, float]] = []
        before: tuple[float, float] | None = None
        for scrape in scrapes[start:stop]:
            value = self._total(scrape, name, match)
            if value is None:
                continue
            if scrape.ts < t0:
                before = (scrape.ts, value)
            elif scrape.ts <= t1:
                out.append((scrape.ts, value))
        if baseline and before is None:  # in time order: the last scrape before t0 that has the series
            for scrape in reversed(scrapes[:start]):
                value = self._total(scrape, name, match)
                if value is not None:
                    before = (scrape.ts, value)
                    break
        return ([before] if baseline and before else []) + out

    def delta(self, name: str, t0: float, t1: float, match: dict[str, str] | None = None) -> float | None:
        """Increase of a counter (or histogram _sum/_count) over the window, restarts handled, summed
        over the sources that serve it."""
        values = [self._source_delta(name, t0, t1, match, s) for s in self.sources]
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    def _source_delta(self, name: str, t0: float, t1: float, match: dict[str, str] | None, source: str
                      ) -> float | None:
        points = self.points(name, t0, t1, match, baseline=True, source=source)
        if len(points) < 2:
            return None
        total = 0.0
        for (_, a), (_, b) in itertools.pairwise(points):
            total += b - a if b >= a else b  # went down: the server restarted and counts from zero
        return total

    def edge_s(self, source: str) -> float:
        """How far from a window's edge a scrape may be and still bracket it: a few of the source's
        scrape intervals (failed scrapes count for the cadence: they were attempted on time)."""
        times = sorted([s.ts for s in self.by_source.get(source, [])] + [ts for ts, _ in self.failed.get(source, [])])
        gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
        return max(MIN_EDGE_S, EDGE_INTERVALS * statistics.median(gaps)) if gaps else MIN_EDGE_S

    def bracketed_delta(self, name: str, t0: float, t1: float) -> Bracketed:
        """The counter's increase from a good scrape at or before t0 to one at or after t1, on every
        source serving it; unknown (with the reason) when an edge has no such scrape nearby."""
        sources = [s for s in self.sources if any(name in x.series for x in self.by_source[s])]
        if not sources:
            return Bracketed(None, f"{name} was never scraped", evidence=["metrics.jsonl"])
        total, gaps = 0.0, []
        for source in sources:
            edge = self.edge_s(source)
            series = [(x.ts, self._total(x, name, None)) for x in self.by_source[source]]
            before = [(ts, v) for ts, v in series if v is not None and t0 - edge <= ts <= t0]
            after = [(ts, v) for ts, v in series if v is not None and t1 <= ts <= t1 + edge]
            if not before or not after:
                gaps.append(self._gap(source, t0, t1, edge, "before" if not before else "after"))
                continue
            inside = [(ts, v) for ts, v in series if v is not None and before[-1][0] <= ts <= after[0][0]]
            total += sum(b - a if b >= a else b for (_, a), (_, b) in itertools.pairwise(inside))
        evidence = [f"metrics.jsonl source={s or 'target'}" for s in sources]
        if gaps:
            return Bracketed(None, "; ".join(gaps), sources, evidence)
        return Bracketed(total, None, sources, evidence)

    def _gap(self, source: str, t0: float, t1: float, edge: float, side: str) -> str:
        at = t0 if side == "before" else t1
        lo, hi = (at - edge, at) if side == "before" else (at, at + edge)
        failed = [(ts, why) for ts, why in self.failed.get(source, []) if lo - edge <= ts <= hi + edge]
        what = f"no good /metrics scrape within {edge:.1f} s {side} the window on {source or 'the target'}"
        if failed:
            what += " (" + ", ".join(f"scrape at {ts - at:+.1f} s failed: {why}" for ts, why in failed[:3]) + ")"
        return what

    def gauge(self, name: str, t0: float, t1: float, match: dict[str, str] | None = None) -> dict[str, float] | None:
        """Mean over every source's points, max of the worst source (a replica at its limit is a limit)."""
        per = self.gauge_by_source(name, t0, t1, match)
        if not per:
            return None
        samples = sum(g["samples"] for g in per.values())
        mean = sum(g["mean"] * g["samples"] for g in per.values()) / samples
        return {"mean": mean, "max": max(g["max"] for g in per.values()), "samples": samples}

    def gauge_by_source(self, name: str, t0: float, t1: float, match: dict[str, str] | None = None
                        ) -> dict[str, dict[str, float]]:
        out = {}
        for source in self.sources:
            values = [v for _, v in self.points(name, t0, t1, match, source=source)]
            if values:
                out[source] = {"mean": sum(values) / len(values), "max": max(values), "samples": len(values)}
        return out

    def sustained_queue_s(self, t0: float, t1: float) -> float | None:
        """Longest stretch during which requests waited BEHIND running ones (waiting > 0 and running > 0 in
        the same scrape), worst source. Why not waiting alone: vLLM's gauges are the scheduler's state
        a step behind, and on a slow server one step is long: a single 2,000-token prefill on a 2-core
        CPU read as waiting 1, running 0 for 8 s with nothing else in the server. With none running,
        nothing holds the batch or the KV cache, so a waiting request there is not queueing for them."""
        values = []
        for source in self.sources:
            running = dict(self.points(VllmMetric.NUM_REQUESTS_RUNNING, t0, t1, source=source))
            waiting = self.points(VllmMetric.NUM_REQUESTS_WAITING, t0, t1, source=source)
            if running:  # a source without the running gauge is judged on waiting alone, never as no queue
                waiting = [(ts, w if running.get(ts, 0) > 0 else 0) for ts, w in waiting]
            values.append(self.sustained(waiting))
        known = [v for v in values if v is not None]
        return max(known) if known else None

    @staticmethod
    def sustained(points: list[tuple[float, float]]) -> float | None:
        """The longest stretch of (ts, value) points above zero, to the last point; None without points."""
        if not points:
            return None
        longest, start = 0.0, None
        for ts, value in points:
            if value > 0 and start is None:
                start = ts
            elif value <= 0 and start is not None:
                longest, start = max(longest, ts - start), None
        if start is not None:
            longest = max(longest, points[-1][0] - start)
        return longest

    def histogram_bucket(self, name: str, t0: float, t1: float, q: float) -> QuantileBucket | None:
        """The bucket of a histogram (`name` without `_bucket`) that holds its q-quantile over the window,
        summed over the sources and any other labels; None when nothing was observed (or never scraped).
        Why a bucket and not an interpolated value: the server's histogram only says which bucket; a rule
        that compares it with a limit passes when the whole bucket is within it, fails when the whole bucket
        is over it, and cannot tell otherwise."""
        bucket = name + "_bucket"
        bounds = sorted({labels["le"] for scrape in self.scrapes for labels in (scrape.series.get(bucket) or ((),))[0]
                         if "le" in labels}, key=_le)
        counts = [(le, self.delta(bucket, t0, t1, {"le": le})) for le in bounds]
        known = [(_le(le), c) for le, c in counts if c is not None]
        if not known or known[-1][0] != float("inf") or known[-1][1] < 1:
            return None
        total, low = known[-1][1], 0.0
        for high, cumulative in known:
            if cumulative >= q * total:
                return QuantileBucket(q, low, high, int(total))
            low = high
        return None  # unreachable: the +Inf bucket holds every observation

    def histogram_mean(self, name: str, t0: float, t1: float) -> float | None:
        total, count = self.delta(name + "_sum", t0, t1), self.delta(name + "_count", t0, t1)
        if total is None or not count:
            return None
        return total / count
