"""gpu.jsonl framed a row at a time (analysis/run/row_columns.py) is the frame `pd.DataFrame(rows)` made of
the whole list: the same columns in the same order, dtypes and values, on rows of any shape (keys first
seen late, missing keys, None, mixed types, nested values, integers past int64), so the GPU-memory rules
read the same frame while a day's rows are never held as dicts."""

from __future__ import annotations

from typing import Any

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.analysis.run.row_columns import RowColumns

values = st.one_of(st.none(), st.floats(allow_nan=False), st.integers(-2**70, 2**70), st.text(max_size=3),
                   st.booleans(), st.just({}), st.lists(st.integers(), max_size=2))
rows = st.lists(st.dictionaries(st.sampled_from(["ts", "gpu", "memory_used_mib", "name", "extra"]), values,
                                max_size=5), max_size=8)


@settings(max_examples=600, deadline=None)
@given(rows=rows)
def test_rows_framed_one_at_a_time_are_the_frame_of_the_list(rows: list[dict[str, Any]]) -> None:
    columns = RowColumns()
    for row in rows:
        columns.add(row)
    pd.testing.assert_frame_equal(columns.frame(), pd.DataFrame(rows), check_exact=True)


def test_a_repeated_string_is_held_once() -> None:
    columns = RowColumns()
    for n in range(3):
        columns.add({"source": "".join(["nv", "ml"]), "gpu": n})  # a new string object each row, as decoded
    held = columns.columns["source"]
    assert held[0] is held[1] is held[2]


def test_a_gpu_reading_that_is_no_number_is_unknown_and_said(tmp_path) -> None:
    """Another writer's gpu.jsonl: a memory of "n/a", a line that is no object. The rules get NaN, not a string
    (which failed inside pandas), and the verdict says what was not read."""
    from k3load.analysis.run.rundata import _gpu_frame

    path = tmp_path / "gpu.jsonl"
    path.write_text('{"ts": 1.0, "gpu": 0, "memory_used_mib": "n/a", "memory_total_mib": 80.0}\n[1]\n'
                    '{"ts": 2.0, "gpu": 0, "memory_used_mib": 5.0, "memory_total_mib": true}\n')
    problems: list[str] = []
    frame = _gpu_frame(path, problems)
    assert frame["memory_used_mib"].isna().tolist() == [True, False]
    assert frame["memory_total_mib"].isna().tolist() == [False, True]
    assert problems == ["gpu.jsonl: a line that is not a JSON object (list) skipped",
                        "gpu.jsonl: 1 reading(s) whose memory_used_mib is not a number, read as unknown",
                        "gpu.jsonl: 1 reading(s) whose memory_total_mib is not a number, read as unknown"]
