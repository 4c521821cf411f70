"""Streams a proxy buffered, told from the client's own reads, so that no latency rule blames the engine.

Why from the reads: vLLM writes each SSE event as it decodes, so a stream that reaches the client straight
comes about one event per socket read. nginx's default proxy (`proxy_pass` alone: HTTP/1.0 upstream,
`proxy_buffering on`) hands it over in buffer-sized blocks instead (../shared/notes/production-facts.md,
"Gateways and streams"): many events per read, kilobytes per read, the first read late. The client then
times the proxy, not the engine: its TTFT is when the first block filled, its inter-token gaps are zeros
inside a block and waits between blocks. Measured here against the sim (Dec 2026, 4 and 12 streams, 60-token
answers): straight and through nginx with `proxy_buffering off`, 1.0-1.4 events and 230-330 bytes per read
(a busy client at most 2.1 events); through nginx's defaults 14-18 events and 3.5 KB per read, 4 reads a 14 KB
answer, every such answer so. A real vLLM (0.32 CPU, the tiny model, which decodes faster than a busy client
reads) sent many whole answers in one read (96-256 events) and some in a few bursts: an answer in one or two reads
tells nothing of blocks (the server wrote it faster than it was read, or a proxy held all of it), so only answers
of at least three reads are read, and a proxy is named only when nearly all of those came in blocks (measured
there: 9-26% of them in blocks; nginx's defaults: all).

Evidence: each streamed answer's `chunks`, `stream_reads` and `stream_bytes` (records.jsonl; null in older
records: then "inconclusive, because ..."). Shown beside it, never needed: the client's TTFT p50 and the
server's own `vllm:time_to_first_token_seconds` over the same window. While the load generator was
saturated its own socket piles events up too: those stages are left out, and a run with nothing else is
inconclusive. What the finding changes: the latency SLOs of each stage are judged on the server's own
histograms (TTFT, ITL) or said to be unjudged (TTFA, which vLLM does not export), never on the proxy's
blocks (`server_side_latency`); the verdict never reads them as capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from k3load.analysis.pillars.limit_rules import RuleId
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.stats import Rate, wilson
from k3load.analysis.run.timeline import MetricIndex, QuantileBucket
from k3load.outcomes import GATEWAY
from k3load.sampler.vllm_metrics import VllmMetric

MIN_CHUNKS = 8  # an answer shorter than this cannot show blocks (a whole short answer fits one read anyway)
MIN_READS = 3  # an answer in fewer reads arrived whole: written faster than read, or held whole; no blocks seen
BLOCK_EVENTS_PER_READ = 6.0  # straight: at most 2.1 even from a busy client; nginx's 4 KB blocks: 16-18
BLOCK_BYTES_PER_READ = 2048.0  # straight: 230-330 bytes a read; nginx's blocks: 3.6 KB
MIN_STREAMS = 10  # fewer streamed answers long enough to tell: unknown
BUFFERED_SHARE = 0.8  # buffered when nearly every answer came in blocks: the share above this with 95% confidence
STRAIGHT_SHARE = 0.5  # straight when most came as paced: the share in blocks below this with 95% confidence
LAYER = str(GATEWAY)  # a plain string, as `to_dict` hands the delivery on
FIX = ("nginx: `proxy_buffering off;` with `proxy_http_version 1.1;` and `proxy_set_header Connection \"\";` "
       "in the location that proxies /v1 (or the upstream answering `X-Accel-Buffering: no`); HAProxy and Envoy "
       "stream by default: look for a compression or buffer filter on text/event-stream")


class Delivery(StrEnum):
    """How the streams reached the client."""

    STRAIGHT = "straight"  # about one event per read: the server's own pacing
    BUFFERED = "buffered"  # in blocks: something between server and client held them
    UNKNOWN = "unknown"  # too few streams, no read counts (older records), or a saturated load generator


@dataclass(frozen=True)
class StreamDelivery:
    """The run's finding on stream delivery, with the numbers it rests on (verdict.json `stream_delivery`)."""

    delivery: Delivery
    reason: str
    streams: int = 0  # streamed answers in at least MIN_READS reads, outside saturated stages
    blocked: Rate | None = None  # the share of them delivered in blocks
    events_per_read_p50: float | None = None
    bytes_per_read_p50: float | None = None
    client_ttft_p50_ms: float | None = None
    server_ttft: QuantileBucket | None = None  # where the server's own TTFT median lies

    @property
    def buffered(self) -> bool:
        return self.delivery is Delivery.BUFFERED

    def to_dict(self) -> dict[str, Any]:
        return {"delivery": self.delivery.value, "layer": LAYER if self.buffered else None, "reason": self.reason,
                "streams": self.streams, "blocked": self.blocked.to_dict() if self.blocked else None,
                "events_per_read_p50": self.events_per_read_p50, "bytes_per_read_p50": self.bytes_per_read_p50,
                "client_ttft_p50_ms": self.client_ttft_p50_ms,
                "server_ttft_p50": self.server_ttft.text() if self.server_ttft else None}


def stream_delivery(rows: Rows, index: MetricIndex, saturated_stages: Sequence[str] = ()) -> StreamDelivery:
    """Straight, buffered or unknown, from the streams outside `saturated_stages` (a saturated load
    generator reads late and piles events up in its own socket). Read on the record columns: a stream's `stream`
    is truthy, its counts are numbers (unknown: NaN), its TTFT median of the type its record gave it."""
    chunks, reads, size = rows.number("chunks"), rows.number("stream_reads"), rows.number("stream_bytes")
    streamed = rows.flag("stream") & rows.code_is("status", "ok") & (chunks >= MIN_CHUNKS)
    if not streamed.any():
        return StreamDelivery(Delivery.UNKNOWN, "inconclusive, because no streamed answer of at least "
                              f"{MIN_CHUNKS} token chunks ended well")
    counted = streamed & (reads != 0) & ~np.isnan(reads) & ~np.isnan(size)  # its reads counted
    if not counted.any():
        return StreamDelivery(Delivery.UNKNOWN, "inconclusive, because the records do not count the reads that "
                              "carried each stream (written before stream_reads existed)")
    hot = sorted(set(saturated_stages))
    cool = counted & ~rows.code_is("stage", *hot)
    telling_rows = cool & (reads >= MIN_READS)
    streams = int(telling_rows.sum())
    whole = int(cool.sum()) - streams
    if streams < MIN_STREAMS:
        why = (f"the load generator was saturated in {', '.join(hot)} (its own socket piles events up)"
               if hot and counted.sum() >= MIN_STREAMS else
               f"{whole} arrived whole, in one or two reads (written faster than read, or held whole)" if whole
               else "")
        return StreamDelivery(Delivery.UNKNOWN, f"inconclusive, because only {streams} streamed answers of at "
                              f"least {MIN_CHUNKS} chunks came in {MIN_READS} reads or more (at least {MIN_STREAMS} "
                              "are needed)" + (f": {why}" if why else ""), streams)
    telling = rows[telling_rows]
    events_per_read = chunks[telling_rows] / reads[telling_rows]
    bytes_per_read = size[telling_rows] / reads[telling_rows]
    in_blocks = (events_per_read >= BLOCK_EVENTS_PER_READ) & (bytes_per_read >= BLOCK_BYTES_PER_READ)
    blocked = wilson(int(in_blocks.sum()), streams)
    events, per_read = float(np.median(events_per_read)), float(np.median(bytes_per_read))
    client = _median_as_recorded(telling, "ttft_ms")
    t0, t1 = float(telling.number("send_ts").min()), float(telling.number("end_ts").max())
    server = index.histogram_bucket(VllmMetric.TIME_TO_FIRST_TOKEN, t0, t1, 0.5)
    numbers: dict[str, Any] = {"streams": streams, "blocked": blocked, "events_per_read_p50": round(events, 2),
                               "bytes_per_read_p50": round(per_read),
                               "client_ttft_p50_ms": round(client, 3) if client else None, "server_ttft": server}
    pattern = (f"{blocked.k} of {streams} streamed answers of {MIN_READS} reads or more (95% CI {blocked.low:.1%}-"
               f"{blocked.high:.1%}) reached the client in blocks: a median {events:.1f} SSE events and "
               f"{per_read:,.0f} bytes per socket read (a server's own pacing is about one event a read)")
    if blocked.low > BUFFERED_SHARE:
        timing = f"; the client's TTFT p50 {client:.0f} ms" if client is not None else ""
        if server is not None and timing:
            timing += f" against the server's own {server.text()} (vllm:time_to_first_token_seconds)"
        return StreamDelivery(Delivery.BUFFERED, f"{LAYER}: the stream is buffered between the server and the client: "
                              f"{pattern}{timing}. The client's TTFT and inter-token latency are the proxy's blocks, "
                              f"not the engine's: latency SLOs judged on the server's own histograms. Fix: {FIX}",
                              **numbers)
    arrived_whole = f"; {whole} more arrived whole, in one or two reads" if whole else ""
    if blocked.high < STRAIGHT_SHARE:
        return StreamDelivery(Delivery.STRAIGHT, f"no proxy's blocks: median {events:.1f} events and {per_read:,.0f} "
                              f"bytes per read over {streams} streamed answers of {MIN_READS} reads or more "
                              f"({blocked.k} in blocks, 95% CI {blocked.low:.1%}-{blocked.high:.1%}){arrived_whole}",
                              **numbers)
    return StreamDelivery(Delivery.UNKNOWN, f"inconclusive, because {pattern}{arrived_whole}: a proxy buffers every "
                          "stream, a server or client running behind only some", **numbers)


def _median_as_recorded(rows: Rows, name: str) -> float | int | None:
    """The median of a NUMBER field's known values as `statistics.median` gives it over the values as recorded: the
    middle one with its own type (an integer where its record held one), or the mean of the two; None when none is
    known. Equal values keep their rows' order, as Python's stable sort keeps them."""
    values, ints = rows.number(name), rows.is_int(name)
    known = ~np.isnan(values)
    values, ints = values[known], ints[known]
    if not len(values):
        return None
    order = np.argsort(values, kind="stable")
    middle = len(order) // 2

    def recorded(i: int) -> float | int:
        value: float = float(values[order[i]])
        return int(value) if ints[order[i]] else value

    if len(order) % 2:
        return recorded(middle)
    mean: float = (recorded(middle - 1) + recorded(middle)) / 2
    return mean


# Latency SLOs the client measures and the server's own histograms that stand for them when a proxy buffers
# the stream; None: vLLM exports no series for it (TTFA), so it is unjudged.
SERVER_SIDE: dict[RuleId, tuple[VllmMetric, str, str] | None] = {
    RuleId.SLO_TTFT_P95: (VllmMetric.TIME_TO_FIRST_TOKEN, "ttft_p95_ms", "TTFT"),
    RuleId.SLO_ITL_P95: (VllmMetric.INTER_TOKEN_LATENCY, "itl_p95_ms", "ITL"),
    RuleId.SLO_TTFA_P95: None}


@dataclass(frozen=True)
class ServerLatency:
    """One latency SLO of one stage judged on the server's histogram (or not judged, with why)."""

    rule_id: RuleId
    status: str  # "within" | "over" | "unjudged"
    text: str

    def to_dict(self) -> dict[str, Any]:
        """As a stage row carries it (its `server_side_latency`)."""
        return {"id": self.rule_id, "status": self.status, "text": self.text}


def latency_on_server(t0: float, t1: float, index: MetricIndex, limits: dict[str, dict[str, float]]
                      ) -> list[ServerLatency]:
    """Each client-side latency SLO of a stage [t0, t1], judged again on the server's own histogram over it:
    within when the p95's whole bucket is at or under the limit, over when the whole bucket is above it,
    unjudged when the bucket straddles the limit, nothing was observed, or vLLM exports no series (TTFA)."""
    out = []
    for rule_id, server in SERVER_SIDE.items():
        if server is None:
            out.append(ServerLatency(rule_id, "unjudged", "TTFA p95 not judged: the client's is the proxy's and vLLM "
                                     "exports no series for the first answer token"))
            continue
        name, limit_key, label = server
        limit_ms = limits["slo"][limit_key]
        bucket = index.histogram_bucket(name, t0, t1, 0.95)
        if bucket is None:
            out.append(ServerLatency(rule_id, "unjudged", f"{label} p95 not judged: the client's is the proxy's and "
                                     f"the server's {name} observed nothing in the stage"))
        elif bucket.high * 1000 <= limit_ms:
            out.append(ServerLatency(rule_id, "within", f"{label} {bucket.text()} by the server's {name} <= "
                                     f"{limit_ms:.0f} ms"))
        elif bucket.low * 1000 >= limit_ms:
            out.append(ServerLatency(rule_id, "over", f"{label} {bucket.text()} by the server's {name} > "
                                     f"{limit_ms:.0f} ms"))
        else:
            out.append(ServerLatency(rule_id, "unjudged", f"{label} p95 not judged: the server's {name} puts it in "
                                     f"a bucket that straddles {limit_ms:.0f} ms ({bucket.text()})"))
    return out
