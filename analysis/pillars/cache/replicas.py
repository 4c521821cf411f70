"""Which replica served each control request, read from the per-source counters; and each replica's load.

Why: behind a router, a warm twin that reached another replica than its cold twin misses its prefix
whatever that replica's cache does, and "the prefix may have been evicted" sends the operator after the
wrong cause. Each `--k3-metrics-url` is one source (a `source` on every metrics.jsonl line), and a
request-count counter moves by one on the replica that finished a request.

How a request is placed, soundly or not at all: the server counts a request twice, at admission (the prefix
cache's queries, in prompt tokens, between its send and its first token) and at its finish (a request counter,
between its send and its end). For either, on every source serving the counter, take the last good scrape
read before the request was sent and the first good scrape begun after the counted moment's latest time (plus
`SETTLE_S`). The request's own count is then inside every source's bracket. If exactly one source moved, that
source served it, whatever other traffic shared the window (every count, the request's among them, landed
there). A pair's two requests, bracketed together, tell the pair's meeting even when both share one scrape
interval: one source moved: the same replica; two sources moved by exactly one request's count each and
nothing else moved: another replica (`SPLIT`). Anything else is `UNKNOWN`, with why: a source without a
bracketing scrape near the window, a failed scrape inside it (a restart could hide there), a counter that
went down, other traffic. Why admission first: control requests run back to back, so the scrape before a
request falls inside the previous one, whose finish is still to come but whose admission is long past.
Requests shorter than a scrape interval share their brackets with their neighbours: the counters cannot tell
those apart, and this says so rather than guess (scrape faster than a request lasts: `--k3-sample-interval`).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np

from k3load.analysis.run.lean import AnyAttempt
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.rundata import RunData
from k3load.analysis.run.timeline import MetricIndex
from k3load.sampler.vllm_metrics import VllmMetric

# Counters that move by one per finished request, in order of preference (vLLM 0.32, docs in
# ../shared/notes/vllm-wire-facts.md; the sim serves all three): the first every source carries is read.
REQUEST_COUNTERS = (VllmMetric.REQUEST_SUCCESS_TOTAL, VllmMetric.REQUEST_PROMPT_TOKENS_COUNT,
                    VllmMetric.E2E_REQUEST_LATENCY_COUNT)
# Moves by the prompt's tokens when a request is admitted, before its first token: vLLM's
# vllm/v1/core/kv_cache_manager.py get_computed_blocks adds request.num_tokens (the prompt, for a new request:
# the usage's prompt_tokens). A request tried again for want of blocks counts again: more, never less, which
# leaves a window unknown, never a pair split where it was not.
ADMISSION_COUNTER = VllmMetric.PREFIX_CACHE_QUERIES_TOTAL
# vLLM counts a finished request just after its last chunk leaves (vllm/v1/engine/async_llm.py output
# handler: outputs first, stats after): a scrape begun this soon after the client's end may not count it yet.
SETTLE_S = 0.05
GAUGE_SLACK_S = 2.5  # as pillar_cache.WINDOW_SLACK_S: let the window's last gauge scrape land


class Meeting(StrEnum):
    """Whether a pair's cold and warm twins met the same replica."""

    SAME = "same"
    SPLIT = "split"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Tick:
    """One scrape of one source: the server's state was read somewhere in [ts, read_until_ts]; `count` is the
    request counter (None: the scrape failed or did not carry it)."""

    ts: float
    read_until_ts: float
    count: float | None


@dataclass(frozen=True)
class PairRoute:
    """One control pair's serving sources (None: not told alone) and its meeting, or why unknown."""

    pair: int
    meeting: Meeting
    cold_source: str | None = None
    warm_source: str | None = None
    why: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "meeting": self.meeting.value}


@dataclass(frozen=True)
class Routing:
    """Every control pair's route over the replicas (sources), read from `counters` (admission first); `counter`
    is the per-request one (finishes), counted per replica in the report."""

    counter: str | None
    sources: tuple[str, ...]
    pairs: tuple[PairRoute, ...]
    counters: tuple[str, ...] = ()

    def count(self, meeting: Meeting) -> int:
        return sum(1 for p in self.pairs if p.meeting is meeting)

    def to_dict(self) -> dict[str, Any]:
        return {"counter": self.counter, "counters": list(self.counters), "sources": list(self.sources),
                **{m.value: self.count(m) for m in Meeting}, "pairs": [p.to_dict() for p in self.pairs]}


def timelines(data: RunData, counter: str) -> dict[str, list[Tick]]:
    """Each replica's scrapes in time order, with the counter summed over its label sets. A source that answered
    yet never served a vllm:* series (a router's own /metrics) is no replica and is left out; one that never
    answered may be one, and stays (its failed scrapes leave every window unknown)."""
    out: dict[str, list[Tick]] = defaultdict(list)
    replicas: set[str] = set()
    answered: set[str] = set()
    prefix = counter + "{"
    for line in data.metrics:
        ts = line.get("ts")
        if not isinstance(ts, (int, float)):
            continue
        source, count = str(line.get("source") or ""), None
        if line.get("ok"):
            answered.add(source)
        if line.get("ok") and line.get("vllm_series"):
            replicas.add(source)
            values = [v for k, v in (line.get("samples") or {}).items()
                      if v is not None and (k == counter or k.startswith(prefix))]
            count = float(sum(values)) if values else None
        out[source].append(Tick(ts, ts + (line.get("scrape_ms") or 0) / 1000, count))
    for ticks in out.values():
        ticks.sort(key=lambda t: t.ts)
    return {s: ticks for s, ticks in out.items() if s in replicas or s not in answered}


def request_counter(data: RunData) -> tuple[str | None, dict[str, list[Tick]]]:
    """The first of REQUEST_COUNTERS that every replica carries, with its timelines (none: every replica's)."""
    for counter in REQUEST_COUNTERS:
        lines = timelines(data, counter)
        if lines and all(any(t.count is not None for t in ticks) for ticks in lines.values()):
            return counter, lines
    return None, timelines(data, REQUEST_COUNTERS[0])


@dataclass(frozen=True)
class Counters:
    """One counter as the placement reads it: each replica's timeline, how far from a window a bracketing scrape
    may be (`MetricIndex.edge_s`), when the server counts a request (`admitted`: by its first token, by its
    prompt's tokens; else by its end, by one), and every ok attempt's (send_ts, latest count ts, count)."""

    name: str
    ticks: dict[str, list[Tick]]
    edges: dict[str, float]
    admitted: bool = False
    spans: tuple[tuple[float, float, float], ...] = ()  # in send order
    _times: dict[str, list[float]] = field(init=False, repr=False, compare=False)
    _sends: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Looked up by bisection, not by a walk over the run: a pair asks about three brackets a counter, and an
        # hour's run holds thousands of scrapes a replica and hundreds of thousands of attempts.
        object.__setattr__(self, "_times", {s: [t.ts for t in line] for s, line in self.ticks.items()})
        object.__setattr__(self, "_sends", [send for send, _, _ in self.spans])

    def latest(self, attempt: AnyAttempt) -> float:
        """When the server has surely counted the attempt (client clock)."""
        if self.admitted and attempt.first_token_ts is not None:
            return min(attempt.first_token_ts, attempt.end_ts)
        return attempt.end_ts

    def unit(self, attempt: AnyAttempt) -> float | None:
        """How far the counter moves for the attempt (None: not known)."""
        return float(attempt.prompt_tokens) if self.admitted and attempt.prompt_tokens else (
            None if self.admitted else 1.0)

    def rise(self, t0: float, t1: float) -> dict[str, int] | str:
        """Per source, how far the counter rose across a bracket that surely holds what the server counted for a
        request sent at t0 or later and counted by t1; or why there is none on some source, or why the counts
        cannot be whole (fewer than the ok attempts counted inside every bracket: a replica not scraped)."""
        if not self.ticks:
            return "no replica was scraped"
        out: dict[str, int] = {}
        inner = [t0, t1 + SETTLE_S]  # where an attempt is surely counted in every source's bracket
        for source, line in sorted(self.ticks.items()):
            name, edge = source or "the target", self.edges.get(source, 2.5)
            times = self._times[source]
            last = bisect.bisect_right(times, t0) - 1  # read_until_ts >= ts: the one read before t0 is at or before
            while last >= 0 and line[last].read_until_ts > t0:
                last -= 1
            after = bisect.bisect_left(times, t1 + SETTLE_S)
            if last < 0 or after >= len(line) or t0 - line[last].ts > edge or line[after].ts - t1 > edge:
                return f"no scrape of {name} brackets the window within {edge:.1f} s"
            inside = line[last:after + 1]
            counts = [t.count for t in inside if t.count is not None]
            if len(counts) < len(inside):
                return f"a scrape of {name} inside the window failed or lacked {self.name}"
            if any(b < a for a, b in itertools.pairwise(counts)):
                return f"{self.name} of {name} went down inside the window (a restart)"
            out[source] = round(counts[-1] - counts[0])
            inner = [max(inner[0], inside[0].read_until_ts), min(inner[1], inside[-1].ts)]
        sends = self._sends
        first, stop = bisect.bisect_left(sends, inner[0]), bisect.bisect_right(sends, inner[1])  # latest >= send
        surely = sum(unit for _, latest, unit in self.spans[first:stop] if latest + SETTLE_S <= inner[1])
        if sum(out.values()) < surely:
            return (f"the replicas counted {sum(out.values())} where the attempts counted inside every bracket "
                    f"make {surely:.0f} (a replica not scraped?)")
        return out

    def place(self, attempt: AnyAttempt) -> str | None:
        """The one source that counted the attempt, or None."""
        return _single(self.rise(attempt.send_ts, self.latest(attempt)))[0]

    def meet(self, cold: AnyAttempt, warm: AnyAttempt) -> tuple[Meeting, str | None, str | None]:
        """The pair bracketed together: one source moved (the same replica, named), or two moved by exactly one
        twin's count each with nothing else counted (another replica); else unknown, with why."""
        rise = self.rise(cold.send_ts, self.latest(warm))
        both, why = _single(rise)
        if both:
            return Meeting.SAME, both, None
        units = (self.unit(cold), self.unit(warm))
        known = [u for u in units if u is not None]
        if not isinstance(rise, str) and len(known) == 2 and sum(rise.values()) == sum(known) and \
                sorted(v for v in rise.values() if v) == sorted(units):  # type: ignore[type-var]
            return Meeting.SPLIT, None, None
        return Meeting.UNKNOWN, None, why


def moved(ticks: dict[str, list[Tick]], edges: dict[str, float], t0: float, t1: float) -> dict[str, int] | str:
    """`Counters.rise` of a request counter with no attempts known."""
    return Counters(REQUEST_COUNTERS[0], ticks, edges).rise(t0, t1)


def _single(rise: dict[str, int] | str) -> tuple[str | None, str | None]:
    if isinstance(rise, str):
        return None, rise
    up = [s for s, n in rise.items() if n > 0]
    if len(up) == 1:
        return up[0], None
    if not up:
        return None, "no source counted a request in the window"
    return None, "several sources moved in the window (other traffic overlapped it)"


def _agreed(found: list[str | None]) -> str | None:
    """The one source every counter that told named (None where none told, or two named different ones)."""
    told = set(filter(None, found))
    return told.pop() if len(told) == 1 else None


def _pair_route(number: int, cold: AnyAttempt, warm: AnyAttempt, counters: list[Counters]) -> PairRoute:
    """Each twin alone where a counter's bracket tells; else both together. Each counter's answer is sound, so
    they never differ; if they ever did, the pair is unknown rather than either."""
    cold_at = _agreed([c.place(cold) for c in counters])
    warm_at = _agreed([c.place(warm) for c in counters])
    if cold_at and warm_at:
        return PairRoute(number, Meeting.SAME if cold_at == warm_at else Meeting.SPLIT, cold_at, warm_at)
    met = [c.meet(cold, warm) for c in counters]
    told = {m for m, _, _ in met if m is not Meeting.UNKNOWN}
    if len(told) == 1:
        meeting = told.pop()
        same = _agreed([s for m, s, _ in met if m is meeting])
        return PairRoute(number, meeting, cold_at or same, warm_at or same)
    whys = sorted({w for _, _, w in met if w})
    return PairRoute(number, Meeting.UNKNOWN, cold_at, warm_at,
                     "the counters disagree" if told else "; ".join(whys) or None)


def _spans(ok: Rows, admitted: bool) -> tuple[tuple[float, float, float], ...]:
    """Each ok attempt's (send, when the server surely counted it, how far it moved the counter), in send order:
    `Counters.latest` and `Counters.unit` (1.0 where not known) over the record columns. Why columns: an hour's
    soak is 360,000 attempts, read here for a few fields each."""
    send, end = ok.number("send_ts"), ok.number("end_ts")
    if admitted:
        first, prompt = ok.number("first_token_ts"), ok.number("prompt_tokens")
        latest = np.where(np.isnan(first), end, np.minimum(first, end))
        unit = np.where(np.isnan(prompt) | (prompt == 0), 1.0, prompt)
    else:
        latest, unit = end, np.ones(len(end))
    return tuple(sorted(zip(send.tolist(), latest.tolist(), unit.tolist(), strict=True)))


def route_pairs(data: RunData, index: MetricIndex, pairs: Sequence[tuple[AnyAttempt, AnyAttempt]]
                ) -> Routing | None:
    """The route of every (cold, warm) pair, numbered from 1 as the pillar's control table; None where fewer
    than two sources were scraped (one replica, or one URL in front of several: nothing to tell apart)."""
    if len({str(line.get("source") or "") for line in data.metrics}) < 2:
        return None  # before reading any sample: a one-source hour is a million of them
    counter, ticks = request_counter(data)
    if len(ticks) < 2:
        return None
    every = data.columns.rows()
    ok = every[every.code_is("status", "ok")]  # each surely counted by some replica
    counters = []
    admitted = timelines(data, ADMISSION_COUNTER)
    for name, lines, at_admission in ((ADMISSION_COUNTER, admitted, True), (counter, ticks, False)):
        if name and lines and all(any(t.count is not None for t in line) for line in lines.values()):
            read = Counters(name, lines, {s: index.edge_s(s) for s in lines}, at_admission)
            counters.append(replace(read, spans=_spans(ok, at_admission)))
    names = tuple(c.name for c in counters)
    if not counters:
        why = "no replica served a per-request counter (" + ", ".join((ADMISSION_COUNTER, *REQUEST_COUNTERS)) + ")"
        return Routing(counter, tuple(sorted(ticks)), tuple(PairRoute(n, Meeting.UNKNOWN, why=why)
                                                            for n in range(1, len(pairs) + 1)))
    return Routing(counter, tuple(sorted(ticks)), tuple(_pair_route(n, c, w, counters)
                                                        for n, (c, w) in enumerate(pairs, start=1)), names)


def reuse_by_meeting(pairs: Sequence[tuple[AnyAttempt, AnyAttempt]], routing: Routing) -> dict[str, dict[str, Any]]:
    """The reuse users actually get: per meeting and over all pairs, how many warm twins reused more than their
    cold twin and the warm twins' cached share of their prompt (pairs whose responses carry cached_tokens)."""
    groups: dict[str, list[tuple[AnyAttempt, AnyAttempt]]] = {"all": list(pairs)}
    for pair, route in zip(pairs, routing.pairs, strict=True):
        groups.setdefault(route.meeting.value, []).append(pair)
    out = {}
    for name, group in groups.items():
        told = [(c, w) for c, w in group if w.cached_tokens is not None and w.prompt_tokens]
        prompt = sum(w.prompt_tokens or 0 for _, w in told)
        out[name] = {"pairs": len(group), "warm_reused": sum(1 for c, w in told if reused(c, w)),
                     "with_usage": len(told),
                     "warm_hit_share": sum(w.cached_tokens or 0 for _, w in told) / prompt if prompt else None}
    return out


def reused(cold: AnyAttempt, warm: AnyAttempt) -> bool | None:
    """Did the warm twin reuse more than its cold twin (None: its response carries no cached_tokens)?"""
    if warm.cached_tokens is None:
        return None
    return warm.cached_tokens > (cold.cached_tokens or 0)


def per_replica(data: RunData, index: MetricIndex, routing: Routing) -> list[dict[str, Any]]:
    """Per source over the run: requests it finished, control requests placed on it, KV usage peak and mean,
    waiting peak, prefix-cache hit share. Unknown is None, never 0."""
    if not len(data.columns):
        return []
    t0 = float(np.nanmin(data.columns.array("send_ts")))
    t1 = float(np.nanmax(data.columns.array("end_ts"))) + GAUGE_SLACK_S
    kv = index.gauge_by_source(VllmMetric.KV_CACHE_USAGE, t0, t1)
    waiting = index.gauge_by_source(VllmMetric.NUM_REQUESTS_WAITING, t0, t1)
    placed: dict[str, int] = defaultdict(int)
    for route in routing.pairs:
        for source in (route.cold_source, route.warm_source):
            if source is not None:
                placed[source] += 1
    rows = []
    for source in routing.sources:
        hits = _source_rise(index, VllmMetric.PREFIX_CACHE_HITS_TOTAL, t0, t1, source)
        queries = _source_rise(index, VllmMetric.PREFIX_CACHE_QUERIES_TOTAL, t0, t1, source)
        rows.append({"source": source or "target",
                     "requests": _source_rise(index, routing.counter, t0, t1, source) if routing.counter else None,
                     "control_requests": placed.get(source, 0),
                     "kv_usage_max": (kv.get(source) or {}).get("max"),
                     "kv_usage_mean": (kv.get(source) or {}).get("mean"),
                     "waiting_max": (waiting.get(source) or {}).get("max"),
                     "hit_share": hits / queries if hits is not None and queries else None})
    return rows


def _source_rise(index: MetricIndex, name: str, t0: float, t1: float, source: str) -> float | None:
    """One source's counter rise over the window, from the last scrape before it (a drop is a restart)."""
    points = [v for _, v in index.points(name, t0, t1, baseline=True, source=source)]
    if len(points) < 2:
        return None
    return sum(b - a if b >= a else b for a, b in itertools.pairwise(points))
