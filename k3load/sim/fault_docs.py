"""docs/sim.md's list of every fault, by where it strikes, generated from `FaultProfile`'s fields.

Why generated: a fault is declared once, as its field in k3load/sim/config.py (`knob(default, help, strikes)`);
`k3load sim --help` and docs/options.md print its help from there, and this list groups it. A new fault is then one
field and its test: `tests/unit/test_options_page.py` fails while the page is stale, and
`python -m k3load.sim.fault_docs --write` renders it afresh. The prose around the list says why the faults exist and
what they model; it names them where it helps, but the list is the complete one.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from k3load.generated_block import replace_block, write_or_check
from k3load.sim.config import FaultProfile, Strikes

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "sim.md"
BEGIN = "<!-- faults: generated from k3load/sim/config.py by `python -m k3load.sim.fault_docs --write`; do not edit -->"
END = "<!-- end of the generated faults -->"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fault_list() -> str:
    """A line per group, in `Strikes`' order: its heading, then its flags in declaration order."""
    fields = dataclasses.fields(FaultProfile)
    missing = [f.name for f in fields if not isinstance(f.metadata.get("strikes"), Strikes)]
    if missing:
        raise ValueError(f"faults without `strikes` (where they strike): {', '.join(missing)}")
    lines = []
    for group in Strikes:
        names = [f"`{flag(f.name)}`" for f in fields if f.metadata["strikes"] is group]
        if names:
            lines.append(f"- {group.value}: {', '.join(names)}")
    return "\n".join(lines) + "\n"


def docs_text(current: str) -> str:
    return replace_block(current, BEGIN, END, fault_list())


if __name__ == "__main__":
    sys.exit(write_or_check(sys.argv[1:], "k3load.sim.fault_docs", ROOT, [(DOCS, docs_text)]))
