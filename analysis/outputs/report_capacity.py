"""The report's "Capacity plan" section (capacity.json in words and tables), and `k3load capacity`'s lines.

Why right after the verdict: a capacity planner opens the report for this, and the lead signs the
verdict beside the load it holds at.
"""

from __future__ import annotations

from typing import Any

from k3load.analysis.outputs.markdown import fmt, table

TARGET_COLUMNS = ("target", "per_replica", "headroom", "replicas", "gpus_per_replica", "gpus", "cost_per_hour",
                  "basis")
PER_REPLICA_COLUMNS = ("max_users_at_slo", "max_sessions_per_s_at_slo", "requests_per_s_at_slo",
                       "output_tokens_per_s_at_slo", "sessions_per_s_at_slo", "max_input_tokens_held", "source")
STEP_COLUMNS = ("stage", "users", "held", "goodput", "goodput_ci95", "past_capacity", "problems")


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.1%}"


def headline(per: dict[str, Any]) -> str:
    """One sentence: the capacity with its bracket, or why there is none."""
    rate = per.get("searched_on") == "sessions_per_s"
    unit = "sessions/s" if rate else "users"
    users = per.get("max_sessions_per_s_at_slo" if rate else "max_users_at_slo")
    interval = per.get("max_sessions_per_s_at_slo_interval" if rate else "max_users_at_slo_interval") or [None, None]
    if per.get("inconclusive") and users is None:
        return per["inconclusive"]
    if not per.get("limit_reached"):
        return (f"no limit reached up to {per.get('largest_load_tried')} {unit}: each replica holds at least "
                f"**{users} {unit}** at the SLO (the largest load tried; capacity is above it)")
    goodput = per.get("goodput_at_max") or {}
    ci = goodput.get("ci95") or [None, None]
    limiting = per.get("limiting") or {}
    failed = limiting.get("sessions_per_s" if rate else "users")
    if rate:
        bracket = f"held at {interval[0]}, failed at {failed}: the capacity lies between them"
    elif interval[0] == interval[1]:
        bracket = f"{interval[0]} held and {failed} failed: no load between them is untried"
    else:
        bracket = (f"between {interval[0]} and {interval[1]}: the largest step held and one below the smallest "
                   f"that failed ({failed})")
    return (f"each replica holds **{users} {unit}** at the SLO ({bracket}), goodput {_pct(goodput.get('share'))} "
            f"(95% CI {_pct(ci[0])}-{_pct(ci[1])}); at {failed} {unit} {limiting.get('resource')} "
            f"ran out first ({limiting.get('rule')}: {limiting.get('reason')})")


def _targets(plan: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for t in plan.get("targets") or []:
        target = f"{t['users']:g} users" if "users" in t else f"{t['sessions_per_s']:g} sessions/s"
        rows.append({"target": target, **{k: t.get(k) for k in TARGET_COLUMNS if k != "target"}})
    return rows


def markdown(plan: dict[str, Any]) -> str:
    per = plan["per_replica"]
    other = per.get("users_search") or per.get("sessions_per_s_search")
    also = ""
    if other:  # the plan searched on users and on rate: the other search's capacity too
        key = "max_users_at_slo" if per.get("users_search") else "max_sessions_per_s_at_slo"
        unit = "users" if per.get("users_search") else "sessions/s"
        limiting = other.get("limiting") or {}
        also = (f"Its other search: **{fmt(per.get(key))} {unit}** (bracket {fmt(per.get(key + '_interval'))}"
                + (f"; {limiting.get('resource')} ran out first, {limiting.get('rule')}" if limiting else "")
                + ").\n\n")
    out = [f"## Capacity plan\n\n{headline(per)}.\n\n{also}",
           table([{k: per.get(k) for k in PER_REPLICA_COLUMNS}], PER_REPLICA_COLUMNS), "\n"]
    rows = _targets(plan)
    out.append(table(rows, TARGET_COLUMNS) + "\n" if rows else
               "No target given: `--k3-target-users N` (or a plan's `capacity:` block, or `k3load capacity RUN "
               "--target-users N`) sizes replicas, GPUs and cost for it.\n\n")
    cost = plan.get("cost")
    if cost:
        out.append(f"Cost at {fmt(cost['gpu_hour_cost'])} per GPU-hour, each replica planned at its capacity less "
                   f"the headroom: {fmt(cost['replica_cost_per_hour'])} per replica-hour, "
                   f"{fmt(cost['per_million_output_tokens'])} per million output tokens at the SLO, "
                   f"{fmt(cost['per_agent_session'])} per agent session.\n\n")
    for what in plan.get("what_if") or []:
        out.append(f"What if {what['case']}: {_what_if(what)}.\n\n")
    search = plan.get("search")
    if search:
        rate = search.get("largest_held_sessions_per_s") is not None or search.get("first_failed_sessions_per_s")
        held, failed = ((search.get("largest_held_sessions_per_s"), search.get("first_failed_sessions_per_s")) if rate
                        else (search.get("largest_held_users"), search.get("first_failed_users")))
        out.append(f"The live search ({search['stage']}: {search['steps']} steps, ended {search['ended']}) held "
                   f"{fmt(held)} {'sessions/s' if rate else 'users'} and failed at {fmt(failed)}"
                   + (f"; {search['differs']}" if search.get("differs") else "") + ".\n\n")
    out.append("Assumptions:\n\n" + "".join(f"- {a}\n" for a in plan.get("assumptions") or []) + "\n")
    if plan.get("steps"):
        out.append(table(plan["steps"], STEP_COLUMNS) + "\n")
    return "".join(out)


def _what_if(what: dict[str, Any]) -> str:
    hits = (f"the capacity step's requests found {_pct(what.get('measured_hit_share'))} of their prompt tokens cached "
            f"(cold, each would prefill {fmt(what.get('prefill_tokens_factor'))}x the tokens)")
    if what.get("inconclusive"):
        return f"{hits}; {what['inconclusive']}"
    if what.get("max_sessions_per_s_at_slo_cold") is not None:
        return (f"{hits}; about **{fmt(what['max_sessions_per_s_at_slo_cold'])} sessions/s** cold, where the batch "
                f"bounds it (the rate times the cached families' e2e p50, {fmt(what.get('cached_e2e_p50_ms'))} ms, "
                f"over the cold family's, {fmt(what.get('cold_e2e_p50_ms'))} ms, at the same load)")
    if what.get("below"):
        return f"{hits}; {what['below']}"
    if what.get("max_users_at_slo_cold") is not None:
        return (f"{hits}; the same **{fmt(what['max_users_at_slo_cold'])} users** hold cold: the cold family's "
                f"{fmt(what.get('cold_requests'))} requests at that load stayed within the SLO (TTFT p95 "
                f"{fmt(what.get('cold_ttft_p95_ms'))} ms against {fmt(what.get('cached_ttft_p95_ms'))} ms cached)")
    return hits


def summary_lines(plan: dict[str, Any]) -> list[str]:
    """`k3load capacity`'s printout: the headline, then one line per target."""
    lines = [f"k3load capacity: {headline(plan['per_replica']).replace('**', '')}"]
    for row in _targets(plan):
        lines.append(f"  {row['target']}: {fmt(row['replicas'])} replicas, {fmt(row['gpus'])} GPUs "
                     f"(headroom {row['headroom']:.0%})" + (f", {fmt(row['cost_per_hour'])} per hour"
                                                            if row.get("cost_per_hour") is not None else ""))
    return lines
