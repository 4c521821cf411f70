"""Rules moved from the attempts read whole to the record columns give what they gave: each one's column reading
against its reading of every attempt whole, over runs of any shape (analysis/run/record_columns.py: the columns
choose the few records a rule still reads whole, `RunData.pick`, and count the rest)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.analysis.pillars.agent.agreement import findings_schema_ok
from k3load.analysis.pillars.agent.pillar_agent import (
    _chains,
    _chains_whole,
    _drill,
    _drill_whole,
    _rates,
    context_refusals,
)
from k3load.analysis.pillars.agent.retry_paths import _path_counts, path_counts
from k3load.analysis.pillars.headroom.buffering import (
    BLOCK_BYTES_PER_READ,
    BLOCK_EVENTS_PER_READ,
    BUFFERED_SHARE,
    FIX,
    LAYER,
    MIN_CHUNKS,
    MIN_READS,
    MIN_STREAMS,
    STRAIGHT_SHARE,
    Delivery,
    StreamDelivery,
    stream_delivery,
)
from k3load.analysis.run.clusters import attempt_key, rate_by_keys, rate_by_request
from k3load.analysis.run.lean import by_findings
from k3load.analysis.run.rundata import RunData, columns_of
from k3load.analysis.run.stats import Rate, wilson
from k3load.analysis.run.timeline import MetricIndex
from k3load.outcomes import LAYERS
from k3load.records import Attempt, Finding
from k3load.sampler.vllm_metrics import VllmMetric
from k3load.workload.retry_policy import AttemptPath
from k3load.workload.validate import context_length

CHAINS = ("c0", "c1", "c2", "0123456789abcdef0123456789abcdef", None)


@st.composite
def attempts(draw: Any) -> list[Attempt]:
    """Chains of retries and fallbacks in any order, numbered as records number them or not (a float, a string),
    with or without their recorded path."""
    out = []
    for i in range(draw(st.integers(0, 12))):
        number = draw(st.sampled_from([1, 1, 1, 2, 3, 1.0, 2.0, "2"]))
        out.append(Attempt(
            run_id="r", attempt_id=f"a{i}", chain_id=draw(st.sampled_from(CHAINS)), attempt=number, stage="load",
            scenario="s", family="agent", turn=0, turn_kind="answer", user_id="u",
            request_sha256=draw(st.sampled_from(["x", "y"])), prefix_sha256="p", transport="fake", status="ok",
            send_ts=1.0, end_ts=2.0, valid=draw(st.booleans()), will_retry=draw(st.booleans()),
            drill=draw(st.booleans()),
            path=draw(st.sampled_from([None, *(p.value for p in AttemptPath), "other"]))))
    return out


@settings(max_examples=150, deadline=None)
@given(attempts())
def test_path_counts_on_the_columns_are_those_of_every_attempt_read_whole(run: list[Attempt]) -> None:
    try:
        whole = _path_counts(run)
    except TypeError:  # a string numbered attempt compared with an integer: the rule fails on it either way
        return
    assert path_counts(RunData(path=Path("."), attempts=run)) == whole


# -- stream delivery: the reading of every attempt whole, as it was before the columns (the reference) ---------------
def _counted(attempt: Any) -> bool:
    """A streamed answer that ended well, long enough to show blocks, with its reads counted."""
    return bool(attempt.stream) and attempt.status == "ok" and attempt.chunks >= MIN_CHUNKS and \
        bool(attempt.stream_reads) and attempt.stream_bytes is not None


def in_blocks(attempt: Any) -> bool:
    """Many events and kilobytes per read: a buffer's blocks, not the server's pacing."""
    reads = attempt.stream_reads or 1
    return attempt.chunks / reads >= BLOCK_EVENTS_PER_READ and (attempt.stream_bytes or 0) / reads >= \
        BLOCK_BYTES_PER_READ


def _whole_stream_delivery(attempts: Sequence[Any], index: MetricIndex, saturated_stages: Sequence[str] = ()
                           ) -> StreamDelivery:
    """Straight, buffered or unknown, from the streams outside `saturated_stages` (a saturated load
    generator reads late and piles events up in its own socket)."""
    streamed = [a for a in attempts if a.stream and a.status == "ok" and a.chunks >= MIN_CHUNKS]
    if not streamed:
        return StreamDelivery(Delivery.UNKNOWN, "inconclusive, because no streamed answer of at least "
                              f"{MIN_CHUNKS} token chunks ended well")
    counted = [a for a in streamed if _counted(a)]
    if not counted:
        return StreamDelivery(Delivery.UNKNOWN, "inconclusive, because the records do not count the reads that "
                              "carried each stream (written before stream_reads existed)")
    hot = set(saturated_stages)
    cool = [a for a in counted if a.stage not in hot]
    telling = [a for a in cool if (a.stream_reads or 0) >= MIN_READS]
    whole = len(cool) - len(telling)
    if len(telling) < MIN_STREAMS:
        why = (f"the load generator was saturated in {', '.join(sorted(hot))} (its own socket piles events up)"
               if hot and len(counted) >= MIN_STREAMS else
               f"{whole} arrived whole, in one or two reads (written faster than read, or held whole)" if whole
               else "")
        return StreamDelivery(Delivery.UNKNOWN, f"inconclusive, because only {len(telling)} streamed answers of at "
                              f"least {MIN_CHUNKS} chunks came in {MIN_READS} reads or more (at least {MIN_STREAMS} "
                              "are needed)" + (f": {why}" if why else ""), len(telling))
    blocked = wilson(sum(1 for a in telling if in_blocks(a)), len(telling))
    events = statistics.median(a.chunks / (a.stream_reads or 1) for a in telling)
    size = statistics.median((a.stream_bytes or 0) / (a.stream_reads or 1) for a in telling)
    ttfts = [a.ttft_ms for a in telling if a.ttft_ms is not None]
    client = statistics.median(ttfts) if ttfts else None
    t0, t1 = min(a.send_ts for a in telling), max(a.end_ts for a in telling)
    server = index.histogram_bucket(VllmMetric.TIME_TO_FIRST_TOKEN, t0, t1, 0.5)
    numbers: dict[str, Any] = {"streams": len(telling), "blocked": blocked, "events_per_read_p50": round(events, 2),
               "bytes_per_read_p50": round(size), "client_ttft_p50_ms": round(client, 3) if client else None,
               "server_ttft": server}
    pattern = (f"{blocked.k} of {len(telling)} streamed answers of {MIN_READS} reads or more (95% CI {blocked.low:.1%}-"
               f"{blocked.high:.1%}) reached the client in blocks: a median {events:.1f} SSE events and {size:,.0f} "
               "bytes per socket read (a server's own pacing is about one event a read)")
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
        return StreamDelivery(Delivery.STRAIGHT, f"no proxy's blocks: median {events:.1f} events and {size:,.0f} bytes "
                              f"per read over {len(telling)} streamed answers of {MIN_READS} reads or more "
                              f"({blocked.k} in blocks, 95% CI {blocked.low:.1%}-{blocked.high:.1%}){arrived_whole}",
                              **numbers)
    return StreamDelivery(Delivery.UNKNOWN, f"inconclusive, because {pattern}{arrived_whole}: a proxy buffers every "
                          "stream, a server or client running behind only some", **numbers)




@st.composite
def streams(draw: Any) -> list[Attempt]:
    """Answers streamed or not, ended well or not, short or long, in one read or many, small or large reads (a run
    mostly in a proxy's blocks, mostly paced, or mixed), in a saturated stage or not, with their reads counted or
    not (older records), their TTFT known or not."""
    out = []
    blocky = draw(st.sampled_from([0.0, 0.5, 0.95, 1.0]))  # the share of answers a proxy's blocks carried
    for i in range(draw(st.sampled_from([0, 5, 15, 60, 150]))):
        in_blocks = draw(st.floats(0, 1)) < blocky
        chunks = draw(st.one_of(st.integers(0, 7), st.integers(8, 200), st.integers(60, 200)))
        told = draw(st.sampled_from(["none", "few", "many", "many", "many", "many"]))  # how its reads were counted
        if told == "none":
            reads = None
        elif told == "few":
            reads = draw(st.integers(0, 2))
        else:
            reads = draw(st.integers(3, max(3, chunks // 8)) if in_blocks else
                         st.integers(max(3, chunks // 2), max(3, chunks)))
        per_read = draw(st.integers(2048, 5000) if in_blocks else st.integers(0, 400))
        size = None if told == "none" and draw(st.booleans()) else per_read * max(reads or 1, 1)
        out.append(Attempt(
            run_id="r", attempt_id=f"a{i}", chain_id=f"c{i}", attempt=1,
            stage=draw(st.sampled_from(["load", "load", "hot"])), scenario="s", family="agent", turn=0,
            turn_kind="answer", user_id="u", request_sha256="x", prefix_sha256="p", transport="fake",
            status=draw(st.sampled_from(["ok", "ok", "ok", "timeout"])), send_ts=draw(st.floats(0, 100)),
            end_ts=draw(st.floats(100, 200)), stream=draw(st.sampled_from([True, True, True, False])),
            chunks=chunks, stream_reads=reads, stream_bytes=size,
            ttft_ms=draw(st.one_of(st.none(), st.floats(0.0, 5000.0)))))
    return out


@settings(max_examples=200, deadline=None)
@given(streams(), st.sampled_from([(), ("hot",)]))
def test_stream_delivery_on_the_columns_is_that_of_every_attempt_read_whole(run: list[Attempt],
                                                                            hot: tuple[str, ...]) -> None:
    index = MetricIndex([])
    whole = _whole_stream_delivery(run, index, hot)
    found = stream_delivery(columns_of(run).rows(), index, hot)
    assert (found.to_dict(), found.reason) == (whole.to_dict(), whole.reason)


# -- the agent pillar's chains, drills and context refusals ------------------------------------------------------------
CONTEXT_400 = ('{"error":{"message":"This model\'s maximum context length is 1024 tokens. However, your prompt '
               'contains %d input tokens and requested 64 output tokens.","type":"BadRequestError",'
               '"param":"input_tokens","code":400}}')


@st.composite
def chained(draw: Any) -> list[Attempt]:
    """Chains of tries, retries, drills and refusals as runs record them: numbers in any order, tokens known or
    not (integers, sometimes a float), the same bytes across chains, 400s with vLLM's context-length body."""
    out = []
    for i in range(draw(st.sampled_from([0, 3, 12, 40]))):
        status = draw(st.sampled_from(["ok", "ok", "timeout", "http_error"]))
        refused = status == "http_error" and draw(st.booleans())
        out.append(Attempt(
            run_id="r", attempt_id=f"a{i}", chain_id=draw(st.sampled_from(["c0", "c1", "c2", "c3", "c4", "c5"])),
            attempt=draw(st.sampled_from([1, 1, 2, 3])), stage="load", scenario="s",
            family=draw(st.sampled_from(["agent", "long_input"])), turn=0, turn_kind="answer", user_id="u",
            request_sha256=draw(st.sampled_from(["x", "y", "z"])), prefix_sha256="p", transport="fake",
            status=status, send_ts=1.0, end_ts=2.0, valid=draw(st.booleans()), will_retry=draw(st.booleans()),
            drill=draw(st.booleans()), chunks=draw(st.integers(0, 50)),
            prompt_tokens=draw(st.one_of(st.none(), st.integers(0, 3000), st.integers(0, 3000), st.floats(0, 3000))),
            request_bytes=draw(st.one_of(st.none(), st.integers(0, 12000))),
            http_status=400 if refused else 200 if status == "ok" else None,
            error_body=CONTEXT_400 % draw(st.integers(1025, 4000)) if refused else None))
    return out


@settings(max_examples=200, deadline=None)
@given(chained())
def test_chains_drills_and_refusals_on_the_columns_are_those_of_every_attempt_read_whole(run: list[Attempt]) -> None:
    data = RunData(path=Path("."), attempts=run)
    rows = data.columns.rows()
    assert repr(_chains(rows, data.pick)) == repr(_chains_whole(run))  # repr: an integer stays one
    assert _drill(rows, data.pick) == _drill_whole(run)
    assert repr(context_refusals(rows, data.pick)) == repr(_whole_context_refusals(run))


def _whole_context_refusals(attempts: list[Any]) -> dict[str, Any]:
    """vLLM's context-length 400s per family: the prompts' tokens against the server's max_model_len.

    vLLM counts a refused prompt only up to max_model_len + 1 ("at least N"), so the size the operator
    needs (how much context to give) is estimated from the bytes each refused request sent, at the
    tokens per byte of the run's answered requests, and marked as an estimate."""
    per_byte = _whole_tokens_per_byte(attempts)
    out: dict[str, Any] = {}
    for attempt in attempts:
        found = context_length(attempt.error_body) if attempt.http_status == 400 else None
        if not found:
            continue
        family = out.setdefault(attempt.family, {"refused": 0, "attempts": 0, "max_model_len": found.max_model_len,
                                                 "prompt_tokens_min": None, "prompt_tokens_max": None,
                                                 "counted_only_to_the_limit": False, "prompt_tokens_estimated": None,
                                                 "completion_tokens_max": None})
        family["refused"] += 1
        if found.prompt_tokens is not None:
            known = [t for t in (family["prompt_tokens_min"], family["prompt_tokens_max"]) if t is not None]
            family["prompt_tokens_min"] = min([*known, found.prompt_tokens])
            family["prompt_tokens_max"] = max([*known, found.prompt_tokens])
        family["counted_only_to_the_limit"] |= found.at_least
        if found.completion_tokens is not None:  # the prompt fit; with the output budget asked for it did not
            family["completion_tokens_max"] = max(family["completion_tokens_max"] or 0, found.completion_tokens)
        if per_byte and attempt.request_bytes:
            estimate = round(attempt.request_bytes * per_byte)
            family["prompt_tokens_estimated"] = max(family["prompt_tokens_estimated"] or 0, estimate)
    for attempt in attempts:
        if attempt.family in out:
            out[attempt.family]["attempts"] += 1
    for family in out.values():
        # The run's average tokens per byte can undercount one prompt (an agent's late turn, dense with tool
        # JSON, was estimated at 1,018 where vLLM counted at least 1,025); vLLM's floor is known, so an
        # estimate below it is known to be wrong and is raised to it.
        if family["prompt_tokens_estimated"] and family["counted_only_to_the_limit"] and family["prompt_tokens_max"]:
            family["prompt_tokens_estimated"] = max(family["prompt_tokens_estimated"], family["prompt_tokens_max"])
    return out


def _whole_tokens_per_byte(attempts: list[Any]) -> float | None:
    """Prompt tokens per body byte over the answered requests (None when none reports both)."""
    pairs = [(a.prompt_tokens, a.request_bytes) for a in attempts
             if a.status == "ok" and a.prompt_tokens and a.request_bytes]
    return sum(t for t, _ in pairs) / sum(b for _, b in pairs) if pairs else None




# -- the agent pillar's rates: the reading of every attempt whole, as it was before the columns (the reference) ------
def _whole_rates(attempts: list[Any]) -> tuple[dict[str, Any], Rate]:
    """Each failed attempt counted once, under its primary layer; a check failing only as the
    consequence of another layer's fault (a parser that lost the call fails `expect.tool_call`
    too) is counted apart, as secondary. Every rate's interval is over the distinct requests
    (analysis/run/clusters.py); the valid rate is returned with the numbers."""
    layers = Counter(a.primary_layer for a in attempts if a.primary_layer)
    primary: Counter[str] = Counter()
    secondary: Counter[str] = Counter()
    position = {id(a): i for i, a in enumerate(attempts)}
    failing: dict[str, np.ndarray] = {}  # per primary check: which attempts failed it
    for findings, group in by_findings(attempts):  # each distinct list of findings read once
        failed = [f for f in findings if not f.ok]
        if not failed:
            continue
        for layer, n in Counter(a.primary_layer for a in group).items():
            for f in failed:
                (primary if f.layer == layer else secondary)[f.check] += n
        for f in failed:
            marks = [position[id(a)] for a in group if a.primary_layer == f.layer]
            if marks:
                failing.setdefault(f.check, np.zeros(len(attempts), dtype=bool))[marks] = True
    tool_responses = [a for a in attempts if a.tool_calls or a.finish_reason == "tool_calls"]
    schema_ok = {id(a) for findings, group in by_findings(tool_responses) if findings_schema_ok(findings)
                 for a in group}
    keys = [attempt_key(a) for a in attempts]
    valid = rate_by_keys(keys, [a.valid for a in attempts])
    schema = rate_by_request(tool_responses, [id(a) in schema_ok for a in tool_responses])
    n = len(attempts)
    return {
        "attempts": n, "distinct_requests": valid.clusters, "valid": valid.k, "valid_rate": valid.value,
        "valid_rate_ci95": [valid.low, valid.high],
        "failed_by_layer": {layer: layers.get(layer, 0) for layer in LAYERS},
        "failed_by_check": dict(sorted(primary.items())),
        "secondary_failures_by_check": dict(sorted(secondary.items())),
        "check_failure_rates": {check: rate_by_keys(keys, failing[check]).to_dict() for check in sorted(primary)},
        "tool_call_responses": len(tool_responses),
        "tool_call_schema_accuracy": schema.value, "tool_call_schema_accuracy_ci95":
            [schema.low, schema.high] if tool_responses else None,
        "tool_call_schema_distinct_requests": schema.clusters,
    }, valid


FINDINGS = [[], [Finding("expect.tool_call", True)], [Finding("expect.tool_call", False, "model_output")],
            [Finding("tool_call.schema", False, "parser"), Finding("expect.tool_call", False, "model_output")],
            [Finding("transport", False, "gateway")], [Finding("expect.json", False, "parser")]]


@st.composite
def judged(draw: Any) -> list[Attempt]:
    """Attempts sharing their findings lists (as the decoder shares them) or not, each failing under its primary layer
    or another's, tool calls or not, drawn at a temperature with or without a seed, repeated bytes."""
    out = []
    for i in range(draw(st.sampled_from([0, 4, 20, 60]))):
        findings = draw(st.sampled_from(FINDINGS)) if draw(st.booleans()) else \
            [Finding(f.check, f.ok, f.layer) for f in draw(st.sampled_from(FINDINGS))]  # its own list
        failed = [f.layer for f in findings if not f.ok]
        calls = [{"function": {"name": "get_weather"}}] if draw(st.booleans()) else []
        out.append(Attempt(
            run_id="r", attempt_id=f"a{i % 50}", chain_id=f"c{i}", attempt=1, stage="load", scenario="s",
            family="agent", turn=0, turn_kind="tool_call", user_id="u",
            request_sha256=draw(st.sampled_from(["x", "y", "z", "w"])), prefix_sha256="p", transport="fake",
            status="ok", send_ts=1.0, end_ts=2.0, findings=findings, valid=not failed, tool_calls=calls,
            primary_layer=draw(st.sampled_from(failed)) if failed else None,
            finish_reason=draw(st.sampled_from(["stop", "tool_calls", None])),
            temperature=draw(st.sampled_from([None, 0, 0.0, 0.7, True])), seed=draw(st.sampled_from([None, 7]))))
    return out


@settings(max_examples=200, deadline=None)
@given(judged())
def test_the_agent_rates_on_the_columns_are_those_of_every_attempt_read_whole(run: list[Attempt]) -> None:
    rows = RunData(path=Path("."), attempts=run).columns.rows()
    found, valid = _rates(rows)
    whole, whole_valid = _whole_rates(run)
    assert repr(found) == repr(whole) and valid == whole_valid
