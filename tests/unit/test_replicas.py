"""Which replica served each control request (analysis/pillars/cache/replicas.py) and what the cache pillar makes of
it, on
hand-made runs (no sockets): split pairs named as the router's, never as eviction; pairs that share a scrape
interval still told apart; unknown said, never guessed (a property test over arbitrary scrape sequences)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from k3load.analysis.outputs import report_md
from k3load.analysis.outputs.markdown_html import markdown_to_html
from k3load.analysis.pillars.cache.pillar_cache import judge_prefix_cache
from k3load.analysis.pillars.cache.replicas import SETTLE_S, Meeting, moved, route_pairs, timelines
from k3load.analysis.pillars.pillar import thresholds
from k3load.analysis.run.rundata import RunData, StageWindow
from k3load.analysis.run.timeline import MetricIndex
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.records import Attempt, Finding

A, B = "http://a/metrics", "http://b/metrics"
SUCCESS = "vllm:request_success_total"
LIMITS = thresholds(None)["prefix_cache"] | thresholds(None)["resources"]
PROMPT, HIT = 1600, 1536


def _attempt(pair: int, role: str, send: float, cached: int, ttft: float, duration: float = 0.3,
             first_token_ts: float | None = None) -> Attempt:
    return Attempt(run_id="r", attempt_id=f"{pair}-{role}", chain_id=f"{pair}-{role}", attempt=1, stage="control",
                   scenario="shared_prefix_control", family="shared_prefix", turn=pair - 1, turn_kind="answer",
                   user_id="u", request_sha256=f"req{pair}", prefix_sha256=f"pre{pair}", transport="t", status="ok",
                   send_ts=send, end_ts=send + duration, first_token_ts=first_token_ts,
                   prompt_tokens=PROMPT, cached_tokens=cached, ttft_ms=ttft,
                   valid=True, findings=[Finding("expect.answer", True, None, "")], control_pair=pair,
                   control_role=role)


def _run(routes: list[tuple[str, str]], gap: float = 2.0, step: float = 0.25, twin_gap: float = 0.5,
         failing: tuple[float, float] = (0, 0)) -> RunData:
    """Pairs `gap` s apart, the warm twin `twin_gap` s after its cold one; `routes`: (cold's source, warm's source)
    per pair; a warm twin on its cold twin's replica hits. Both sources scraped every `step` s (none in `failing`)."""
    attempts, served = [], []  # served: (finish_ts, source, cached tokens)
    for n, (cold_at, warm_at) in enumerate(routes, start=1):
        t = 10 + gap * n
        hit = HIT if warm_at == cold_at else 0
        attempts += [_attempt(n, "cold", t, 0, 200.0), _attempt(n, "warm", t + twin_gap, hit, 20.0 if hit else 200.0)]
        served += [(t + 0.2, cold_at, 0), (t + twin_gap + 0.2, warm_at, hit)]
    end = 10 + gap * (len(routes) + 2)
    metrics = []
    for source in (A, B):
        for i in range(int((end - 9) / step) + 1):
            ts = 9 + i * step
            if failing[0] <= ts <= failing[1]:
                metrics.append({"ts": ts, "source": source, "ok": False, "error": "timeout after 2 s"})
                continue
            done = [(c, q) for f, s, c in served if s == source and f <= ts for q in [PROMPT]]
            hits = sum(c for c, _ in done)
            samples = {f'{SUCCESS}{{finished_reason="stop",engine="0"}}': float(len(done)),
                       'vllm:prefix_cache_queries_total{engine="0"}': float(PROMPT * len(done)),
                       'vllm:prefix_cache_hits_total{engine="0"}': float(hits),
                       'vllm:prompt_tokens_cached_total{engine="0"}': float(hits),
                       'vllm:kv_cache_usage_perc{engine="0"}': 0.1 + 0.01 * len(done),
                       'vllm:num_requests_waiting{engine="0"}': float(source == B)}
            metrics.append({"ts": ts, "source": source, "ok": True, "scrape_ms": 3.0, "vllm_series": len(samples),
                            "samples": samples})
    return RunData(path=Path("."), attempts=attempts, metrics=metrics,
                   stages=[StageWindow("control", "prefix_control", 10, end, 1)],
                   events=[{"ts": 9, "event": "cache_config", "labels": [{"block_size": "16"}]}])


def _judge(data: RunData):
    return judge_prefix_cache(data, MetricIndex(data.metrics), LIMITS)


def _pairs(data: RunData):
    return [(data.attempts[i], data.attempts[i + 1]) for i in range(0, len(data.attempts), 2)]


ROUND_ROBIN = [(A, B), (A, A), (B, A), (B, B)] * 2  # 4 of 8 warm twins on the other replica


def test_round_robin_names_the_router_not_eviction():
    result = _judge(_run(ROUND_ROBIN))
    assert result.status == FAIL, result.reasons
    reason = result.reasons[0]
    assert reason.startswith("the router sent 4 of 8 warm twins to another replica than their cold twin, and 4 of "
                             "them reused nothing: routing is not prefix-affine (use prefix-aware routing or "
                             "session affinity, e.g. --k3-session-header NAME"), reason
    assert "the gateway layer, not eviction" in reason and "4 of 8 (50%, 95% CI 22%-78%)" in reason
    assert not any("evicted" in r or "more pairs would decide" in r for r in result.reasons)
    routing = result.numbers["routing"]
    assert (routing["same"], routing["split"], routing["unknown"], routing["layer"]) == (4, 4, 0, "gateway")
    assert [p["meeting"] for p in routing["pairs"]] == ["split", "same"] * 4
    assert routing["pairs"][0] | {"why": None} == {"pair": 1, "meeting": "split", "cold_source": A, "warm_source": B,
                                                   "why": None}
    assert routing["reuse"]["same"]["warm_reused"] == 4 and routing["reuse"]["split"]["warm_reused"] == 0
    assert routing["reuse"]["all"]["warm_hit_share"] == HIT / PROMPT / 2
    rules = {r["id"]: r for r in result.numbers["rules"]}
    assert rules["cache.routing"]["interval"] is not None
    # The engine's own cache, judged on the pairs that met one replica: every warm twin there hit.
    assert rules["cache.hits"]["status"] == PASS and "4 of 8 pairs whose twins met one replica" in \
        rules["cache.hits"]["reason"]
    assert rules["cache.latency"]["status"] == INCONCLUSIVE
    assert "only the 4 of 8 pairs whose twins met one replica compare like with like" in \
        rules["cache.latency"]["reason"]


def test_split_twins_without_usage_name_the_router_but_do_not_fail_on_what_is_not_seen():
    data = _run(ROUND_ROBIN)
    for attempt in data.attempts:  # vLLM without --enable-prompt-tokens-details: no cached_tokens
        attempt.cached_tokens = None
    result = _judge(data)
    assert result.status == INCONCLUSIVE, result.reasons
    assert result.reasons[0].startswith("inconclusive, because the router sent 4 of 8 warm twins to another replica "
                                        "than their cold twin, and their responses carry no cached_tokens")
    assert "--enable-prompt-tokens-details" in result.reasons[0]


def test_affinity_passes_and_says_every_pair_met_one_replica():
    result = _judge(_run([(A, A), (B, B)] * 4))
    assert result.status == PASS, result.reasons
    assert "8 of 8 pairs' twins met one replica over 2 replicas (per-source vllm:prefix_cache_queries_total, " \
        "vllm:request_success_total" in result.reasons[0]
    rows = {r["source"]: r for r in result.numbers["replicas"]}
    assert rows[A]["requests"] == rows[B]["requests"] == 8 and rows[A]["control_requests"] == 8
    assert rows[A]["hit_share"] == HIT * 4 / (PROMPT * 8)
    assert rows[B]["waiting_max"] == 1.0 and rows[A]["waiting_max"] == 0.0
    assert rows[A]["kv_usage_max"] == 0.18 and 0.1 < rows[A]["kv_usage_mean"] < 0.18


def test_the_reports_show_each_replica_and_where_the_pairs_went():
    numbers = _judge(_run(ROUND_ROBIN)).numbers
    section = report_md._replicas(numbers)
    assert section.startswith("## Replicas\n\n| source | requests | control_requests | kv_usage_max |")
    assert f"| {A} | 8 | 8 | 0.18 |" in section
    assert "met one replica: 4; another replica: 4; not told: 0" in section and "reused their prefix across the " \
        "replicas: 4 of 8" in section
    assert "<h2>Replicas</h2>" in markdown_to_html(section) and f"<td>{A}</td>" in markdown_to_html(section)
    assert report_md._replicas({}) == ""  # one replica: no section


def test_twins_that_share_one_scrape_interval_are_still_told_apart():
    # Scrapes 1.5 s apart, each pair inside one interval: whether cold and warm met one replica is told by the
    # pair's bracket (one source up by 2, or two up by one each), though neither twin is placed alone.
    data = _run([(A, B), (A, A)], gap=2.0, step=1.5, twin_gap=0.35)
    routing = route_pairs(data, MetricIndex(data.metrics), _pairs(data))
    assert routing is not None
    assert [(p.meeting, p.cold_source, p.warm_source) for p in routing.pairs] == [
        (Meeting.SPLIT, None, None), (Meeting.SAME, A, A)]


def test_pairs_that_share_brackets_with_their_neighbours_are_unknown_and_said_so():
    # Scrapes 10 s apart, pairs 2 s apart: every bracket holds four pairs, on both replicas.
    result = _judge(_run(ROUND_ROBIN, step=10.0))
    routing = result.numbers["routing"]
    assert routing["unknown"] == 8, routing
    assert result.status == INCONCLUSIVE, result.reasons
    assert result.reasons[0].startswith("inconclusive, because the per-source counters could not tell which replica")
    assert "--k3-sample-interval" in result.reasons[0] and "routing or eviction" in result.reasons[0]
    assert "4 of them were not seen to reuse their prefix" in result.reasons[0]
    assert not any("more pairs would decide" in r for r in result.reasons)


def test_a_failed_scrape_in_the_window_leaves_the_pair_unknown():
    data = _run([(A, B)] * 8, failing=(12.0, 12.6))  # pair 1: 12.0-12.8
    routing = route_pairs(data, MetricIndex(data.metrics), _pairs(data))
    assert routing is not None and routing.pairs[0].meeting is Meeting.UNKNOWN
    assert "failed" in (routing.pairs[0].why or "")
    assert {p.meeting for p in routing.pairs[1:]} == {Meeting.SPLIT}


def test_one_source_is_not_routing():
    data = _run([(A, A)] * 8)
    data.metrics = [m for m in data.metrics if m["source"] == A]
    result = _judge(data)
    assert result.status == PASS and "routing" not in result.numbers and "replicas" not in result.numbers


def test_split_pairs_that_still_hit_mean_a_shared_cache_and_pass():
    data = _run([(A, B), (A, A)] * 4)
    for attempt in data.attempts:
        if attempt.control_role == "warm":
            attempt.cached_tokens, attempt.ttft_ms = HIT, 20.0
    for line in data.metrics:  # the hits counted where the warm twins went, as an external KV store shows them
        if line.get("ok"):
            done = line["samples"][f'{SUCCESS}{{finished_reason="stop",engine="0"}}']
            line["samples"]['vllm:prefix_cache_hits_total{engine="0"}'] = \
                line["samples"]['vllm:prompt_tokens_cached_total{engine="0"}'] = HIT * (done // 2)
    result = _judge(data)
    routing_rule = result.numbers["rules"][0]
    assert routing_rule["id"] == "cache.routing" and routing_rule["status"] == PASS, routing_rule
    assert "4 met another and still reused their prefix (a cache shared across replicas)" in routing_rule["reason"]


# -- the attribution over arbitrary scrape sequences --------------------------------------------------------------

@st.composite
def _scene(draw):
    """A cold/warm pair (cold sent at 10 s, warm when it ended) served by any of two or three sources, foreign
    traffic at random times, sources and sizes, and each source scraped at random times (at least once: every
    replica is given), some scrapes failed, some slow to read. The server admits a request (its prompt's tokens
    on vllm:prefix_cache_queries_total) after it was sent and by its first token, and finishes it (one on the
    request counter) after that and by its end."""
    sources = ["s0", "s1", "s2"][:draw(st.integers(2, 3))]
    cold_s, warm_s = draw(st.floats(0.01, 2.0)), draw(st.floats(0.01, 2.0))
    spans = [(10.0, 10 + cold_s), (10 + cold_s, 10 + cold_s + warm_s)]
    served = [draw(st.sampled_from(sources)), draw(st.sampled_from(sources))]
    first = [send + (end - send) * draw(st.floats(0.001, 1.0)) for send, end in spans]
    admitted = [send + (ft - send) * draw(st.floats(0.001, 1.0)) for (send, _), ft in zip(spans, first, strict=True)]
    finished = [ad + (end - ad) * draw(st.floats(0.0, 1.0)) for ad, (_, end) in zip(admitted, spans, strict=True)]
    # (time, source, tokens admitted, requests finished)
    events = [(t, s, PROMPT, 0) for t, s in zip(admitted, served, strict=True)]
    events += [(t, s, 0, 1) for t, s in zip(finished, served, strict=True)]
    for t, s, size in draw(st.lists(st.tuples(st.floats(5, 16), st.sampled_from(sources), st.sampled_from(
            [1, PROMPT, 2 * PROMPT])), max_size=4)):
        events += [(t, s, size, 0), (t + draw(st.floats(0, 1)), s, 0, 1)]
    metrics = []
    for source in sources:
        for ts in sorted(set(draw(st.lists(st.floats(5, 16), min_size=1, max_size=12)))):
            read = draw(st.floats(0, 0.2))
            if draw(st.integers(0, 5)) == 0:
                metrics.append({"ts": ts, "source": source, "ok": False})
                continue
            seen = [e for e in events if e[1] == source and e[0] <= ts + read]
            metrics.append({"ts": ts, "source": source, "ok": True, "scrape_ms": read * 1000, "vllm_series": 2,
                            "samples": {f'{SUCCESS}{{finished_reason="stop"}}': float(sum(e[3] for e in seen)),
                                        'vllm:prefix_cache_queries_total{engine="0"}': float(sum(e[2] for e in seen))}})
    return spans, first, served, metrics


@given(_scene())
def test_a_request_is_placed_on_its_true_source_or_on_none(scene):
    spans, _, served, metrics = scene
    ticks = timelines(RunData(path=Path("."), metrics=metrics), SUCCESS)
    index = MetricIndex(metrics)
    (send, end), truth = spans[0], served[0]
    rise = moved(ticks, {s: index.edge_s(s) for s in ticks}, send, end)
    if isinstance(rise, str):
        return
    up = [s for s, n in rise.items() if n > 0]
    assert truth in up  # the request's own count is inside every bracket: never missed
    if len(up) == 1:
        assert up == [truth]
    for source, line in ticks.items():  # a bracket never spans a failed scrape, nor is any source left out
        assert source in rise
        before = max(t.ts for t in line if t.read_until_ts <= send)
        after = min(t.ts for t in line if t.ts >= end + SETTLE_S)
        assert all(t.count is not None for t in line if before <= t.ts <= after)


@given(_scene())
def test_a_pair_is_told_same_or_split_only_as_it_was(scene):
    spans, first, served, metrics = scene
    cold, warm = (_attempt(1, role, send, 0, 10.0, end - send, ft) for role, (send, end), ft in zip(
        ("cold", "warm"), spans, first, strict=True))
    data = RunData(path=Path("."), attempts=[cold, warm], metrics=metrics)
    routing = route_pairs(data, MetricIndex(metrics), [(cold, warm)])
    assert routing is not None
    [route] = routing.pairs
    if route.meeting is not Meeting.UNKNOWN:
        assert route.meeting is (Meeting.SAME if served[0] == served[1] else Meeting.SPLIT)
    assert route.cold_source in (None, served[0]) and route.warm_source in (None, served[1])


def test_every_pair_split_is_the_routers_never_the_engines_cache():
    """Strict round robin with nothing else on it: every warm twin on the other replica, no hit anywhere. The
    engine's cache had nothing to hit: cache.hits cannot be judged apart from the routing, never a fail."""
    result = _judge(_run([(A, B), (B, A)] * 4))
    rules = {r["id"]: r for r in result.numbers["rules"]}
    assert rules["cache.routing"]["status"] == FAIL, rules["cache.routing"]
    assert rules["cache.hits"]["status"] == INCONCLUSIVE and "no pair's twins were seen to meet one replica" in \
        rules["cache.hits"]["reason"], rules["cache.hits"]
    assert not any("no prefix-cache hits" in r for r in result.reasons), result.reasons


def test_a_router_that_rebalances_now_and_then_is_not_failed_for_it():
    """One pair split and lost: too few to fail routing (at most 5% of conversations may be rebalanced), said;
    among many pairs it passes with the pass; many split pairs fail."""
    few = {r["id"]: r for r in _judge(_run([(A, B)] + [(A, A)] * 15)).numbers["rules"]}
    assert few["cache.routing"]["status"] == INCONCLUSIVE and "a rebalance now and then" in \
        few["cache.routing"]["reason"], few["cache.routing"]
    data = _run([(A, B)] + [(A, A), (B, B)] * 60, gap=1.5)
    for line in data.metrics:  # _run's KV gauge grows a point a request: held low, as a cache of this size is
        if line["ok"]:
            line["samples"]['vllm:kv_cache_usage_perc{engine="0"}'] = 0.2
    many = {r["id"]: r for r in _judge(data).numbers["rules"]}
    assert many["cache.routing"]["status"] == PASS, many["cache.routing"]  # 1 of 121: below 5% with 95% confidence
    assert "1 met another and reused nothing (1 of 121" in many["cache.routing"]["reason"]
    lost = {r["id"]: r for r in _judge(_run([(A, B), (A, A)] * 8)).numbers["rules"]}
    assert lost["cache.routing"]["status"] == FAIL and "routing is not prefix-affine" in lost["cache.routing"]["reason"]
