"""A run file that is there but unreadable (cut, not JSON, not an object: a run copied in part, a file edited by hand)
is said and judged around, never a traceback: the rule that needed it says why it could not tell."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k3load.analysis.analyze import judge
from k3load.outcomes import INCONCLUSIVE

STORED = Path(__file__).resolve().parents[1] / "data" / "scale-run"
BROKEN = {"cut": (b'{"version": 1, "run_id": "x", "vari', "not readable as JSON (JSONDecodeError: "),
          "list": (b"[1, 2]\n", "a JSON list, not an object"),
          "not-utf8": (b'{"a": "\xff"}', "not readable as JSON (UnicodeDecodeError: ")}


def _copy(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(STORED, run)
    return run


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_an_unreadable_design_leaves_reuse_inconclusive_saying_why(tmp_path: Path, kind: str) -> None:
    run = _copy(tmp_path)
    content, why = BROKEN[kind]
    (run / "reuse_design.json").write_bytes(content)
    judgment = judge(run)
    reuse = judgment.pillars["prefix_cache"].numbers["reuse"]
    assert reuse["status"] == INCONCLUSIVE
    assert reuse["reason"].startswith(f"inconclusive, because reuse_design.json is {why}")
    assert any(p.startswith(f"reuse_design.json: {why}") for p in judgment.data.problems)


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_an_unreadable_compat_file_is_inconclusive_not_a_precheck_never_run(tmp_path: Path, kind: str) -> None:
    run = _copy(tmp_path)
    content, why = BROKEN[kind]
    (run / "compat.json").write_bytes(content)
    compat = judge(run).pillars["compat"]
    assert compat.status == INCONCLUSIVE and compat.reasons[0].startswith(f"inconclusive, because compat.json is {why}")


def test_an_unreadable_run_file_is_a_problem_and_the_rest_is_judged(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    (run / "run.json").write_text(json.dumps(["not", "an", "object"]))
    judgment = judge(run)
    assert judgment.data.run == {} and "run.json: a JSON list, not an object" in judgment.data.problems
    intact = judge(_copy(tmp_path / "intact"))
    assert len(judgment.data.columns) == len(intact.data.columns) > 0  # every record still read and judged
    assert judgment.pillars["agent_api"].status == intact.pillars["agent_api"].status


def test_another_runs_design_is_said_with_both_ids(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    design = json.loads((run / "reuse_design.json").read_text())
    (run / "reuse_design.json").write_text(json.dumps(design | {"run_id": "r-other"}))
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    reuse = judge(run).pillars["prefix_cache"].numbers["reuse"]
    assert reuse["reason"] == f"inconclusive, because reuse_design.json was measured for run r-other, not this run " \
                              f"({run_id})"
