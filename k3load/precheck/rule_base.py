"""What every compat rule shares: the statuses and the result shape (rules.py, server_rules.py).

Why apart: the rules are split by what they look at, and both halves build results the same way.
"""

from __future__ import annotations

from typing import Any

from k3load.outcomes import NOT_APPLICABLE as NA
from k3load.precheck.evidence import Evidence
from k3load.precheck.recipe import Recipe


def result(rule_id: str, status: str, reason: str, evidence: list[str] | tuple[str, ...] = (),
           **details: Any) -> dict[str, Any]:
    return {"id": rule_id, "status": status, "reason": reason, "evidence": sorted(set(evidence)),
            "details": details}


def na_result(recipe: Recipe, rule_id: str, group: str) -> dict[str, Any] | None:
    why = recipe.not_applicable(group)
    return result(rule_id, NA, f"not_applicable: {why}") if why else None


def option(name: str) -> str:
    """An input's option as `k3load precheck` and a Locust run spell it ("--startup-log / --k3-startup-log"):
    the same rules judge both, and a reason must name the option the reader gave."""
    return f"--{name} / --k3-{name}"


def files_of(ev: Evidence, *kinds: str) -> list[str]:
    return [ev.files[k] for k in kinds if k in ev.files]


def host_files(ev: Evidence) -> list[str]:
    return [h["file"] for h in ev.hosts]


def no_hosts_why(ev: Evidence) -> str:
    nvml = next((n for n in ev.notes if n.startswith("no local NVML")), "local NVML not used (--no-nvml / "
                "--k3-nvml off)")
    return f"no {option('host-inventory')} and {nvml}"
