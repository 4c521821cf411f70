"""Print docs/real-server-results.md's table from the runs the real-server suites kept.

    .venv/bin/python scripts/real_server_results.py [runs/real-server]

Why a script: the page must match a fresh run, so its rows are written from the kept verdicts
(runs/real-server/SETUP/verdict.json and setup.json, written by tests/real/test_real_server_*.py and
tests/real/test_real_model.py), never retyped. Each row: the setup, its server flags, the verdict and
the pillars' statuses, then the reasons and the figures behind them (cache pairs, reuse and TTFT
ratio; the agent rate with its interval and failures by layer; context refusals; crashes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PILLARS = ("compat", "resources", "prefix_cache", "agent_api")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def figures(verdict: dict[str, Any]) -> list[str]:
    """The numbers a reader checks the reasons against."""
    out = []
    cache = verdict["pillars"]["prefix_cache"]["numbers"]
    if cache.get("pairs"):
        out.append(f"cache: {cache['pairs']} pairs")
    agent = verdict["pillars"]["agent_api"]["numbers"]
    if agent.get("attempts"):
        low, high = agent["valid_rate_ci95"]
        layers = ", ".join(f"{k} {v}" for k, v in agent["failed_by_layer"].items() if v) or "none"
        out.append(f"agent: {agent['valid']}/{agent['attempts']} valid ({low:.1%}-{high:.1%}), failures by layer: "
                   f"{layers}")
    crashes = verdict["pillars"]["resources"]["numbers"].get("crashes") or []
    if crashes:
        out.append(f"crashes: {len(crashes)}")
    return out


def row(folder: Path) -> str:
    verdict = json.loads((folder / "verdict.json").read_text())
    setup = json.loads((folder / "setup.json").read_text())
    flags = ", ".join(f"`{f}`" for f in setup["server_flags"]) or "recipe flags"
    statuses = " | ".join(verdict["pillars"][p]["status"] for p in PILLARS)
    reasons = [*verdict["next_action"]["because"]]
    for name in PILLARS:
        pillar = verdict["pillars"][name]
        if pillar["status"] == "pass" and pillar["reasons"] and name in ("prefix_cache", "agent_api"):
            reasons.append(f"{name}: {pillar['reasons'][0]}")
    said = "; ".join(f"`{_cell(r)}`" for r in reasons)
    return f"| {setup['setup']} | {flags} | **{verdict['verdict']}** | {statuses} | {said} | " \
           f"{_cell('; '.join(figures(verdict)))} |"


def main(argv: list[str]) -> int:
    base = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "runs" / "real-server"
    folders = sorted(p for p in base.iterdir() if (p / "verdict.json").exists() and (p / "setup.json").exists())
    if not folders:
        print(f"no kept runs under {base}: run "
              "`pytest -m vllm tests/real/test_real_server_healthy.py tests/real/test_real_server_shortage.py "
              "tests/real/test_real_model.py`", file=sys.stderr)
        return 2
    print("| setup | server flags (against the recipe) | verdict | compat | resources | prefix_cache | agent_api "
          "| the reasons the harness gave | figures |")
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in folders:
        print(row(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
