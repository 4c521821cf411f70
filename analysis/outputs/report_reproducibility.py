"""The report's section on tool calls that must repeat and the tool-call trigger rate per stage.

Why its own section: a request that answers differently at temperature 0 is the seed's rollback condition, and
where it differs (only under load, or already alone) says whether to look at the engine's batching
(`VLLM_BATCH_INVARIANT=1`) or at the model; the trigger rate per stage says whether load changed what the model
does. Both read the agent pillar's numbers (analysis/pillars/agent/reproducibility.py,
analysis/pillars/agent/trigger_by_stage.py).
"""

from __future__ import annotations

from typing import Any, overload

from k3load.analysis.outputs.markdown import fmt, table

STAGE_COLUMNS = ("stage", "users", "repeated requests", "agreeing", "share (95% CI)")
DIFFERENCE_COLUMNS = ("request", "scenario", "turn", "stages", "attempts", "what differed")
TRIGGER_COLUMNS = ("stage", "kind", "users", "tool-call turns", "called a tool (95% CI)", "drop",
                   "called an expected tool (95% CI)", "drop ")


@overload
def _share(value: float, bounds: list[float] | None) -> str: ...
@overload
def _share(value: None, bounds: list[float] | None) -> None: ...
def _share(value: float | None, bounds: list[float] | None) -> str | None:
    """A share with its 95% interval; None (a blank cell) when it was not measured."""
    if value is None:
        return None
    return f"{value:.1%}" + (f" ({bounds[0]:.1%}-{bounds[1]:.1%})" if bounds else "")


def _rate(rate: dict[str, Any] | None) -> str | None:
    if not rate or not rate.get("n"):
        return None
    return _share(rate["rate"], rate["ci95"]) + f", {rate.get('distinct_requests')} distinct"


def _drop(found: dict[str, Any] | None) -> str | None:
    if not found or found.get("drop") is None:
        return None
    low, high = found["ci95"]
    return f"{found['drop']:+.1%} ({low:+.1%} to {high:+.1%})"


def _repeats(n: dict[str, Any]) -> str:
    head = "### Tool calls that must repeat\n\n"
    if not n:
        return head + "Not judged (no attempt was recorded).\n\n"
    text = (head + "Requests sent more than once at temperature 0 (or with a seed), each answered in its own chain: "
            "the tools called and their arguments (canonical JSON, parallel calls in any order) and the structured "
            f"output compared. {n['reason']}\n\n")
    if not n.get("repeated_requests"):
        return text
    rows = [{"stage": stage, "users": row["users"], "repeated requests": row["repeated_requests"],
             "agreeing": row["agreeing"], "share (95% CI)": _share(row["share"], row["share_ci95"])}
            for stage, row in n["by_stage"].items()]
    text += table(rows, STAGE_COLUMNS) + "\n"
    if n.get("differences"):
        rows = [{"request": d["request_sha256"][:12], "scenario": d["scenario"], "turn": d["turn"],
                 "stages": " vs ".join(d["stages"]), "attempts": " vs ".join(a[:12] for a in d["attempt_ids"]),
                 "what differed": d["what"]} for d in n["differences"]]
        text += "First differences (the reference answer first):\n\n" + table(rows, DIFFERENCE_COLUMNS) + "\n"
    return text


def _trigger(n: dict[str, Any]) -> str:
    head = "### Tool-call trigger rate per stage\n\n"
    if not n or not n.get("stages"):
        return head + f"Not compared: {(n or {}).get('reason') or 'no tool-call turn was answered'}.\n\n"
    rows = [{"stage": stage, "kind": row["kind"], "users": row["users"], "tool-call turns": row["tool_call_turns"],
             "called a tool (95% CI)": _rate(row["called"]), "drop": _drop(row.get("called_drop")),
             "called an expected tool (95% CI)": _rate(row["called_expected"]),
             "drop ": _drop(row.get("called_expected_drop"))} for stage, row in n["stages"].items()]
    changed = ", ".join(n.get("changed_stages") or []) or "none"
    base = n.get("base_stage")
    return (head + f"Each stage's tool-call turns against {fmt(base)} (the first load stage): drops with Newcombe's "
            f"95% interval, over distinct requests. Stages where load changed what the model does: {changed}."
            + (f" {n['reason']}." if n.get("reason") else "") + "\n\n" + table(rows, TRIGGER_COLUMNS) + "\n")


def markdown(numbers: dict[str, Any]) -> str:
    """The section, from the agent pillar's numbers (each part says why it is empty)."""
    return ("## Reproducibility and trigger rate per stage\n\n" + _repeats(numbers.get("reproducibility") or {})
            + _trigger(numbers.get("trigger_rate_by_stage") or {}))
