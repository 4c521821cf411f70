"""analysis/'s rooms import one way: run data <- pillars <- decision <- outputs <- the entry points on top.

Why: the layout is only worth having while it holds. A pillar that imports the reports, or run data that imports a
pillar, is where a cycle starts (the answer signature lived in the agent pillar while the record decoder needed
it); this test names the import that broke the order, with its file and line. Imports under `if TYPE_CHECKING:`
and inside functions count: a type-only edge is still a dependency of the reader.
"""

from __future__ import annotations

import pytest

from tests.import_graph import ROOT, import_graph, modules

# Each room and the rooms it may import (besides itself and k3load outside analysis/).
ALLOWED = {
    "run": set(),
    "pillars": {"run"},
    "decision": {"run", "pillars"},
    "outputs": {"run", "pillars", "decision"},
    "top": {"run", "pillars", "decision", "outputs", "top"},
}
PACKAGE = "k3load.analysis"


def room_of(module: str) -> str:
    """`k3load.analysis.pillars.agent.x` -> "pillars"; a module on top (`k3load.analysis.verdict`) -> "top"."""
    first = module.removeprefix(PACKAGE).lstrip(".").split(".")[0]
    return first if first in ALLOWED and first != "top" else "top"


def test_every_module_sits_in_a_known_room() -> None:
    analysis = [name for name in modules() if name.startswith(PACKAGE + ".")]
    assert len(analysis) > 50
    folders = {path.relative_to(ROOT / "analysis").parts[0] for name, path in modules().items()
               if name in analysis and len(path.relative_to(ROOT / "analysis").parts) > 1}
    assert folders <= set(ALLOWED), f"a room the import order does not know: {sorted(folders - set(ALLOWED))}"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_the_rooms_below_it(room: str) -> None:
    graph, lines = import_graph()
    files = modules()
    broken = [f"{files[a].relative_to(ROOT)}:{lines[(a, b)]} imports {b} ({room_of(b)})"
              for a in sorted(graph) if a.startswith(PACKAGE + ".") and room_of(a) == room
              for b in sorted(graph[a]) if b.startswith(PACKAGE + ".") and room_of(b) != room
              and room_of(b) not in ALLOWED[room]]
    assert not broken, f"{room} may import only {sorted(ALLOWED[room]) or 'k3load'}:\n" + "\n".join(broken)


def test_rooms_are_read_from_module_names() -> None:
    assert [room_of(m) for m in ("k3load.analysis.run.stats", "k3load.analysis.pillars.agent.pillar_agent",
                                 "k3load.analysis.outputs", "k3load.analysis.verdict", "k3load.analysis")] == \
        ["run", "pillars", "outputs", "top", "top"]
