"""A block of a committed file that is generated from declarations, between two marker lines.

Why: a rule, a threshold, a stage kind or a sim fault is declared once in code, and the docs and the plan schema
that list them are rendered from that declaration (issue 30). The rendered text is committed, so a reader of the
repository sees it; a test renders it again and fails when the committed file is stale, and the generator's
`--write` puts it right. Used by k3load/sim/fault_docs.py and analysis/pillars/rule_docs.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def replace_block(current: str, begin: str, end: str, body: str) -> str:
    """`current` with the text between the `begin` line and the `end` marker replaced by `body` (both markers must
    be there, once each)."""
    if current.count(begin + "\n") != 1 or current.count(end) != 1:
        raise ValueError(f"the markers must each be there once: {begin!r} ... {end!r}")
    head, rest = current.split(begin + "\n", 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def write_or_check(argv: Sequence[str], module: str, root: Path,
                   files: Sequence[tuple[Path, Callable[[str], str]]]) -> int:
    """`--write`: render each file afresh where stale; `--check`: exit 1 naming the stale ones. 2: bad usage."""
    if list(argv) not in (["--write"], ["--check"]):
        print(f"usage: python -m {module} --write | --check", file=sys.stderr)
        return 2
    write = list(argv) == ["--write"]
    stale = []
    for path, render in files:
        current = path.read_text()
        wanted = render(current)
        if wanted != current:
            stale.append(str(path.relative_to(root)))
            if write:
                path.write_text(wanted)
    print(("rewrote: " if write else "stale: ") + ", ".join(stale) if stale else "up to date")
    return 1 if stale and not write else 0
