"""The server's timeline from `metrics.jsonl`: counter deltas per window, gauge statistics, histograms.

Why windows: counters are cumulative since the server started, so a run's figures are differences
between scrapes in the same window; a counter that goes down is a restart, whose new value counts
from zero (never a negative delta). A window with no scrape carrying vllm:* series says "metrics
missing" (None), never 0.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from k3load.sampler.prom import split_key


@dataclass
class Scrape:
    ts: float
    values: dict[str, list[tuple[dict[str, str], float]]]  # name -> [(labels, value)]


class MetricIndex:
    """The ok scrapes of one run, indexed by series name once (keys are parsed a single time)."""

    def __init__(self, lines: list[dict[str, Any]]) -> None:
        self.scrapes: list[Scrape] = []
        for line in lines:
            if not line.get("ok") or not line.get("vllm_series"):
                continue
            values: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
            for key, value in (line.get("samples") or {}).items():
                if value is None:
                    continue
                name, labels = split_key(key)
                values[name].append((labels, value))
            self.scrapes.append(Scrape(line["ts"], dict(values)))

    def present(self, t0: float, t1: float) -> bool:
        return any(t0 <= s.ts <= t1 for s in self.scrapes)

    def _total(self, scrape: Scrape, name: str, match: dict[str, str] | None) -> float | None:
        rows = scrape.values.get(name)
        if rows is None:
            return None
        return sum(v for labels, v in rows if not match or match.items() <= labels.items())

    def points(self, name: str, t0: float, t1: float, match: dict[str, str] | None = None,
               baseline: bool = False) -> list[tuple[float, float]]:
        """(ts, value summed over matching label sets); with `baseline`, the last scrape before t0 too."""
        out: list[tuple[float, float]] = []
        before: tuple[float, float] | None = None
        for scrape in self.scrapes:
            value = self._total(scrape, name, match)
            if value is None:
                continue
            if scrape.ts < t0:
                before = (scrape.ts, value)
            elif scrape.ts <= t1:
                out.append((scrape.ts, value))
        return ([before] if baseline and before else []) + out

    def delta(self, name: str, t0: float, t1: float, match: dict[str, str] | None = None) -> float | None:
        """Increase of a counter (or histogram _sum/_count) over the window, restarts handled."""
        points = self.points(name, t0, t1, match, baseline=True)
        if len(points) < 2:
            return None
        total = 0.0
        for (_, a), (_, b) in itertools.pairwise(points):
            total += b - a if b >= a else b  # went down: the server restarted and counts from zero
        return total

    def gauge(self, name: str, t0: float, t1: float, match: dict[str, str] | None = None) -> dict[str, float] | None:
        points = self.points(name, t0, t1, match)
        if not points:
            return None
        values = [v for _, v in points]
        return {"mean": sum(values) / len(values), "max": max(values), "samples": len(values)}

    def sustained_positive_s(self, name: str, t0: float, t1: float) -> float | None:
        """Longest stretch during which the gauge stayed above zero (a queue, not one blip)."""
        points = self.points(name, t0, t1)
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

    def histogram_mean(self, name: str, t0: float, t1: float) -> float | None:
        total, count = self.delta(name + "_sum", t0, t1), self.delta(name + "_count", t0, t1)
        if total is None or not count:
            return None
        return total / count
