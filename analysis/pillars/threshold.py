"""One threshold a plan may set (`thresholds.SECTION.KEY`): its default, the values it may take, its unit and help.

Why a declaration: a threshold is read by a rule, defaulted in the analysis, validated by the plan's schema and
told in the docs; declared once as data (analysis/pillars/thresholds_table.py), the defaults, the schema's
`thresholds` and the docs' table are generated from it and cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Bound(Enum):
    """The values a threshold may take, as the plan schema says it."""

    COUNT = "count"  # an integer, at least 1
    SHARE = "share"  # a number from 0 to 1
    PERCENT = "percent"  # a number from 0 to 100
    POSITIVE = "positive"  # a number above 0
    NON_NEGATIVE = "non_negative"  # a number, 0 or more

    def schema(self) -> dict[str, Any]:
        """The JSON schema's words for it (key order as the schema file writes them)."""
        return {Bound.COUNT: {"type": "integer", "minimum": 1},
                Bound.SHARE: {"type": "number", "minimum": 0, "maximum": 1},
                Bound.PERCENT: {"type": "number", "minimum": 0, "maximum": 100},
                Bound.POSITIVE: {"type": "number", "exclusiveMinimum": 0},
                Bound.NON_NEGATIVE: {"type": "number", "minimum": 0}}[self]


@dataclass(frozen=True)
class Threshold:
    """`thresholds.<section>.<key>`; `default` None: no fixed default (the rule that reads it says what unset
    means); `at_most`: an upper bound beyond the Bound's own; `help`: the schema's description ("" for none)."""

    section: str
    key: str
    default: float | None
    bound: Bound
    unit: str
    help: str = ""
    at_most: float | None = None

    @property
    def path(self) -> str:
        return f"{self.section}.{self.key}"

    def schema(self) -> dict[str, Any]:
        out = self.bound.schema()
        if self.at_most is not None:
            out["maximum"] = self.at_most
        return out | ({"description": self.help} if self.help else {})
