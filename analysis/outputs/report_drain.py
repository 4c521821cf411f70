"""The report's "Drain audit" and "Restart drill" sections (report.md; report.html renders the same).

Why their own module: report_md stays the record's outline; these two read only the resources
pillar's numbers (`drain` rows, `restart_drill`), so a run judged again renders the same bytes.
"""

from __future__ import annotations

from typing import Any

from k3load.analysis.outputs.markdown import fmt, table

DRAIN_COLUMNS = ("stage", "status", "waited_s", "bound_s", "running_when_clients_left", "running_after",
                 "waiting_after", "tokens_after_clients_left", "server_aborts", "clients_left_early",
                 "timeout_drills", "kv_usage_baseline", "kv_usage_after")
DRILL_FIELDS = ("status", "held_from", "users", "up_before", "down_after_s", "time_to_ready_s",
                "time_to_first_good_answer_s", "first_good_answer_after_ready_s", "held_attempts", "held_error_rate",
                "held_ttft_p95_ms", "held_e2e_p95_ms", "command_rc", "log")


def markdown(resources: dict[str, Any]) -> str:
    return _drain(resources.get("drain")) + _drill(resources.get("restart_drill"))


def _drain(rows: list[dict[str, Any]] | None) -> str:
    if not rows:
        return ""
    notes = "".join(f"- {r['stage']}: {r['why']}\n" for r in rows if r["status"] != "drained")
    return ("## Drain audit\n\nAfter each stage every client left; then the server's own gauges and counters "
            "(/metrics) were read until nothing ran or waited, at most `resources.max_drain_s`. Tokens after the "
            "clients left and requests still running are work for nobody; aborts are the server's own count "
            "(vllm:request_success_total{finished_reason=\"abort\"}).\n\n"
            + table(rows, DRAIN_COLUMNS) + ("\n" + notes if notes else "") + "\n")


def _drill(drill: dict[str, Any] | None) -> str:
    if not drill:
        return ""
    rows = [{"field": k, "value": drill.get(k)} for k in DRILL_FIELDS if k in drill]
    mix = ", ".join(f"{k} {v}" for k, v in sorted((drill.get("mix") or {}).items()))
    held = f" Held: {fmt(drill.get('users'))} users ({mix}).\n" if mix else "\n"
    return (f"## Restart drill\n\n{drill['why']}.{held}\n" + (table(rows, ("field", "value")) if len(rows) > 1
                                                            else "") + "\n")
