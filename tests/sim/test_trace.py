"""Production traces (issue 28): the Mooncake-format parser, the prompts built from hash_ids, the replay's
schedule and its plan keys. No sockets but the sim's tokenizer called in-process."""

from __future__ import annotations

import gzip
import itertools
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from locust.runners import WorkerRunner

from k3load.loadgen.replay import Share, body, fell_behind, fitted, process_share, start
from k3load.sim.tokenizer import tokenize
from k3load.workload.plan import PlanError, load_plan, parse_plan
from k3load.workload.trace import (
    MAX_LINE_BYTES,
    TraceError,
    TraceRow,
    parse_lines,
    read_trace,
    read_trace_once,
    shared_prefix_blocks,
)
from k3load.workload.trace_prompts import CALIBRATE_BLOCKS, VERIFY_BLOCKS, BlockTexts

ROOT = Path(__file__).resolve().parents[2]


def mooncake_trace(sessions: int = 8, turns: int = 5, block_tokens: int = 64, span_ms: int = 8000,
                   seed: int = 1) -> list[dict[str, Any]]:
    """A Mooncake-format trace: conversations whose every turn carries the shared system block (id 0) and the
    full blocks of its previous turn, then new ones (its last block partial, so never reused: a longer prompt
    fills it with other tokens), spread over `span_ms`."""
    rng = random.Random(seed)
    rows, next_id = [], 1
    for _ in range(sessions):
        ids, t = [0], rng.uniform(0, span_ms * 0.4)
        for _ in range(turns):
            new = rng.randint(1, 3)
            ids = [*ids, *range(next_id, next_id + new)]
            next_id += new
            tail = rng.randint(1, block_tokens)
            rows.append({"timestamp": int(t), "input_length": (len(ids) - 1) * block_tokens + tail,
                         "output_length": rng.randint(4, 24), "hash_ids": list(ids)})
            ids = ids[:-1]  # the partial block is not the next turn's
            t += rng.uniform(0.1, 0.6) * span_ms / turns
    return sorted(rows, key=lambda r: r["timestamp"])


def write_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def sim_count(text: str) -> int:
    """The sim's /tokenize count of a prompt, in-process."""
    return len(tokenize(text))


# -- the parser -----------------------------------------------------------------------------------------------
def test_a_trace_reads_in_order_gzipped_or_not(tmp_path: Path) -> None:
    rows = mooncake_trace(block_tokens=512)
    plain = read_trace(write_trace(tmp_path / "t.jsonl", rows))
    zipped = read_trace(write_trace(tmp_path / "t.jsonl.gz", rows))
    assert plain == zipped and len(plain) == len(rows)
    assert plain[0] == TraceRow(rows[0]["timestamp"], rows[0]["input_length"], rows[0]["output_length"],
                                tuple(rows[0]["hash_ids"]), 1)
    assert len(read_trace(tmp_path / "t.jsonl", max_rows=7)) == 7


@pytest.mark.parametrize("line, says", [
    ('{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1]}', "1 hash_ids for input_length 600"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 5, "hash_ids": [1]}', "timestamp must be"),
    ('{"timestamp": 1, "input_length": 0, "output_length": 5, "hash_ids": []}', "input_length must be at least 1"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 2.5, "hash_ids": [1]}', "output_length must be an integer"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 5, "hash_ids": [-3]}', "hash_ids must be a list"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 5, "hash_ids": [true]}', "hash_ids must be a list"),
    ('[1, 2]', "must be a JSON object"),
    ('{"timestamp": 1,', "not JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": [1]}', "is before line 1's"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 5, "input_length": 5, "output_length": 5, "hash_ids": [9]}\n\n' + line + "\n")
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value).startswith(f"{path}:3: ") and says in str(caught.value)


def test_an_empty_unreadable_or_endless_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no rows"):
        read_trace(write_trace(tmp_path / "empty.jsonl", []))
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")
    (tmp_path / "bad.gz").write_bytes(b"not gzip")
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "bad.gz")
    (tmp_path / "long.jsonl").write_bytes(b" " * (MAX_LINE_BYTES + 10))
    with pytest.raises(TraceError, match=r"long.jsonl:1: line longer"):
        read_trace(tmp_path / "long.jsonl")


@settings(max_examples=200)
@given(st.lists(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                          st.builds(lambda t, i, o, h: json.dumps({"timestamp": t, "input_length": i,
                                                                  "output_length": o, "hash_ids": h}).encode(),
                                    st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True), st.none()),
                                    st.integers(-2, 3000), st.integers(-2, 50),
                                    st.lists(st.integers(-2, 10), max_size=8))), max_size=12))
@example([b'{"timestamp": 1e999, "input_length": 1, "output_length": 1, "hash_ids": [0]}'])
@example([b"[" * 100_000])
def test_any_bytes_parse_to_ordered_rows_or_one_named_error(lines: list[bytes]) -> None:
    try:
        rows = list(parse_lines(lines, "fuzz.jsonl", block_tokens=512))
    except TraceError as exc:
        assert str(exc).startswith("fuzz.jsonl:")
        return
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(rows))
    assert all(len(r.hash_ids) == -(-r.input_length // 512) and r.output_length >= 1 for r in rows)


def test_shared_prefix_blocks_follow_the_chain_from_the_start() -> None:
    rows = [TraceRow(0, 3, 1, ids, 1) for ids in ((1, 2, 3), (1, 2, 4), (5, 2, 3), (1, 2, 3, 9), (2, 3))]
    assert shared_prefix_blocks(rows) == [0, 2, 0, 3, 0]  # (2, 3) alone is not a prefix anyone had


# -- prompts --------------------------------------------------------------------------------------------------
def test_equal_hash_ids_give_equal_bytes_and_blocks_are_block_tokens_long() -> None:
    calls: list[str] = []

    def count(text: str) -> int:
        calls.append(text)
        return sim_count(text)

    texts = BlockTexts(64, count, list(range(100)))
    assert len(calls) == CALIBRATE_BLOCKS + VERIFY_BLOCKS  # bounded, whatever the trace
    assert texts.fit.tokenizer == "server /tokenize" and texts.fit.verified_tokens == [64] * VERIFY_BLOCKS
    one, two = texts.prompt((0, 7, 8), 64 * 2 + 10), texts.prompt((0, 7, 9), 64 * 3)
    assert sim_count(one) == 138 and sim_count(two) == 192
    shared = len(texts.text(0) + texts.text(7))
    assert one[:shared] == two[:shared] and one[shared:] != two[shared:shared + len(one) - shared]
    assert BlockTexts(64, sim_count, [1]).text(7) == texts.text(7)  # another process, the same bytes
    assert texts.text(8, 10) == texts.text(8)[: len(texts.text(8, 10))]  # a cut block: a prefix of the whole


def test_without_a_tokenizer_the_blocks_are_estimated_and_said_so() -> None:
    def refused(_text: str) -> int:
        raise ValueError("/tokenize: HTTPStatusError")

    for count in (None, refused):
        fit = BlockTexts(512, count).fit
        assert fit.tokenizer.startswith("estimate") and fit.as_dict()["blocks_verified"] == 0


# -- the schedule and the plan --------------------------------------------------------------------------------
def _plan(trace: str, **extra: Any) -> dict[str, Any]:
    return {"name": "p", "stages": [{"name": "replay", "kind": "replay", "trace": trace, "users": 4,
                                     "duration_s": 30, **extra}]}


def test_a_replay_stage_parses_with_its_defaults_and_its_trace_beside_the_plan(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl", mooncake_trace(block_tokens=512))
    (tmp_path / "p.yaml").write_text(json.dumps({**_plan("t.jsonl"), "history": "model"}))
    plan = load_plan(tmp_path / "p.yaml")
    spec = plan.stages[0].replay
    assert spec is not None and (spec.trace, spec.speed, spec.block_tokens, spec.max_rows) == \
        (str(tmp_path / "t.jsonl"), 1.0, 512, None)
    assert plan.stages[0].mix == {} and plan.families() == set() and plan.history == "model"
    assert parse_plan(_plan("x"), "p").history == "scripted"


@pytest.mark.parametrize("change, says", [
    ({"mix": {"agent": 1}}, "not for a replay stage"), ({"speed": 0}, "speed"), ({"arrival": {"sessions_per_s": 1}},
                                                                                 "not for a replay stage"),
    ({"block_tokens": 0}, "block_tokens")])
def test_a_bad_replay_stage_is_refused_naming_the_key(change: dict[str, Any], says: str) -> None:
    with pytest.raises(PlanError, match=says):
        parse_plan(_plan("t.jsonl", **change), "p.yaml")
    with pytest.raises(PlanError, match="only for a replay stage"):
        parse_plan({"name": "p", "stages": [{"name": "l", "kind": "load", "duration_s": 1, "users": 1,
                                             "mix": {"agent": 1}, "trace": "t.jsonl"}]}, "p.yaml")
    with pytest.raises(PlanError, match="history"):
        parse_plan({**_plan("t"), "history": "free"}, "p.yaml")


def test_a_bad_trace_stops_the_plan_naming_the_line(tmp_path: Path) -> None:
    rows = mooncake_trace(block_tokens=512)
    write_trace(tmp_path / "t.jsonl", [*rows[:3], {**rows[3], "hash_ids": [1]}])
    (tmp_path / "p.yaml").write_text(json.dumps(_plan("t.jsonl")))
    with pytest.raises(PlanError, match=r"stage replay: trace: .*t.jsonl:4: 1 hash_ids"):
        load_plan(tmp_path / "p.yaml")


def test_rows_are_due_at_the_traces_pace_split_by_process_and_bounded_by_the_stage(tmp_path: Path) -> None:
    rows = mooncake_trace(block_tokens=64, span_ms=8000)
    write_trace(tmp_path / "t.jsonl", rows)
    plan = parse_plan(_plan(str(tmp_path / "t.jsonl"), speed=2, block_tokens=64, duration_s=2), "p.yaml")
    state = start(plan.stages[0], 1000.0, Share(), None, None)
    t0 = rows[0]["timestamp"]
    expected = [1000 + (r["timestamp"] - t0) / 2000 for r in rows]
    assert [t.due_ts for t in state.tickets] == pytest.approx([e for e in expected if e < 1002])
    assert state.not_played == sum(e >= 1002 for e in expected) > 0  # past the stage's end: counted, not dropped
    halves = [start(plan.stages[0], 1000.0, Share(k, 2), None, None) for k in (0, 1)]
    assert sorted(t.index for h in halves for t in h.tickets) == [t.index for t in state.tickets]
    assert {t.index % 2 for t in halves[1].tickets} == {1}
    summary = state.summary()
    assert summary["rows_due"] == len(rows) and summary["rows_not_played"] == len(rows) and not summary["fell_behind"]


def test_a_worker_takes_its_share_and_one_that_cannot_know_it_plays_only_as_worker_zero() -> None:
    worker = type("Worker", (WorkerRunner,), {"__init__": lambda self: None, "__del__": lambda self: None})
    assert process_share(SimpleNamespace(), SimpleNamespace()) == Share()
    assert process_share(SimpleNamespace(**{"__class__": worker}), None) == Share()
    runner = worker()
    runner.worker_index = 2
    assert process_share(runner, SimpleNamespace(processes=4)) == Share(2, 4)
    assert process_share(runner, SimpleNamespace(processes=None)).why.startswith("worker count unknown")
    # remote workers: the master's count, sent with the stage, splits the rows; one past it plays none
    assert process_share(runner, SimpleNamespace(processes=None), 3) == \
        Share(2, 3, "3 workers (the master's count at the stage's entry)")
    late = process_share(runner, SimpleNamespace(processes=None), 2)
    assert (late.index, late.of) == (2, 1) and "past the master's 2 workers" in late.why
    assert not any(i % late.of == late.index for i in range(10))  # Share's rule: index mod of == index


def test_a_row_is_cut_to_the_context_and_asks_for_its_answer_length() -> None:
    row = TraceRow(0, 3000, 100, tuple(range(6)), 1)
    assert fitted(row, None) == (3000, 100, False) and fitted(row, 4096) == (3000, 100, False)
    assert fitted(row, 2048) == (2048 - 64 - 100, 100, True)
    sent = json.loads(body("m", "hello", 52))
    assert (sent["max_tokens"], sent["min_tokens"], sent["stream"]) == (52, 52, True)
    assert "min_tokens" not in json.loads(body("m", "hello", 52, min_tokens=False))


def test_a_server_that_refuses_min_tokens_is_sent_max_tokens_only_after_its_400(sim: Any) -> None:
    """A 400 naming min_tokens (here the sim's own, for a floor over max_tokens, as vLLM's SamplingParams says
    it) turns the parameter off for the later rows; other 400s do not."""
    import httpx

    from k3load.loadgen.replay import refuses_min_tokens
    from k3load.workload.conversation import Judged

    reply = httpx.post(f"{sim.base_url}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "min_tokens": 9})
    assert reply.status_code == 400

    def judged(status: int, text: str) -> Judged:
        return Judged(SimpleNamespace(http_status=status, error_body=text, error=None), [], None)  # type: ignore[arg-type]

    assert refuses_min_tokens(judged(400, reply.text))
    assert not refuses_min_tokens(judged(400, '{"error": {"message": "maximum context length is 2048"}}'))
    assert not refuses_min_tokens(judged(200, reply.text))


def test_who_fell_behind_is_named() -> None:
    summary = {"rows_late": 3, "rows_sent": 40, "worst_lag_s": 2.5, "users": 4, "share": "0 of 1"}
    assert "while all 4 users" in fell_behind(summary, 3)
    assert "could not keep up" in fell_behind(summary, 0)
    assert fell_behind({**summary, "rows_late": 0}, 0) is None


def test_a_late_row_names_whether_the_users_were_busy_or_the_process_was_slow(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl", mooncake_trace(block_tokens=64))
    state = start(parse_plan(_plan(str(tmp_path / "t.jsonl"), block_tokens=64), "p").stages[0], 1000.0, Share(),
                  None, None)
    first, second = state.tickets[0], state.tickets[1]
    assert state.take(first.due_ts + 5, free_since=first.due_ts + 4) is first  # its user was still sending
    assert state.take(second.due_ts + 5, free_since=0.0) is second  # its user was free: the process lagged
    assert state.late_all_busy == 1
    _the_stage_end_says_its_rows_and_lets_go(state)


def _the_stage_end_says_its_rows_and_lets_go(state: Any) -> None:
    """At the stage's end the summary counts every row due, then the schedule and the block texts are let go: no
    row is taken after it, and a text asked again (a row taken before the end) is made again, the same."""
    from k3load.loadgen.replay import finish

    due, text = len(state.tickets) + state.not_played, state.texts.text(7)
    said: list[dict[str, Any]] = []
    finish(state, said.append)
    assert said[0]["rows_due"] == due and said[0]["rows_sent"] == 0 and said[0]["rows_not_played"] == due
    assert state.tickets == [] and len(state.texts) == 0 and state.take(2e9, free_since=0.0) is None
    assert state.texts.text(7) == text
    finish(state, said.append)  # said once
    assert len(said) == 1


def test_replay_figures_sum_the_processes_and_a_late_replay_did_not_offer_the_traces_pace() -> None:
    from k3load.analysis.pillars.headroom.arrival_lag import replay_figures
    from k3load.analysis.pillars.headroom.stage_row import ArrivalLag, StageRow
    from k3load.analysis.pillars.headroom.stages import stage_breaches
    from k3load.analysis.pillars.pillar import thresholds

    ends = [{"stage": "r", "rows_due": 20, "rows_sent": 18, "rows_late": 5, "rows_not_played": 2, "rows_cut": 1,
             "worst_lag_s": 3.0, "in_flight_max": 4, "tokenizer": "server /tokenize", "fell_behind": "p0 behind"},
            {"stage": "r", "rows_due": 20, "rows_sent": 20, "rows_late": 0, "rows_not_played": 0, "rows_cut": 0,
             "worst_lag_s": 0.1, "in_flight_max": 3, "tokenizer": "server /tokenize", "fell_behind": None},
            {"stage": "other", "rows_due": 99}]
    figures = replay_figures(ends, "r")["replay"]
    assert (figures["rows_due"], figures["rows_sent"], figures["rows_not_played"], figures["processes"]) == \
        (40, 38, 2, 2) and figures["fell_behind"] == ["p0 behind"] and figures["worst_lag_s"] == 3.0
    assert replay_figures(ends, "none") == {}
    arrival = ArrivalLag(scheduled_turns=38, late_turns=5, late_share=5 / 38, late_share_ci95=[None, None],
                         send_lag_p50_ms=None, send_lag_p95_ms=None, send_lag_max_ms=None, sessions_arrived=None)
    stats = StageRow.of(stage="r", kind="replay", arrival=arrival, replay=figures)
    late = [p for p in stage_breaches(stats, thresholds(None)) if p.id == "load.offered_late"]
    assert len(late) == 1 and "p0 behind" in late[0].reason


def test_the_sim_honours_min_tokens_as_vllm_does() -> None:
    from k3load.sim.config import SimConfig
    from k3load.sim.generate import OutputPlan, Piece, truncate
    from k3load.sim.protocol import ApiError
    from k3load.sim.request_checks import validate_request

    short = OutputPlan([Piece("content", " a"), Piece("content", " b"), Piece("content", "")], "stop")
    rng = random.Random(0)
    assert len(truncate(short, 100, False, rng).pieces) == 3  # no min_tokens: the answer ends where it ends
    longer = truncate(short, 100, False, rng, min_tokens=40)
    assert (len(longer.pieces), longer.finish_reason, longer.pieces[-1].text) == (41, "stop", "")  # then its EOS
    exact = truncate(short, 40, False, rng, min_tokens=40)
    assert (len(exact.pieces), exact.finish_reason) == (40, "length")
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    validate_request({**base, "min_tokens": 5}, SimConfig())
    for bad, says in ((6, "less than or equal to max_tokens=5"), (-1, "greater than or equal to 0")):
        with pytest.raises(ApiError, match=says):
            validate_request({**base, "min_tokens": bad}, SimConfig())


def test_a_corrupt_gzip_trace_is_one_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n' * 200)
                    [:60] + b"\x00" * 40)
    with pytest.raises(TraceError, match=r"bad\.jsonl\.gz: cannot read the trace"):
        read_trace(bad)


def test_a_trace_is_parsed_once_while_its_file_is_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    first = read_trace_once(path, 512)
    assert read_trace_once(path, 512) is first  # the replay stage's start takes the plan check's rows
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1]}\n' * 2)
    again = read_trace_once(path, 512)
    assert again is not first and len(again) == 2


def test_a_workers_replay_end_writes_only_the_events_declared_fields(tmp_path: Path) -> None:
    """The worker port takes any peer: a message's own keys never reach events.jsonl."""
    from k3load.loadgen.replay import write_from_worker
    from k3load.rundir import JsonlLog

    log = JsonlLog(tmp_path / "events.jsonl")
    write_from_worker(log, "w1", {"run_id": "r", "stage": "replay", "rows_sent": 3, "verdict": "go",
                                  "api_key": "x"})
    write_from_worker(log, "w1", ["not", "a", "dict"])  # type: ignore[arg-type]
    log.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in e.items() if k != "ts"} for e in events] == [
        {"event": "replay_end", "stage": "replay", "rows_sent": 3}]
