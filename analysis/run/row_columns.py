"""JSONL rows gathered straight into a frame's columns, so a file of many rows is never held as dicts.

Why: gpu.jsonl has a row per GPU per sampling round (8 GPUs at 1 Hz: 690,000 rows a day), and a parsed
row is a dict of about 1 KB; gathered as a list of dicts for `pd.DataFrame(rows)` a day's rows took
about 0.7 GB before the frame was built. Here each value goes to its column as the row passes, a string
value is one object however many rows repeat it, and the frame is built from the columns with the
dtypes `pd.DataFrame(rows)` gives (a column first seen at a later row is NaN before it, as there;
held to it by tests/unit/test_row_columns.py on rows of any shape).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


class RowColumns:
    """Rows (JSON objects) added one at a time; `frame()` is `pd.DataFrame(rows)` of the rows added."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {}
        self.rows = 0
        self._strings: dict[str, str] = {}

    def add(self, row: dict[str, Any]) -> None:
        columns, strings, n = self.columns, self._strings, self.rows
        for key, value in row.items():
            column = columns.get(key)
            if column is None:
                column = columns[key] = [np.nan] * n
            column.append(strings.setdefault(value, value) if type(value) is str else value)
        self.rows = n + 1
        if len(row) != len(columns):  # a column this row lacks: NaN, as pandas puts it
            for column in columns.values():
                if len(column) == n:
                    column.append(np.nan)

    def frame(self) -> pd.DataFrame:
        if not self.columns:  # no row had a key: pandas' own frame of so many empty rows
            return pd.DataFrame([{}] * self.rows)
        return pd.DataFrame(self.columns, columns=list(self.columns))
