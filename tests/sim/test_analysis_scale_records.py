"""The lean record loader reads what the whole records say (issue 16, item 4): the loader rewritten for an
hour's soak (lean records, streamed, msgspec where it decodes a line, json.loads where it refuses) must give
each field as a whole `Attempt` read by json.loads gives it, and skip only a torn last line (every other bad
line is an error naming it, never a lost record). Checked on the stored scale run (tests/sim/scale_run.py),
on lines laid out as the harness writes them and otherwise, and on random tool-call names. The whole
judgment at scale against the straightforward path is test_analysis_scale.py.
"""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3load import evidence
from k3load.analysis.analyze import judge
from k3load.analysis.pillars.agent.reproducibility import signature_of
from k3load.analysis.run import rundata
from k3load.analysis.run.lean import NUMBERS, LeanAttempt, call_name, plain_number
from k3load.analysis.run.record_columns import RecordColumns
from k3load.analysis.run.record_decode import RecordDecoder
from k3load.records import Attempt, Finding, read_records
from k3load.workload.validate import primary_layer
from tests.sim.scale_run import _attempts_frame, _unpack, same_columns


def test_lean_records_carry_what_the_attempts_did(tmp_path: Path) -> None:
    run = _unpack(tmp_path / "run")
    whole, columns = _attempts_frame(run)
    data = rundata.load_run(run)
    assert same_columns(data.columns, columns)
    leans = rundata.read_attempts(evidence.records_file(run))
    assert len(leans) == len(whole)
    for a, lean in zip(whole, leans, strict=True):
        _same(a, lean)
    # a loaded run keeps whole only what a rule reads whole (the control's requests, the drills, ...), and the
    # judgment picks no other row: the records file is read once
    assert data.kept is not None and data.kept and len(data.kept) < len(whole) / 4
    for i, lean in data.kept.items():
        _same(whole[i], lean)
    assert judge(run).data.rereads == 0
    other = min(set(range(len(whole))) - set(data.kept))  # a row not kept: read again from the file
    picked = data.pick(data.columns.rows()[np.arange(len(whole)) == other])
    assert picked[0].attempt_id == whole[other].attempt_id and data.rereads == 1


def _record(i: int, **extra: Any) -> dict[str, Any]:
    return Attempt(run_id="r", attempt_id=f"a{i}", chain_id=f"c{i}", attempt=1, stage="s", scenario="x",
                   family="f", turn=0, turn_kind="answer", user_id="u", request_sha256="h", prefix_sha256="p",
                   transport="t", status="ok", send_ts=float(i), end_ts=i + 0.5, **extra).__dict__ | {
                       "findings": [Finding("transport", True).__dict__]}


def test_records_reader_skips_only_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    lines = [json.dumps(_record(1, content="a\u2028b\x85c")), json.dumps(_record(2)), '{"run_id": "r", "att']
    path.write_text("\n".join(lines), encoding="utf-8")
    assert [a.attempt_id for a in rundata.read_attempts(path)] == ["a1", "a2"]  # U+2028 ends no line
    path.write_text("\n".join([lines[0], lines[2], lines[1]]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"records.jsonl:2: not an attempt record"):
        rundata.read_attempts(path)
    path.write_text(json.dumps({k: v for k, v in _record(3).items() if k != "stage"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="stage"):
        rundata.read_attempts(path)
    # A whole last line (it has its "\n") that does not parse was not torn: an error, never a lost record.
    path.write_text("\ufeff" + json.dumps(_record(4)) + "\n", encoding="utf-8")  # an editor's BOM
    with pytest.raises(ValueError, match=r"records.jsonl:1: not an attempt record"):
        rundata.read_attempts(path)
    done = subprocess.run([sys.executable, "-m", "k3load", "analyze", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().endswith("not an attempt record: Unexpected UTF-8 BOM (decode using utf-8-sig): "
                                        "line 1 column 1 (char 0)") and len(done.stderr.splitlines()) == 1
    # Bytes that are not UTF-8: a whole line is an error naming it (it was a traceback from the decoder);
    # a last line torn inside a character is a torn line.
    good, other = json.dumps(_record(5)).encode(), json.dumps(_record(6)).encode()
    assert b'"stage": "s"' in other
    path.write_bytes(good + b"\n" + other.replace(b'"stage": "s"', b'"stage": "s\xff"') + b"\n" + good + b"\n")
    with pytest.raises(ValueError, match=r"records.jsonl:2: not an attempt record: not UTF-8"):
        rundata.read_attempts(path)
    done = subprocess.run([sys.executable, "-m", "k3load", "analyze", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "records.jsonl:2: not an attempt record: not " \
        "UTF-8" in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr[-2000:]
    path.write_bytes(good + b"\n" + other[:-3] + "é".encode()[:1])
    assert [a.attempt_id for a in rundata.read_attempts(path)] == ["a5"]
    assert rundata.load_run(tmp_path).problems == [  # skipped, and said with the verdict
        f"records.jsonl:2: the last line ({len(other) - 2:,} bytes, no line end) skipped as cut mid-write"]


def test_lines_longer_than_a_block_and_a_file_that_is_one_torn_line(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Records (and their non-ASCII text) across many blocks, plain and compressed; a file without a line end
    (not JSON lines at all: a misplaced file) is one torn line, said as such, its pieces joined once (they
    were copied block after block: 29 s for 320 MB)."""
    monkeypatch.setattr(evidence, "READ_BYTES", 256)
    records = [_record(i, content=("é\u2028" if i % 2 else "x") * (500 * i)) for i in range(1, 6)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    run = tmp_path / "run"
    run.mkdir()
    for name, data in (("records.jsonl", text.encode()), (evidence.RECORDS, gzip.compress(text.encode()))):
        (run / name).write_bytes(data)
        path = evidence.records_file(run)
        assert path.name == name
        assert [a.attempt_id for a in rundata.read_attempts(path)] == [f"a{i}" for i in range(1, 6)]
        assert [json.loads(x)["content"] for x in evidence.lines(path)] == [r["content"] for r in records]
    (run / evidence.RECORDS).unlink()
    (run / "records.jsonl").write_bytes(b"\x00" * 200_000)
    data = rundata.load_run(run)
    assert data.kept == {} and data.problems == [
        "records.jsonl:1: the last line (200,000 bytes, no line end) skipped as cut mid-write"]


def _read_both(path: Path) -> list[tuple[Attempt, Any]]:
    """Each line as a whole Attempt (json.loads) beside the loader's lean attempt."""
    return list(zip(read_records(path), rundata.read_attempts(path), strict=True))


def _same(whole: Attempt, lean: Any) -> None:
    for f in fields(LeanAttempt):
        if f.name == "answer_signature":  # derived: what the answer did (analysis/pillars/agent/reproducibility.py)
            assert lean.answer_signature == signature_of(whole)
            continue
        value = getattr(whole, f.name)
        if f.name == "tool_calls":
            value = tuple(call_name(c) for c in value)
        elif f.name == "findings":
            value = tuple(value)
        elif f.name == "error_body" and whole.http_status != 400:
            value = None
        elif f.name in NUMBERS:  # a count or time that is no plain number (a string, past 2**53): unknown
            value = plain_number(value, 0 if f.name == "chunks" else None)
        elif f.name == "primary_layer" and value is None and not whole.valid:  # a record from before the field
            layer = primary_layer(list(whole.findings))  # a Layer member: the lean attempt keeps its plain string
            value = None if layer is None else str(layer)
        assert repr(getattr(lean, f.name)) == repr(value), f.name  # repr: NaN, -0.0 and types count


def test_the_decoder_reads_every_field_as_the_whole_record_gives_it(tmp_path: Path) -> None:
    """Lines laid out as the harness writes them and otherwise: findings whose text spells keys, a
    `findings` key nested in a call, another key order, calls named at the top level or not at all, and
    values msgspec refuses (NaN, Infinity's overflow, a lone surrogate, a call of another shape), which
    are read whole: every kept field equals what the whole record says."""
    tricky = Finding("expect.json", False, "model_output", 'said ],"valid": and ,"findings":[ in "quotes"')
    records = [_record(1) | {"findings": [tricky.__dict__], "valid": False},
               _record(2) | {"tool_calls": [{"function": {"name": "f", "findings": [1]}, "valid": 2}]},
               dict(reversed(list(_record(3).items()))),
               _record(4) | {"findings": [], "tool_calls": [{"name": "top"}, {"function": None}, {}]},
               _record(5) | {"ttft_ms": float("nan"), "e2e_ms": -0.0, "prompt_tokens": 2**70},
               _record(6) | {"http_status": 400, "error_body": "bad \ud83d"},
               _record(7) | {"http_status": 400, "error_body": '{"object":"error"}'},
               _record(8) | {"tool_calls": ["named"], "failed_layers": ["parser"], "primary_layer": None},
               _record(9) | {"request_bytes": "12", "chunks": True, "stream_reads": 10 ** 400, "cached_tokens": 7}]
    path = tmp_path / "records.jsonl"
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    path.write_text(text, encoding="utf-8")
    pairs = _read_both(path)
    assert len(pairs) == len(records)
    for whole, lean in pairs:
        _same(whole, lean)
    assert pairs[0][1].primary_layer == "model_output" and pairs[3][1].tool_calls == ("top", "", "")
    assert pairs[5][1].error_body == "bad \ud83d" and pairs[7][1].tool_calls == ("named",)
    assert pairs[4][1].prompt_tokens is None and (pairs[8][1].request_bytes, pairs[8][1].chunks,
                                                   pairs[8][1].stream_reads, pairs[8][1].cached_tokens) == (None, 0,
                                                                                                           None, 7)
    columns = RecordColumns()
    decoder = RecordDecoder(rundata.Interner(), [], columns)
    taken = [decoder.take(line) for line in text.splitlines(keepends=True)]
    # NaN, a lone surrogate, a bare name, counts that are no plain numbers
    assert taken == [True, True, True, True, False, False, True, False, False]
    assert len(columns) == 5
    assert [decoder.take(line.encode()) for line in text.splitlines(keepends=True)] == taken  # from UTF-8 bytes
    loaded = rundata.load_run(tmp_path)
    assert len(loaded.columns) == 9  # every line, the ones read whole too, in its columns as in its attempt
    assert loaded.columns.rows().values("primary_layer") == [lean.primary_layer for _, lean in pairs]


def test_tool_call_names_decoded_are_the_parsed_names(tmp_path: Path) -> None:
    """Names with quotes, escapes, control characters, U+2028, none at all, ASCII-escaped or not."""
    rng = random.Random(1)
    chars = "ab \"\\\x00\x1f\u00e9\u2028\u0085{}[],:"
    lines, wanted = [], []
    for i in range(1500):
        calls = [{"id": rng.choice([None, 'x"y', "id1"]), "type": "function",
                  "function": {"name": rng.choice([None, "", "".join(rng.choices(chars, k=rng.randint(0, 8)))]),
                               "arguments": "".join(rng.choices(chars, k=rng.randint(0, 30)))}}
                 for _ in range(rng.randint(0, 3))]
        lines.append(json.dumps(_record(i) | {"tool_calls": calls}, ensure_ascii=rng.random() < 0.3,
                                separators=(",", ":")))
        wanted.append(tuple(call_name(c) for c in calls))
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert [a.tool_calls for a in rundata.read_attempts(path)] == wanted


@pytest.mark.parametrize("text", [
    '{"ts": 1.5, "samples": {"vllm:x{a=\\"b\\"}": 3.0}}', '{"a": 1e400, "b": -1e400}', '{"a": NaN, "b": Infinity}',
    '{"a": "\\ud800"}', '{"a": 123456789012345678901234567890}', '{"a": -0.0, "b": -0}', '{"a": 1, "a": 2}',
    '{"a": "\\u2028\\u0085"}', '{"a": 5e-324, "b": 1E2}', '[1, 2]', '"text"'])
def test_a_jsonl_line_decodes_as_json_loads_gives_it(text: str) -> None:
    """metrics.jsonl, gpu.jsonl and events.jsonl lines go through msgspec where it decodes them, json.loads
    where it refuses: the same objects either way (repr: NaN, -0.0 and int/float told apart)."""
    assert repr(rundata.json_line(text)) == repr(json.loads(text))


def test_a_line_that_is_not_json_is_refused_as_json_loads_refuses_it() -> None:
    with pytest.raises(json.JSONDecodeError, match="Expecting"):
        rundata.json_line('{"ts": 1.5, "samples": ')


_NOT_OURS = st.one_of(st.booleans(), st.none(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                      st.lists(st.integers(), max_size=2))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["attempt", "turn", "valid"]), _NOT_OURS, st.integers(1, 3))
def test_an_attempt_turn_or_validity_of_another_type_is_refused_with_its_line(name: str, value: Any, line: int
                                                                             ) -> None:
    """The numbers every rule orders, groups and counts by are k3load's types or the line is refused, named
    (a "2" among integers crashed the retry chains with a TypeError: never a traceback, never a guess)."""
    if name == "valid" and type(value) is bool:
        value = "yes"
    if name != "valid" and type(value) is int:
        value = str(value)
    records = [_record(i) for i in range(1, 4)]
    records[line - 1][name] = value
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "records.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        with pytest.raises(ValueError, match=rf"records.jsonl:{line}: not an attempt record: {name} is "):
            rundata.read_attempts(path)


def test_a_refused_attempt_number_stops_the_analysis_with_one_line(tmp_path: Path) -> None:
    records = [_record(1), _record(2) | {"attempt": "2", "chain_id": "c1"}]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "k3load", "analyze", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().endswith('records.jsonl:2: not an attempt record: attempt is a string ("2"), not an '
                                        "integer") and len(done.stderr.splitlines()) == 1
