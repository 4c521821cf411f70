"""No import cycle in `k3load/` (with `analysis/` as `k3load.analysis`, as it is installed).

Why: a cycle is where a module stops having one job. `k3load/loadgen/` had one of seven modules (session, delivery,
cpu, drain, observe, restart_drill, worker) because the session was handed whole to helpers that read one or two of
its fields; each helper now takes what it reads, and this test keeps it so, naming the cycle and the import lines
that close it.

What counts as an import: every `import` and `from ... import` anywhere in a module's source, parsed with `ast`:
at the top, under `if TYPE_CHECKING:` (a type-only import is still a dependency of the reader: mypy follows it,
and the annotation cannot be understood without the other module) and inside functions (a lazy import runs the
first time the function does, so a cycle through it only moves the failure from import time to run time; the few
lazy imports the harness has, the analysis loaded where a run is judged, point one way and form no cycle, so
there is nothing to excuse). `from package import name` is an edge to `package.name` where that is a module,
else to the package. A package's `__init__` is not counted for importing its submodules (Python runs it, but an
`__init__` that imports nothing of its children adds no dependency between them).
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tests.import_graph import ROOT, import_graph, imports_of, modules


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: the package is deep enough for recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                return [*paths[node], start]
            if child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    return component


def describe(cycle: list[str], lines: dict[tuple[str, str], int], files: dict[str, Path]) -> str:
    return " -> ".join(cycle) + "\n" + "\n".join(
        f"    {files[a].relative_to(ROOT)}:{lines[(a, b)]} imports {b}" for a, b in itertools.pairwise(cycle))


def test_the_graph_sees_the_kinds_of_import_that_count(tmp_path: Path) -> None:
    """A type-only import, a lazy one and a relative one are edges; a module outside the package is not."""
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nimport json\nif TYPE_CHECKING:\n    from k3load.a import B\n"
                      "def f():\n    import k3load.b.c\nfrom .d import e\n")
    known = {"k3load.a", "k3load.b", "k3load.pkg.d", "k3load.pkg.m"}
    assert sorted(imports_of("k3load.pkg.m", module, known)) == [("k3load.a", 4), ("k3load.b", 6),
                                                                 ("k3load.pkg.d", 7)]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert one_cycle({"a": {"b"}, "b": {"c", "a"}, "c": {"a"}}, ["a", "b", "c"]) == ["a", "b", "a"]


def test_loadgen_has_no_import_cycle() -> None:
    graph, lines = import_graph()
    files = modules()
    cycles = [describe(one_cycle(graph, c), lines, files) for c in strongly_connected(graph)
              if any(m.startswith("k3load.loadgen.") for m in c)]
    assert not cycles, "import cycles through k3load.loadgen (type-only and lazy imports count):\n" + "\n".join(cycles)


def test_k3load_has_no_import_cycle() -> None:
    graph, lines = import_graph()
    files = modules()
    assert len(graph) > 200 and "k3load.analysis.verdict" in graph  # the whole package, analysis/ included
    cycles = [describe(one_cycle(graph, c), lines, files) for c in strongly_connected(graph)]
    assert not cycles, "import cycles (type-only and lazy imports count):\n" + "\n".join(cycles)
