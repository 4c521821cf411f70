"""Markdown cells and tables as both reports write them (report.md, and report.html rendered from it).

Why a module of its own: every report section formats numbers the same way ("–" for unknown, three
significant figures, pipes escaped), whichever module writes the section.
"""

from __future__ import annotations

from typing import Any


def fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "–"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    if not rows:
        return "none\n"
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |\n" for r in rows)
