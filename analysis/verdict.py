"""The four-way verdict from the four pillars, by the spec's rules, in the spec's order.

    rebuild   compatibility failed (CUDA / driver / image / dependency mismatch) — decided first
    scale_up  compatible, but OOM, crashes, queueing or KV pressure persist under load
    limited   major functions work, but explicit limits are needed (concurrency, input length,
              cache use) or a pillar is not proven; the limits that hold are named
    go        all four pillars pass

Pure functions of the pillar results: the same run directory gives the same verdict, byte for byte.
"""

from __future__ import annotations

from typing import Any

from k3load.analysis.pillar import FAIL, NOT_RUN, PASS, PillarResult

NEXT_ACTION = {
    "go": "Fix the exposure scope and monitoring: deploy alerts.yaml and watch GPU memory, KV usage, waiting "
          "requests, preemptions, prefix-cache hits, TTFT and tool-call schema failures.",
    "limited": "Go live only within the limits below (concurrency, input length, users), and re-run the "
               "acceptance after the open items are fixed.",
    "rebuild": "Return to the official build (K3 image, CUDA 13, driver R580+, pinned vLLM) and re-run the "
               "acceptance from the precheck.",
    "scale_up": "Redesign topology, parallelism or GPU capacity (more or larger GPUs, fewer concurrent "
                "sequences, a smaller max_model_len), then re-run the load stages.",
}
EXIT_CODES = {"go": 0, "limited": 3, "rebuild": 4, "scale_up": 5}


def compat_pillar(compat: dict[str, Any] | None) -> PillarResult:
    if compat is None:
        return PillarResult(NOT_RUN, ["no compat.json: the precheck did not run"])
    rules = compat.get("rules", [])
    failed = [r for r in rules if r.get("status") == "fail"]
    undecided = [r for r in rules if r.get("status") == "inconclusive"]
    skipped = [r["id"] for r in rules if r.get("status") == "not_applicable"]
    recipe = (compat.get("recipe") or {}).get("name", "?")
    numbers = {"recipe": recipe, "rules": len(rules), "failed": [r["id"] for r in failed],
               "inconclusive": [r["id"] for r in undecided], "not_applicable": skipped}
    reasons = [f"{r['id']}: {r.get('reason', '')}" for r in failed or undecided]
    status = compat.get("status", "inconclusive")
    if status == PASS:
        reasons = [f"recipe {recipe}: {len(rules) - len(skipped)} rules pass"
                   + (f", {len(skipped)} not applicable ({', '.join(skipped)})" if skipped else "")]
    return PillarResult(status if status in (PASS, FAIL) else "inconclusive", reasons, numbers)


def _limits(stage_table: list[dict[str, Any]], ramp: dict[str, Any]) -> dict[str, Any]:
    good = [s for s in stage_table if not s["problems"]]
    long_ok = [s["max_prompt_tokens_ok"] for s in good if s["kind"] == "long_input" and s["max_prompt_tokens_ok"]]
    any_ok = [s["max_prompt_tokens_ok"] for s in good if s["max_prompt_tokens_ok"]]
    kv = [s["kv_usage_max"] for s in good if s["kv_usage_max"] is not None]
    users = [s["users"] for s in good if s["users"]]
    return {"max_concurrency": ramp.get("knee_users") if ramp.get("steps") else (max(users) if users else None),
            "max_input_tokens": max(long_ok or any_ok) if (long_ok or any_ok) else None,
            "kv_cache_usage_ceiling": max(kv) if kv else None,
            "ran_out_first": ramp.get("ran_out_first")}


def _scale_up_reasons(resources: PillarResult, stage_table: list[dict[str, Any]], ramp: dict[str, Any]) -> list[str]:
    reasons = []
    for crash in resources.numbers.get("crashes", []):
        if crash["oom"] or not crash["restart"].get("recovered"):
            reasons.append(f"{'OOM' if crash['oom'] else 'crash'} {crash['phase']} (stage {crash['stage']})")
    base = [s for s in stage_table if s["kind"] in ("load", "prefix_control")]
    if base and all(s["problems"] for s in base if s["kind"] == "load") and any(s["kind"] == "load" for s in base):
        reasons.append("even the base load stage exceeded its limits")
    if ramp.get("steps") and ramp.get("knee_users") is None:
        reasons.append(f"no concurrency step stayed within limits ({ramp.get('ran_out_first')} ran out first)")
    return reasons


def decide(pillars: dict[str, PillarResult], stage_table: list[dict[str, Any]], ramp: dict[str, Any]
           ) -> tuple[str, list[str], dict[str, Any]]:
    """(verdict, why, limits)."""
    limits = _limits(stage_table, ramp)
    if pillars["compat"].status == FAIL:
        return "rebuild", ["compatibility failed: " + "; ".join(pillars["compat"].reasons)], limits
    resources = pillars["resources"]
    if resources.status == FAIL:
        hard = _scale_up_reasons(resources, stage_table, ramp)
        if hard:
            return "scale_up", hard, limits
    open_items = [f"{name}: {p.status}" + (f" ({p.reasons[0]})" if p.reasons else "")
                  for name, p in pillars.items() if p.status != PASS]
    if open_items:
        if limits["max_concurrency"] is not None and resources.status == FAIL:
            above = (f"{limits['ran_out_first']} ran out above it" if limits["ran_out_first"]
                     else "the largest step run; every step held")  # the failure was elsewhere
            open_items.insert(0, f"hold concurrency at {limits['max_concurrency']} users ({above})")
        return "limited", open_items, limits
    return "go", ["all four pillars pass"], limits
