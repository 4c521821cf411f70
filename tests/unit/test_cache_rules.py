"""Prefix-cache rules on hand-made runs (no sockets): like-for-like pairs, scrape gaps, two sources.

Each case is a failure the pillar used to get wrong: a weak model failing the cache at random, a
timed-out scrape turned into "no hits", /metrics and usage disagreeing silently, replicas."""

from __future__ import annotations

from pathlib import Path

from k3load.analysis.pillars.cache.pillar_cache import judge_prefix_cache
from k3load.analysis.pillars.pillar import thresholds
from k3load.analysis.run.rundata import RunData, StageWindow
from k3load.analysis.run.timeline import MetricIndex
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.records import Attempt, Finding

HITS, QUERIES, CACHED = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", \
    "vllm:prompt_tokens_cached_total"
LIMITS = thresholds(None)["prefix_cache"] | thresholds(None)["resources"]
PROMPT = 1600


def _attempt(pair: int, role: str, ts: float, valid: bool = True, cached: int | None = None,
             ttft: float | None = None) -> Attempt:
    cold = role == "cold"
    findings = [Finding("expect.answer", valid, None if valid else "model_output", "")]
    return Attempt(run_id="r", attempt_id=f"{pair}-{role}", chain_id=f"{pair}-{role}", attempt=1, stage="control",
                   scenario="shared_prefix_control", family="shared_prefix", turn=pair - 1, turn_kind="answer",
                   user_id="u", request_sha256=f"req{pair}", prefix_sha256=f"pre{pair}", transport="t", status="ok",
                   send_ts=ts, end_ts=ts + 0.4, prompt_tokens=PROMPT,
                   cached_tokens=cached if cached is not None else (0 if cold else 1536),
                   ttft_ms=ttft if ttft is not None else (200.0 if cold else 20.0), valid=valid,
                   findings=findings, primary_layer=None if valid else "model_output",
                   control_pair=pair, control_role=role)


def _pairs(n: int = 8, warm_valid=lambda i: True, cold_valid=lambda i: True, **warm) -> list[Attempt]:
    out = []
    for i in range(1, n + 1):
        out += [_attempt(i, "cold", 10 + i, cold_valid(i)), _attempt(i, "warm", 10.5 + i, warm_valid(i), **warm)]
    return out


def _scrape(ts: float, hits: float, source: str = "http://e/metrics", ok: bool = True) -> dict:
    if not ok:
        return {"ts": ts, "source": source, "ok": False, "error": "timeout after 2 s"}
    samples = {f'{HITS}{{engine="0"}}': hits, f'{QUERIES}{{engine="0"}}': hits * 2,
               f'{CACHED}{{engine="0"}}': hits, 'vllm:kv_cache_usage_perc{engine="0"}': 0.1}
    return {"ts": ts, "source": source, "ok": True, "vllm_series": len(samples), "samples": samples}


def _judge(attempts: list[Attempt], metrics: list[dict]) -> tuple[str, list[str], dict]:
    data = RunData(path=Path("."), attempts=attempts, metrics=metrics,
                   stages=[StageWindow("control", "prefix_control", 10, 20, 1)],
                   events=[{"ts": 9, "event": "cache_config", "labels": [{"block_size": "16"}]}])
    result = judge_prefix_cache(data, MetricIndex(metrics), LIMITS)
    return result.status, result.reasons, result.numbers


def _metrics(total: float, sources: tuple[str, ...] = ("http://e/metrics",), counted_at: float = 19.0,
             failing: tuple[float, float] = (0, 0)) -> list[dict]:
    """A scrape a second per source from 9 s to 30 s; the hits are counted by `counted_at`."""
    share = total / len(sources)
    return [_scrape(t, share * (t >= counted_at), s, ok=not failing[0] <= t <= failing[1])
            for s in sources for t in range(9, 31)]


def test_like_for_like_pairs_pass_on_a_healthy_cache():
    status, reasons, numbers = _judge(_pairs(), _metrics(8 * 1536))
    assert status == PASS, reasons
    assert {r["id"]: r["status"] for r in numbers["rules"]} == {"cache.hits": "pass", "cache.latency": "pass",
                                                                "cache.answers": "pass"}
    assert "8 cold/warm pairs" in reasons[0] and "McNemar" in reasons[0]
    assert numbers["distinct_requests"] == 8 and reasons[0].endswith("(pairs of 8 distinct requests)")


def test_a_weak_model_does_not_fail_the_cache():
    # Half the answers are wrong, on cold and warm twins alike, in no pattern: the cache is not to blame.
    attempts = _pairs(warm_valid=lambda i: i % 2 == 0, cold_valid=lambda i: i % 3 != 0)
    status, reasons, _ = _judge(attempts, _metrics(8 * 1536))
    assert status == PASS, reasons


def test_hits_that_break_the_answers_fail_by_mcnemar():
    status, reasons, _ = _judge(_pairs(warm_valid=lambda i: False), _metrics(8 * 1536))
    assert status == FAIL and any("a hit that breaks the answers" in r and "McNemar p=0.004" in r for r in reasons)


def test_a_timed_out_scrape_is_a_gap_never_no_hits():
    # One good scrape a second after the control is enough (the delta is exact)...
    status, reasons, _ = _judge(_pairs(), _metrics(8 * 1536, failing=(19, 19)))
    assert status == PASS, reasons
    # ... a stall longer than a few intervals leaves the window unbracketed: inconclusive, never "no hits".
    status, reasons, numbers = _judge(_pairs(), _metrics(8 * 1536, failing=(19, 24)))
    assert status == INCONCLUSIVE, reasons
    assert "do not cover the control window" in reasons[0] and "timeout after 2 s" in reasons[0]
    assert "12288 cached tokens" in reasons[0]
    assert numbers["window"]["prefix_cache_hits"] is None


def test_sources_that_disagree_are_reported():
    status, reasons, _ = _judge(_pairs(), _metrics(100))
    assert status == INCONCLUSIVE and "two sources of cache hits disagree" in reasons[0]


def test_replicas_are_summed_per_source():
    status, reasons, numbers = _judge(_pairs(), _metrics(8 * 1536, ("http://a/metrics", "http://b/metrics")))
    assert status == PASS, reasons
    assert numbers["window"]["sources"] == ["http://a/metrics", "http://b/metrics"]
    assert numbers["window"]["prefix_cache_hits"] == 8 * 1536


def test_no_latency_effect_fails_on_the_pairs_not_one_request():
    status, reasons, _ = _judge(_pairs(ttft=210.0), _metrics(8 * 1536))
    assert status == FAIL and any(r.startswith("no latency effect") and "sign test" in r for r in reasons)
    few = _pairs(n=3)
    status, reasons, _ = _judge(few, _metrics(3 * 1536, counted_at=14))
    assert status == INCONCLUSIVE and "only 3 pairs completed: a sign test needs at least 5" in reasons[0]
