"""The records as columns (analysis/run/record_columns.py) hold what the rules read of any record, whatever it holds.

Why property tests: the columns take the fields of records.jsonl, outside bytes (a foreign writer, an older k3load,
a hand-edited file), and the stage table's rules read nothing else. Each kind must keep what the frame's rules made
of a field: a number or NaN, a value and its code, `bool()`, `== True`, "refused" in any case, an integer or none,
an id's text given back exactly; across batch boundaries, and split by stage exactly as the records name theirs.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.analysis.run import record_columns
from k3load.analysis.run.record_columns import FIELDS, MISSING_INT, NO_KEY, Kind, RecordColumns, distinct_keys

anything = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                     st.text(max_size=6), st.lists(st.integers(), max_size=2), st.just({"a": 1}))
uuids = st.binary(min_size=16, max_size=16).map(bytes.hex)
prefixed = st.builds(lambda prefix, tail: prefix + tail, st.sampled_from(["k3load-", "k3load-trace-", "é"]), uuids)
ids = st.one_of(uuids, uuids, prefixed, prefixed, st.none(), st.text(max_size=40),
                st.sampled_from(["A" * 32, "g" * 32, "0" * 32, "k3load-" + "A" * 32]))
stages = st.sampled_from(["load", "soak", "c8", None, 3])


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    counts = st.one_of(st.none(), st.integers(-2 ** 54, 2 ** 54))  # a run's own: integers or none, some past 2**53
    record = {name: draw(ids if kind is Kind.KEY else counts if kind is Kind.NUMBER and draw(st.booleans()) else
                         anything) for name, kind in FIELDS.items()}
    record["stage"] = draw(stages)
    record["error"] = draw(st.one_of(anything, st.sampled_from(["Connection REFUSED", "ConnectionRefusedError"])))
    return record


def _number(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            return math.nan
    return math.nan


def _same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


def _key_text(value: Any) -> Any:
    return value if value is None or isinstance(value, str) else ("unhashable", repr(value))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(records(), max_size=12), batch=st.integers(min_value=1, max_value=5))
def test_each_kind_keeps_what_the_rules_read_of_any_record(rows: list[dict[str, Any]], batch: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(record_columns, "BATCH", batch)  # batches joined at every boundary
        columns = RecordColumns.of(rows)
    assert len(columns) == len(rows)
    everything = columns.rows()
    for name, kind in FIELDS.items():
        given_values = [r[name] for r in rows]
        held = columns.array(name)
        if kind is Kind.NUMBER:
            assert all(_same_float(h, _number(v)) for h, v in zip(held.tolist(), given_values, strict=True))
            assert columns.columns[name].int_only == all(type(v) is int for v in given_values)
            assert columns.is_int(name).tolist() == [type(v) is int and abs(v) <= 2 ** 53 for v in given_values]
        elif kind is Kind.CODE:
            assert [repr(v) for v in everything.values(name)] == [
                repr(v if record_columns._hashable(v) else _key_text(v)) for v in given_values]
        elif kind is Kind.TRUTHY:
            assert held.tolist() == [bool(v) for v in given_values]
        elif kind is Kind.IS_TRUE:
            assert held.tolist() == [v == True for v in given_values]  # noqa: E712 (the frame's test)
        elif kind is Kind.REFUSED:
            assert held.tolist() == [isinstance(v, str) and re.search("refused", v, re.I) is not None
                                     for v in given_values]
        elif kind is Kind.INT:
            assert held.tolist() == [int(v) if type(v) in (int, bool) and abs(v) < 2 ** 63 else MISSING_INT
                                     for v in given_values]
        elif kind is Kind.SHARED:  # the same object, the same code; another object, another code
            table = columns.columns[name].shared
            assert table is not None
            assert [table.values[c] for c in held.tolist()] == given_values
            assert len(set(held.tolist())) == len({id(v) for v in given_values})
        else:
            assert everything.key_texts(name) == given_values  # ids given back exactly, uuids or not
            named = {v for v in given_values if v is not None}
            assert distinct_keys(held) == len(named)
            assert ((held["kind"] == NO_KEY) == [v is None for v in given_values]).all()
    for stage in ("load", "soak", "c8", "nowhere"):
        mine = columns.rows(stage)
        assert mine.file_positions().tolist() == [i for i, r in enumerate(rows) if r["stage"] == stage]
        assert mine.number("send_ts").tolist() == pytest.approx([_number(r["send_ts"]) for r in rows
                                                                  if r["stage"] == stage], nan_ok=True)


@settings(max_examples=60, deadline=None)
@given(tails=st.lists(uuids, min_size=1, max_size=20), prefix=st.sampled_from(["", "k3load-", "s-"]))
def test_a_batch_of_ids_of_one_form_is_read_at_once_and_given_back(tails: list[str], prefix: str) -> None:
    """The common case, a batch whose ids are all one prefix and a uuid's hex: read as one block of bytes."""
    rows = [{"session_id": prefix + t, "chain_id": t} for t in tails]
    everything = RecordColumns.of(rows).rows()
    assert everything.key_texts("session_id") == [r["session_id"] for r in rows]
    assert everything.key_texts("chain_id") == tails
    assert distinct_keys(everything.keys("session_id")) == len(set(tails))


def test_a_view_counts_and_selects_as_the_frame_did() -> None:
    rows = [{"stage": "s", "status": "ok", "primary_layer": None, "request_sha256": "a", "user_id": "u1"},
            {"stage": "s", "status": "timeout", "primary_layer": "server", "request_sha256": "a", "user_id": None},
            {"stage": "s", "status": "ok", "primary_layer": None, "request_sha256": None, "user_id": "u2"}]
    view = RecordColumns.of(rows).rows("s")
    assert view.counts("primary_layer") == {None: 2, "server": 1}
    assert view.distinct("request_sha256") == 1 and view.distinct("user_id") == 2  # None is no value (nunique)
    ok = view[view.code_is("status", "ok")]
    assert len(ok) == 2 and ok.values("user_id") == ["u1", "u2"]
    assert not view.code_is("status", "never seen").any() and len(RecordColumns().rows()) == 0
    assert ok.take(np.array([1, 0])).values("user_id") == ["u2", "u1"]


@settings(max_examples=60, deadline=None)
@given(sessions=st.lists(st.one_of(st.none(), st.sampled_from(["s1", "s2", "k3load-" + "a" * 32])), max_size=20))
def test_rows_of_one_session_share_a_group_and_a_row_without_one_is_alone(sessions: list[str | None]) -> None:
    """The diff's throughput clusters: rows with the same session share a group number, every row without a
    session is its own group."""
    group = RecordColumns.of([{"session_id": s} for s in sessions]).rows().groups("session_id").tolist()
    for i, (mine, session) in enumerate(zip(group, sessions, strict=True)):
        alike = {j for j, other in enumerate(sessions) if other == session and session is not None} or {i}
        assert {j for j, g in enumerate(group) if g == mine} == alike


@settings(max_examples=100, deadline=None)
@given(words=st.lists(st.tuples(st.sampled_from([0, 1, 2, 3]), st.integers(0, 3), st.integers(0, 3)), max_size=30))
def test_keys_are_grouped_as_numpy_groups_them(words: list[tuple[int, int, int]]) -> None:
    """Goodput's requests and sessions: the keys' groups, each row's group the same as `np.unique`'s."""
    keys = np.array(words, dtype=record_columns.KEY_DTYPE)
    count, inverse = record_columns.group_of(keys)
    unique, want = np.unique(keys, return_inverse=True) if len(keys) else (keys, np.empty(0, dtype=np.intp))
    assert count == len(unique) and inverse.tolist() == want.reshape(-1).tolist()
    good = np.array([w[1] != 3 for w in words], dtype=bool)
    every = record_columns.all_by_group(count, inverse, good)
    assert every.tolist() == [all(g for g, i in zip(good, inverse, strict=True) if i == n) for n in range(count)]
