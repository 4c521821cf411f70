"""The import graph of the installed package, read from source with `ast`: `k3load/` as `k3load`, `analysis/` as
`k3load.analysis` (setup.py's package_dir). Shared by tests/unit/test_import_cycles.py (no cycle) and
tests/unit/test_analysis_rooms.py (analysis/'s rooms import one way), so both count the same imports: every one,
at the top, under `if TYPE_CHECKING:` and inside functions (test_import_cycles.py's docstring says why)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the installed package: k3load/ as k3load, analysis/ as k3load.analysis (setup.py's package_dir)
TREES = ((ROOT / "k3load", "k3load"), (ROOT / "analysis", "k3load.analysis"))

def modules() -> dict[str, Path]:
    """Every module of the installed package, by its dotted name (a package by its own name: its __init__)."""
    found = {}
    for folder, prefix in TREES:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The module a relative `from .x import` names, as seen from module `name`."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module of the package, line) for every import in the module's source, wherever it sits."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, path.name == "__init__.py")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:  # `import k3load.x.y` where only k3load.x is ours: k3load.x
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """Each module's imported modules, and the first line of each edge (for the message)."""
    found = modules()
    known = set(found)
    graph: dict[str, set[str]] = {name: set() for name in found}
    lines: dict[tuple[str, str], int] = {}
    for name, path in found.items():
        for target, line in imports_of(name, path, known):
            graph[name].add(target)
            lines.setdefault((name, target), line)
    return graph, lines
