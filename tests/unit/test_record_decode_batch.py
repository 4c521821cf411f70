"""A records file read a batch of lines at a time (`RecordDecoder.take_many`, straight into the columns) gives what
reading every line on its own gives (`RecordDecoder.take`, a lean attempt per line): the same columns value for value
and type for type, the same records kept whole by row, the same refusals, over files of any shape (odd values in
any field, lines msgspec refuses, drills and the chains they name, control requests, refusals, failed checks)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3load.analysis.run import rundata
from k3load.analysis.run.record_columns import FIELDS, NAMES, Kind, RecordColumns
from k3load.analysis.run.record_decode import RecordDecoder
from k3load.records import Attempt, Finding

CHAINS = ("c0", "c1", "0123456789abcdef0123456789abcdef", "k3load-" + "a" * 32)
FINDINGS = (
    [Finding("transport", True).__dict__],
    [Finding("transport", True).__dict__, Finding("expect.tool_call", False, "model_output", "none").__dict__],
    [Finding("harness.error", False, "harness", "boom").__dict__],
    [Finding("stream.stall", False, "transport", "8 s").__dict__],
    [Finding("tool_call.cadence", True).__dict__],
    [],
)
ODD = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                st.text(max_size=5), st.lists(st.integers(), max_size=2), st.just({"k": 1}))


def _base(i: int) -> dict[str, Any]:
    return Attempt(run_id="r", attempt_id=f"{i:032x}", chain_id="c0", attempt=1, stage="load", scenario="x",
                   family="f", turn=0, turn_kind="tool_call", user_id="u", request_sha256="h", prefix_sha256="p",
                   transport="t", status="ok", send_ts=float(i), end_ts=i + 0.5).__dict__


@st.composite
def records_file(draw: st.DrawFn) -> list[str]:
    """Lines of a records file: mostly a run's own records, varied where the rules and the reader branch."""
    lines = []
    for i in range(draw(st.integers(0, 40))):
        record = _base(i) | {
            "chain_id": draw(st.sampled_from(CHAINS)), "attempt": draw(st.integers(1, 3)),
            "drill": draw(st.sampled_from([False, False, False, True, 1, "yes"])),
            "control_role": draw(st.sampled_from([None, None, "cold", "warm"])),
            "http_status": draw(st.sampled_from([200, 200, 400, 400.0, 500, None, "400"])),
            "findings": draw(st.sampled_from(FINDINGS)), "valid": draw(st.booleans()),
            "primary_layer": draw(st.sampled_from([None, "model_output", "parser"])),
            "turn_kind": draw(st.sampled_from(["tool_call", "json", "answer", None])),
            "temperature": draw(st.sampled_from([0.0, 0, 0.7, None])), "seed": draw(st.sampled_from([None, 7, 7.0])),
            "content": draw(st.sampled_from(["", '{"a": 1}', "not json", None])),
            "tool_calls": draw(st.sampled_from([[], [{"function": {"name": "get", "arguments": "{}"}}],
                                                [{"name": "top"}, {"function": None}]])),
            "error_body": draw(st.sampled_from([None, "maximum context length"])),
            "error": draw(st.sampled_from([None, "Connection refused", 3])),
        }
        for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):  # a field of another type than a run writes, or none
            name = draw(st.sampled_from(sorted(set(record) - {"findings"}) + [n for n in NAMES if n not in record]))
            if draw(st.booleans()):
                record[name] = draw(ODD)
            else:
                record.pop(name, None)
        kind = draw(st.sampled_from(["line"] * 40 + ["nan", "not-json", "array", "blank", "non-ascii"]))
        text = json.dumps(record, separators=(",", ":"), ensure_ascii=kind != "non-ascii")
        lines.append({"nan": text.replace('"send_ts":', '"send_ts":NaN,"x":', 1), "not-json": text[:-3],
                      "array": f"[{text}]", "blank": "", "non-ascii": text.replace('"s"', '"é"')}.get(kind, text))
    return lines


def _read(path: Path, batches: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """The file as the loader reads it: in batches, or every line through `take` (the reading before batches)."""
    with monkeypatch.context() as patch:
        if not batches:
            patch.setattr(RecordDecoder, "take_many", lambda self, lines: False)
        problems: list[str] = []
        try:
            kept, columns = rundata._read_kept(path, problems)
        except rundata.UnreadableRecords as exc:
            return ("refused", str(exc))
    return kept, columns, problems


def _typed(values: list[Any]) -> list[tuple[type, str]]:
    return [(type(v), repr(v)) for v in values]


def _same_columns(mine: RecordColumns, theirs: RecordColumns) -> None:
    assert len(mine) == len(theirs)
    for name in NAMES:
        a, b = mine.array(name), theirs.array(name)
        assert a.dtype == b.dtype and (a.tobytes() == b.tobytes() or (
            a.dtype.kind == "f" and np.array_equal(a, b, equal_nan=True))), name
        ours, other = mine.columns[name], theirs.columns[name]
        if FIELDS[name] is Kind.NUMBER:
            assert mine.is_int(name).tolist() == theirs.is_int(name).tolist() and ours.int_only == other.int_only
        if ours.codes is not None and other.codes is not None:
            assert _typed(ours.codes.values) == _typed(other.codes.values), name
        if ours.shared is not None and other.shared is not None:
            assert ours.shared.values == other.shared.values, name


def _same_lean(a: Any, b: Any) -> None:
    for slot in type(a).__slots__:
        x, y = getattr(a, slot), getattr(b, slot)
        assert type(x) is type(y) and (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))), slot


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=records_file(), batch=st.integers(1, 9))
def test_a_file_read_in_batches_is_read_as_line_by_line(lines: list[str], batch: int, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    with monkeypatch.context() as patch:
        patch.setattr(rundata, "DECODE_BATCH", batch)  # a batch's edge anywhere in the file
        mine = _read(path, True, monkeypatch)
    theirs = _read(path, False, monkeypatch)
    if mine[0] == "refused" or theirs[0] == "refused":
        assert mine == theirs
        return
    _same_columns(mine[1], theirs[1])
    assert sorted(mine[0]) == sorted(theirs[0]) and mine[2] == theirs[2]
    for row, lean in mine[0].items():
        _same_lean(lean, theirs[0][row])


def test_a_run_of_drills_and_controls_keeps_whole_what_the_rules_read(tmp_path: Path) -> None:
    """The rows kept whole by a batch: a drill and every later attempt of its chain (an earlier one of that chain
    is not), control requests, refusals, failed stream checks, harness errors; none other."""
    records = [_base(0) | {"chain_id": "d"},  # before the drill: not kept
               _base(1) | {"chain_id": "d", "drill": True},
               _base(2) | {"chain_id": "d", "attempt": 2},
               _base(3) | {"control_role": "cold"},
               _base(4) | {"http_status": 400, "error_body": "maximum context length"},
               _base(5) | {"findings": [Finding("stream.stall", False, "transport", "8 s").__dict__]},
               _base(6) | {"findings": [Finding("stream.stall", True).__dict__]},
               _base(7) | {"findings": [Finding("harness.error", False, "harness", "boom").__dict__]},
               _base(8)]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    kept, columns = rundata._read_kept(path, [])
    assert sorted(kept) == [1, 2, 3, 4, 5, 7] and len(columns) == 9
    assert kept[4].error_body == "maximum context length" and kept[2].attempt == 2
