"""docs/options.md is the options as the code defines them, not as someone remembered them.

Why: the page is generated (`k3load/options_page.py`); a flag renamed or a default changed without
regenerating it would send users to a flag that no longer exists. Regenerate with
`.venv/bin/python -m k3load.options_page > docs/options.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from k3load import options_page
from k3load.cli import build_parser
from k3load.sim import fault_docs
from k3load.sim.config import FaultProfile, knob

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "options.md"


def test_the_committed_options_page_is_what_the_parsers_render_now() -> None:
    rendered = options_page.render()
    committed = PAGE.read_text()
    drift = [line for line in rendered.splitlines() if line not in committed.splitlines()]
    gone = [line for line in committed.splitlines() if line not in rendered.splitlines()]
    assert rendered == committed, ("docs/options.md is stale; regenerate it with "
                                   f"`.venv/bin/python -m k3load.options_page > docs/options.md`.\nnew: {drift[:3]}\n"
                                   f"gone: {gone[:3]}")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o not in ("--help",)}


def test_every_flag_of_every_command_is_on_the_page() -> None:
    """The renderer itself leaves nothing out: each flag the parsers accept appears as a table row."""
    rows = "\n".join(line for line in PAGE.read_text().splitlines() if line.startswith("| `"))
    parsers = [options_page.locust_parser(), build_parser()]
    parsers += [sub for _, sub in options_page._subcommands(build_parser())]
    wanted = set().union(*(_flags(p) for p in parsers)) - {"--version"}
    missing = sorted(f for f in wanted if not re.search(re.escape(f"`{f}`"), rows))
    assert not missing, missing
    assert "--k3-plan" in wanted and "--reference" in wanted  # the parsers were really read


def test_the_sim_pages_fault_list_is_generated_from_the_fields() -> None:
    """docs/sim.md lists every fault by where it strikes, rendered from each field's `strikes`
    (k3load/sim/fault_docs.py): a new fault is one field, and this fails until the page is rendered again."""
    page = (ROOT / "docs" / "sim.md").read_text()
    assert fault_docs.docs_text(page) == page, "stale: run `python -m k3load.sim.fault_docs --write`"
    flags = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(FaultProfile)]
    assert len(flags) > 40 and all(f"`{flag}`" in page for flag in flags)


def test_a_fault_without_its_place_is_refused() -> None:
    """A field declared without `strikes` cannot be listed, so the list refuses to render rather than drop it."""

    @dataclasses.dataclass
    class Unplaced(FaultProfile):
        new_fault_rate: float = knob(0.0, "fault: a new one, not placed")

    with pytest.raises(ValueError, match="new_fault_rate"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fault_docs, "FaultProfile", Unplaced)
        fault_docs.fault_list()
