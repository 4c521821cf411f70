"""Streams a proxy buffered (analysis/pillars/headroom/buffering.py) and the server's histogram buckets
(MetricIndex.histogram_bucket).

The reads are the client's own counts on each record; the runs behind Debian's nginx that show them for real are
rows of tests/sim/test_verdict_matrix.py (`nginx-default-proxy-buffers-the-stream`, `nginx-unbuffered-...`).
"""

from __future__ import annotations

import math

from hypothesis import example, given
from hypothesis import strategies as st

from k3load.analysis.pillars.cache.pillar_cache import through_blocks
from k3load.analysis.pillars.headroom.buffering import Delivery, latency_on_server, stream_delivery
from k3load.analysis.pillars.headroom.proxy_rejudge import proxy_judged
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.limit_rules import RuleId
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
from k3load.analysis.pillars.rules import Breach, RuleResult
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.rundata import columns_of
from k3load.analysis.run.timeline import MetricIndex
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS, Signal
from k3load.records import Attempt

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
BOUNDS = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "+Inf")


def _rows(attempts: list[Attempt]) -> Rows:
    return columns_of(attempts).rows()


def attempt(n: int, reads: int | None, size: int | None, *, chunks: int = 60, stage: str = "load",
            stream: bool = True, status: str = "ok", ttft_ms: float = 50.0) -> Attempt:
    return Attempt(run_id="r", attempt_id=f"a{n}", chain_id=f"c{n}", attempt=1, stage=stage, scenario="s",
                   family="agent", turn=0, turn_kind="answer", user_id="u", request_sha256=f"q{n}",
                   prefix_sha256="p", transport="geventhttpclient", status=status, send_ts=100.0 + n,
                   end_ts=100.5 + n, chunks=chunks, stream=stream, stream_reads=reads, stream_bytes=size,
                   ttft_ms=ttft_ms)


def scrape(ts: float, cumulative: dict[str, float], name: str = TTFT, source: str = "") -> dict:
    """One metrics.jsonl line carrying a histogram's cumulative buckets (as vLLM labels them)."""
    samples = {f'{name}_bucket{{le="{le}",model_name="k3"}}': value for le, value in cumulative.items()}
    samples["vllm:num_requests_running"] = 0.0
    return {"ts": ts, "ok": True, "source": source, "vllm_series": len(samples), "samples": samples}


def histogram(ts: float, counts: list[float], name: str = TTFT) -> dict:
    """A scrape whose buckets hold `counts` per bucket (made cumulative)."""
    running, cumulative = 0.0, {}
    for le, count in zip(BOUNDS, counts, strict=True):
        running += count
        cumulative[le] = running
    return scrape(ts, cumulative, name)


def empty(ts: float, name: str = TTFT) -> dict:
    return scrape(ts, dict.fromkeys(BOUNDS, 0.0), name)


def test_blocks_are_named_buffered_with_the_servers_own_ttft_beside_the_clients():
    blocks = [attempt(i, 4, 14_000) for i in range(30)]  # 15 events and 3.5 KB a read: nginx's 4 KB buffers
    index = MetricIndex([empty(90.0), histogram(125.0, [0, 20, 10, 0, 0, 0, 0, 0, 0, 0, 0])])  # in the window
    found = stream_delivery(_rows(blocks), index)
    assert found.delivery is Delivery.BUFFERED and found.buffered
    assert found.blocked.k == found.streams == 30 and found.blocked.low > 0.5
    assert found.events_per_read_p50 == 15 and found.bytes_per_read_p50 == 3500
    assert found.reason.startswith("gateway: the stream is buffered") and "proxy_buffering off" in found.reason
    assert "the server's own p50 in (1, 5] ms of 30 observed" in found.reason  # 20 of 30 in (1, 5] ms
    assert found.to_dict()["layer"] == "gateway"


def test_one_event_a_read_is_straight_and_short_or_unread_streams_cannot_tell():
    index = MetricIndex([])
    straight = stream_delivery(_rows([attempt(i, 55, 15_000) for i in range(20)]), index)
    assert straight.delivery is Delivery.STRAIGHT and straight.blocked.high < 0.5
    assert straight.to_dict()["layer"] is None
    short = [attempt(i, 1, 2_000, chunks=5) for i in range(40)]  # whole short answers fit one read anyway
    assert stream_delivery(_rows(short), index).delivery is Delivery.UNKNOWN
    older = [attempt(i, None, None) for i in range(40)]  # records written before stream_reads existed
    assert "written before stream_reads existed" in stream_delivery(_rows(older), index).reason
    whole = [attempt(i, None, None, stream=False) for i in range(40)]
    assert stream_delivery(_rows(whole), index).delivery is Delivery.UNKNOWN
    few = [attempt(i, 4, 14_000) for i in range(9)]
    assert "only 9 streamed answers" in stream_delivery(_rows(few), index).reason


def test_a_saturated_load_generator_leaves_its_stages_out():
    """Its own socket piles events up: blocks from its stages say nothing of a proxy."""
    hot = [attempt(i, 4, 14_000, stage="concurrency-c12") for i in range(30)]
    found = stream_delivery(_rows(hot), MetricIndex([]), saturated_stages=["concurrency-c12"])
    assert found.delivery is Delivery.UNKNOWN and "saturated in concurrency-c12" in found.reason
    mixed = hot + [attempt(100 + i, 50, 14_000) for i in range(20)]
    assert stream_delivery(_rows(mixed), MetricIndex([]), ["concurrency-c12"]).delivery is Delivery.STRAIGHT


def test_some_answers_in_blocks_are_a_server_or_client_behind_not_a_proxy():
    """A proxy buffers every stream; half in blocks is undecided, never named a proxy."""
    mixed = [attempt(i, 4, 14_000) for i in range(10)] + [attempt(10 + i, 55, 14_000) for i in range(10)]
    found = stream_delivery(_rows(mixed), MetricIndex([]))
    assert found.delivery is Delivery.UNKNOWN and "a proxy buffers every stream" in found.reason


def test_whole_answers_in_one_read_tell_nothing_of_a_proxy():
    """A real vLLM (the tiny model on CPU) wrote whole answers faster than a busy client read them: 96-256 events in
    one read. Those are left out; the answers in three reads or more decide (there 9-26% in blocks: no proxy)."""
    whole = [attempt(i, 1, 24_000, chunks=96) for i in range(60)]
    assert stream_delivery(_rows(whole), MetricIndex([])).delivery is Delivery.UNKNOWN
    assert "60 arrived whole, in one or two reads" in stream_delivery(_rows(whole), MetricIndex([])).reason
    bursts = [attempt(100 + i, 5, 24_000, chunks=96) for i in range(4)] + \
        [attempt(200 + i, 90, 24_000, chunks=96) for i in range(30)]
    found = stream_delivery(_rows(whole + bursts), MetricIndex([]))
    assert found.delivery is Delivery.STRAIGHT and found.streams == 34, found.reason
    assert "4 in blocks" in found.reason and "60 more arrived whole" in found.reason


def _stage(problems: list[Breach], waiting_s: float = 0.0) -> StageRow:
    return StageRow.of(stage="load", start_ts=100.0, duration_s=100.0, problems=tuple(problems),
                       waiting_sustained_s=waiting_s)


def _breach(rule_id: str) -> Breach:
    return Breach(RuleId(rule_id), Signal.LATENCY, None, None, f"{rule_id} over (client)")


def test_latency_breaches_of_a_buffered_stream_are_judged_on_the_servers_histograms():
    limits = {"slo": {**DEFAULT_THRESHOLDS["slo"], "ttft_p95_ms": 40.0, "itl_p95_ms": 40.0}}
    # TTFT: every observation in (1, 5] ms (within 40); ITL: in (60, 80] ms (over 40)
    index = MetricIndex([empty(99.0), empty(99.0, ITL), histogram(199.0, [0, 50, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
                         histogram(199.0, [0, 0, 0, 0, 0, 0, 40, 0, 0, 0, 0], ITL)])
    other = Breach(RuleId.KV_USAGE, Signal.RESOURCE, None, None, "KV")
    stats = _stage([_breach("slo.ttft_p95"), _breach("slo.itl_p95"), _breach("slo.ttfa_p95"), other], waiting_s=30)
    stats = proxy_judged(stats, index, limits)
    ids = [p.id for p in stats.problems]
    assert ids == ["resources.kv_usage", "slo.itl_p95"]  # TTFT within on the server; TTFA unjudged
    itl = stats.problems[1]
    assert itl.signal == "queue_latency" and "p95 in (60, 80] ms of 40 observed by the server's" in itl.reason
    assert [s.status for s in stats.server_side_latency or ()] == ["within", "over", "unjudged"]
    assert stats.latency_unjudged == ("TTFA p95 not judged: the client's is the proxy's and vLLM exports no series "
                                      "for the first answer token",)
    untouched = proxy_judged(_stage([other]), index, limits)
    assert untouched.problems == (other,) and "server_side_latency" not in untouched.to_dict()


def test_a_bucket_that_straddles_the_limit_or_no_observation_leaves_it_unjudged():
    limits = {"slo": {**DEFAULT_THRESHOLDS["slo"], "ttft_p95_ms": 30.0, "itl_p95_ms": 30.0}}
    index = MetricIndex([empty(99.0), histogram(199.0, [0, 0, 0, 0, 50, 0, 0, 0, 0, 0, 0])])  # (20, 40] ms
    row = _stage([])
    judged = {j.rule_id: j for j in latency_on_server(row.start_ts, row.start_ts + row.duration_s, index, limits)}
    assert judged["slo.ttft_p95"].status == "unjudged" and "straddles 30 ms" in judged["slo.ttft_p95"].text
    assert judged["slo.itl_p95"].status == "unjudged" and "observed nothing" in judged["slo.itl_p95"].text


@given(counts=st.lists(st.integers(0, 1000), min_size=len(BOUNDS), max_size=len(BOUNDS)),
       before=st.lists(st.integers(0, 50), min_size=len(BOUNDS), max_size=len(BOUNDS)),
       q=st.sampled_from([0.5, 0.9, 0.95, 0.99]))
@example(counts=[0] * len(BOUNDS), before=[0] * len(BOUNDS), q=0.5)
@example(counts=[0] * (len(BOUNDS) - 1) + [3], before=[0] * len(BOUNDS), q=0.95)
def test_the_quantile_bucket_holds_the_rank_whatever_the_counts(counts, before, q):
    """Over any bucket counts (a server's numbers: outside bytes), the bucket found holds the q-quantile's
    rank of what the window added, and nothing observed is None, never a bucket."""
    start = histogram(99.0, [float(b) for b in before])
    end = histogram(199.0, [float(b + c) for b, c in zip(before, counts, strict=True)])
    found = MetricIndex([start, end]).histogram_bucket(TTFT, 100.0, 200.0, q)
    total = sum(counts)
    if total == 0:
        assert found is None
        return
    assert found is not None and found.count == total
    uppers = [float(b) for b in BOUNDS]
    at = uppers.index(found.high)
    below = sum(counts[:at])
    assert below < q * total <= below + counts[at]
    assert found.low == (uppers[at - 1] if at else 0.0) and found.high > found.low
    assert math.isinf(found.high) or found.high in uppers


def test_the_caches_latency_effect_through_blocks_passes_as_measured_and_never_fails():
    """The proxy adds the same block's wait to both twins: a gain that shows even so stands; no gain is unknown."""
    rule = RuleResult("cache.latency", "prefix_cache", FAIL, "no latency effect: ratio 0.97", 0.97, 0.9)
    held = through_blocks(rule)
    assert held.status == INCONCLUSIVE and held.reason.startswith("inconclusive, because the stream is buffered")
    assert held.reason.endswith("no latency effect: ratio 0.97") and held.measured == 0.97
    passed = through_blocks(RuleResult("cache.latency", "prefix_cache", PASS, "ratio 0.67", 0.67, 0.9))
    assert passed.status == PASS and "only hide a gain" in passed.reason
    open_rule = RuleResult("cache.latency", "prefix_cache", INCONCLUSIVE, "inconclusive, because 3 pairs")
    untold = through_blocks(open_rule)  # the blocks may be why it could not tell: said (a matrix row, stop 48)
    assert untold.status == INCONCLUSIVE and untold.reason.startswith("inconclusive, because 3 pairs")
    assert "proxy's blocks" in untold.reason and "stream_delivery" in untold.reason
