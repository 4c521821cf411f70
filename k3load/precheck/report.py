"""compat.json (the record the verdict reads) and the one-line-per-rule human summary.

Why a separate custom_build section: a custom build (another CUDA, a non-official image) must be
recorded with what it takes to reproduce and roll it back, and never read as an official-image
result; the section holds that record next to — not inside — the rule results.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from k3load.precheck.evidence import Evidence, evidence_hashes
from k3load.precheck.node_evidence import containers
from k3load.precheck.recipe import Recipe
from k3load.precheck.rules import NA, custom_build_problems, overall
from k3load.rundir import write_json_atomic

FORMAT = "k3load-compat/1"
COMPAT = "compat.json"


def custom_build_section(ev: Evidence) -> dict[str, Any] | None:
    """The declared custom build with what the container showed of it; None when none was declared."""
    cb = ev.custom_build
    if cb is None:
        return None
    record = cb["record"] if isinstance(cb["record"], dict) else None
    problems = [cb["error"]] if cb["error"] else custom_build_problems(cb["record"])
    container = next((c.facts for c in containers(ev)), {})  # the unnamed node's, else the first node's
    return {"file": cb["file"], "complete": not problems, "problems": problems, "record": record,
            "image": ev.image, "observed": {"cuda_build": container.get("cuda_build"),
                                            "torch_version": container.get("torch_version"),
                                            "vllm_version": container.get("vllm_version"),
                                            "vllm_git_sha": container.get("vllm_git_sha")},
            "official": False}


def build_compat(recipe: Recipe, ev: Evidence, rules: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    """The whole record: status, recipe identity, target, rule results, custom build, evidence hashes."""
    server = ev.server or {}
    not_applicable = sorted({r["reason"] for r in rules if r["status"] == NA and "recipe" in r["reason"]})
    return {
        "format": FORMAT,
        "status": overall(rules),
        "recipe": recipe.summary(),
        "target": {"base_url": server.get("base_url"), "is_sim": bool(server.get("sim_marker")) if server else None,
                   "sim_marker": server.get("sim_marker")},
        "rules": rules,
        "custom_build": custom_build_section(ev),
        "not_applicable": not_applicable,
        "notes": ev.notes,
        "evidence": evidence_hashes(out_dir),
        "generated_ts": time.time(),
    }


def write_compat(out_dir: Path, compat: dict[str, Any]) -> Path:
    path = Path(out_dir) / COMPAT
    write_json_atomic(path, compat)
    return path


def summary_lines(compat: dict[str, Any], path: Path | None = None) -> list[str]:
    """What the CLI prints: a header, one line per rule, the not-applicable note, where the record is."""
    r = compat["recipe"]
    target = compat["target"]["base_url"] or "no server"
    if compat["target"]["is_sim"]:
        target += " [k3load sim: never evidence]"
    support = f", K3 support {r['support']}: re-read the sources" if r["support"] == "pre-release" else ""
    lines = [f"compat precheck: {compat['status'].upper()} — recipe {r['name']} {r['version']} "
             f"(as of {r['as_of']}{support}); target {target}"]
    width = max(len(rule["id"]) for rule in compat["rules"])
    lines += [f"  {rule['status']:<14} {rule['id']:<{width}}  {rule['reason']}" for rule in compat["rules"]]
    lines += [f"  {note}" for note in compat["not_applicable"]]
    if compat["custom_build"] is not None:
        lines.append("  custom build recorded separately (compat.json custom_build); never an official-image result")
    if path is not None:
        lines.append(f"record: {path}")
    return lines
