"""analysis/'s rooms import one way: run data <- pillars <- decision <- outputs <- the entry points on top.

Why: the layout is only worth having while it holds. A pillar that imports the reports, or run data that imports a
pillar, is where a cycle starts (the answer signature lived in the agent pillar while the record decoder needed
it); this test names the import that broke the order, with its file and line. Imports under `if TYPE_CHECKING:`
and inside functions count: a type-only edge is still a dependency of the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANALYSIS = ROOT / "analysis"
# Each room and the rooms it may import (besides itself and k3load outside analysis/).
ALLOWED = {
    "run": set(),
    "pillars": {"run"},
    "decision": {"run", "pillars"},
    "outputs": {"run", "pillars", "decision"},
    "top": {"run", "pillars", "decision", "outputs", "top"},
}


def room_of(path: Path) -> str:
    parts = path.relative_to(ANALYSIS).parts
    return parts[0] if len(parts) > 1 else "top"


def imported_rooms(source: str) -> list[tuple[int, str, str]]:
    """(line, module, room) for every import of k3load.analysis.* in a module's source, wherever it sits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            names = [f"{base}.{a.name}" for a in node.names] if base == "k3load.analysis" else [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith("k3load.analysis."):
                first = name.split(".")[2]
                found.append((node.lineno, name, first if first in ALLOWED and first != "top" else "top"))
    return found


def test_every_module_sits_in_a_known_room() -> None:
    rooms = {room_of(p) for p in ANALYSIS.rglob("*.py")}
    assert rooms <= set(ALLOWED), f"a room the import order does not know: {sorted(rooms - set(ALLOWED))}"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_the_rooms_below_it(room: str) -> None:
    broken = [f"{p.relative_to(ROOT)}:{line} imports {name} ({other})"
              for p in sorted(ANALYSIS.rglob("*.py")) if room_of(p) == room
              for line, name, other in imported_rooms(p.read_text()) if other != room and other not in ALLOWED[room]]
    assert not broken, f"{room} may import only {sorted(ALLOWED[room]) or 'k3load'}:\n" + "\n".join(broken)


def test_the_walker_sees_every_kind_of_import() -> None:
    """The checker itself: plain, package-level, type-only and function-level imports are all found."""
    source = """
from typing import TYPE_CHECKING
from k3load.analysis.outputs import report_md
from k3load.analysis import verdict
if TYPE_CHECKING:
    from k3load.analysis.pillars.pillar import PillarResult
def late():
    import k3load.analysis.decision.ramp
"""
    assert [(line, room) for line, _, room in imported_rooms(source)] == [
        (3, "outputs"), (4, "top"), (6, "pillars"), (8, "decision")]
