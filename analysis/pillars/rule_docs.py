"""The plan schema's `thresholds` and stage kinds, the stage rules' table in docs/verdict-rules.md and the stage
kinds' list in docs/scenarios-and-plans.md, written from their declarations.

Why generated: both used to be written by hand beside the code that judges, and drifted (a default changed in
one place). They are rendered from analysis/pillars/thresholds_table.py, limit_rules.py and
k3load/workload/stage_kind.py, and `tests/unit/test_limit_rules.py` fails when the committed files differ from what
renders now:

    .venv/bin/python -m k3load.analysis.pillars.rule_docs --write    # rewrite the files in place
    .venv/bin/python -m k3load.analysis.pillars.rule_docs --check    # exit 1 when one is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from k3load.analysis.pillars.headroom.stages import QUEUED_S
from k3load.analysis.pillars.limit_rules import RULES, LimitRule, StageRule
from k3load.analysis.pillars.threshold import Threshold
from k3load.analysis.pillars.thresholds_table import THRESHOLDS, schema_part
from k3load.generated_block import replace_block, write_or_check
from k3load.outcomes import Signal
from k3load.workload.stage_kind import PLAN_KINDS

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "k3load" / "schemas" / "plan.schema.json"
DOCS = ROOT / "docs" / "verdict-rules.md"
PLANS_DOCS = ROOT / "docs" / "scenarios-and-plans.md"
BEGIN = "<!-- stage rules: generated from analysis/pillars/limit_rules.py by `python -m k3load.analysis.pillars." \
        "rule_docs --write`; do not edit by hand -->"
END = "<!-- end of the generated stage rules -->"
KINDS_BEGIN = "<!-- stage kinds: generated from k3load/workload/stage_kind.py by `python -m k3load.analysis.pillars." \
              "rule_docs --write`; do not edit by hand -->"
KINDS_END = "<!-- end of the generated stage kinds -->"
KIND_INTRO = "What the stage proves; the analysis reads stages by kind."


def schema_text(current: str) -> str:
    """The plan schema as committed, its `thresholds` property rendered from the table and its stage kinds from
    k3load.workload.stage_kind (json.dumps, indent 2)."""
    schema = json.loads(current)
    schema["properties"]["thresholds"] = schema_part()
    kind = schema["$defs"]["stage"]["properties"]["kind"]
    kind["enum"] = [str(k) for k in PLAN_KINDS]
    kind["description"] = " ".join([KIND_INTRO, *(f"{k}: {k.proves}." for k in PLAN_KINDS)])
    return json.dumps(schema, indent=2) + "\n"


def _amount(threshold: Threshold) -> str:
    value = threshold.default
    if value is None:
        return "no default"
    if threshold.unit == "%":
        return f"{value:g}%"
    return f"{value:g}" + (f" {threshold.unit}" if threshold.unit not in ("", "share", "count") else "")


def _limit(rule: LimitRule | StageRule) -> str:
    by_path = {t.path: t for t in THRESHOLDS}
    threshold = rule.threshold if isinstance(rule, LimitRule) else by_path.get(rule.threshold or "")
    return f"`{threshold.path}` ({_amount(threshold)})" if threshold else ""


def _signal(signal: Signal) -> str:
    if signal == Signal.LATENCY:
        return f"`latency`, or `queue_latency` when requests waited ≥ {QUEUED_S:g} s in the same stage"
    return f"`{signal}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rules_table() -> str:
    """The markdown table of every stage rule, in the order a stage is checked."""
    lines = ["| id | signal | evidence | breaches when | limit (default) | ran out |", "|---|---|---|---|---|---|"]
    lines += [f"| `{r.id}` | {_signal(r.signal)} | {_cell(r.evidence)} | {_cell(r.breaks)} | {_limit(r)} | "
              f"{r.ran_out} |" for r in RULES]
    return "\n".join(lines) + "\n"


def docs_text(current: str) -> str:
    """docs/verdict-rules.md with the block between the markers rendered afresh (the markers must be there)."""
    return replace_block(current, BEGIN, END, rules_table())


def kinds_list() -> str:
    """A line per kind a plan may name: what its stages prove, and what a crash in one points to."""
    return "".join(f"- `{k}`: {k.proves}. A crash in it: {k.crash_phase}.\n" for k in PLAN_KINDS)


def plans_docs_text(current: str) -> str:
    """docs/scenarios-and-plans.md with the stage kinds' list rendered afresh."""
    return replace_block(current, KINDS_BEGIN, KINDS_END, kinds_list())


def main(argv: list[str]) -> int:
    return write_or_check(argv, "k3load.analysis.pillars.rule_docs", ROOT,
                          [(SCHEMA, schema_text), (DOCS, docs_text), (PLANS_DOCS, plans_docs_text)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
