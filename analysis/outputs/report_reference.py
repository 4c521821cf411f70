"""The report's "Agreement with the reference run" section (report.md, and report.html rendered from it).

Why a short section: the pillar's reasons already say pass or fail; an operator reading the record
needs the reference named (run id, manifest hash, so the claim can be checked against that signed run)
and where the two runs' tool-call choices differ, turn by turn. Empty when the run had no reference.
"""

from __future__ import annotations

from typing import Any

from k3load.analysis.outputs.markdown import fmt, table

TURN_COLUMNS = ("scenario", "turn", "reference_label", "reference_calls", "answers", "triggered", "tp", "fp", "fn",
                "recall")


def ci(rate: dict[str, Any] | None) -> str:
    """'93.0% [88.1%, 96.0%] of 120' from a Rate's to_dict(); '–' without attempts."""
    if not rate or not rate.get("n"):
        return "–"
    low, high = rate["ci95"]
    return f"{rate['rate']:.1%} [{low:.1%}, {high:.1%}] of {rate['n']}"


def drop_text(compared: dict[str, Any]) -> str:
    if compared.get("drop") is None:
        return "–"
    low, high = compared["drop_ci95"]
    return f"{compared['drop']:+.1%} [{low:+.1%}, {high:+.1%}]"


def turn_rows(by_turn: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**row, "reference_calls": f"{row['reference_triggered']}/{row['reference_answers']}",
             "recall": ci(row.get("recall")) if row.get("recall") else None} for row in by_turn]


def summary_rows(n: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measure: the run's value, the reference's, and the interval; shared with `k3load diff`."""
    trig = n["trigger"]
    f1 = "–" if trig["f1"] is None else f"{trig['f1']:.3f} [{trig['f1_ci95'][0]:.3f}, {trig['f1_ci95'][1]:.3f}]"
    schema, structured = n["schema_accuracy"], n["structured_output_validity"]
    return [{"measure": "tool-call trigger F1", "run": f1, "reference": "(label)", "drop": None},
            {"measure": "trigger recall", "run": ci(trig["recall"]), "reference": "(label)", "drop": None},
            {"measure": "trigger precision", "run": ci(trig["precision"]), "reference": "(label)", "drop": None},
            {"measure": "tool-name agreement", "run": ci(n["tool_name_agreement"]), "reference": "(label)",
             "drop": None},
            {"measure": "argument schema accuracy", "run": ci(schema["run"]), "reference": ci(schema["reference"]),
             "drop": drop_text(schema)},
            {"measure": "structured-output validity", "run": ci(structured["run"]),
             "reference": ci(structured["reference"]), "drop": drop_text(structured)}]


def finish_rows(mix: dict[str, Any]) -> list[dict[str, Any]]:
    reasons = sorted(set(mix["reference"]) | set(mix["run"]))
    return [{"finish_reason": r, "reference": ci(mix["reference"].get(r)), "run": ci(mix["run"].get(r))}
            for r in reasons]


def markdown(agent_numbers: dict[str, Any]) -> str:
    n = agent_numbers.get("reference")
    if not n:
        return ""
    head = (f"## Agreement with the reference run\n\nReference run `{fmt(n.get('run_id'))}` (manifest.sha256 sha256 "
            f"`{fmt(n.get('manifest_sha256'))}`). {n['comparable']} answers compared by scenario and turn, the "
            f"reference's majority behaviour as the label; {n['not_comparable']} not comparable. Intervals 95% "
            "(Wilson; F1 through the Jaccard index; drops Newcombe).\n\n")
    disagreeing = n.get("disagreeing_by_layer") or {}
    layers = ", ".join(f"{k} {v}" for k, v in disagreeing.items()) or "none"
    return (head + table(summary_rows(n), ("measure", "run", "reference", "drop"))
            + f"\nDisagreeing answers by their primary layer: {layers}.\n\n"
            + table(turn_rows(n["by_turn"]), TURN_COLUMNS) + "\n"
            + table(finish_rows(n["finish_reasons"]), ("finish_reason", "reference", "run")) + "\n")
