"""What the capacity plan stands on: a what-if from the same run, and the assumptions it makes, said.

Why apart from the arithmetic (analysis/decision/capacity.py): these read the run's records and metrics; the
sizing reads only the judged steps, so it can be unit-tested and recomputed for other targets.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from k3load.analysis.pillars.pillar import percentile
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.rundata import RunData
from k3load.events import Event
from k3load.workload.stage_kind import STEP_KINDS

COLD_FAMILY = "cold"
MIN_COLD = 5  # cold-family requests at the capacity step needed to read their latency


def _hit_share(ok: Rows) -> tuple[float | None, int]:
    prompt_tokens, cached_tokens = ok.number("prompt_tokens"), ok.number("cached_tokens")
    known = ~np.isnan(prompt_tokens) & ~np.isnan(cached_tokens)
    prompt = float(prompt_tokens[known].sum())
    return (float(cached_tokens[known].sum()) / prompt if prompt > 0 else None), int(known.sum())


def _recorded(rows: Rows, column: str) -> list[Any]:
    """A latency column's known values as the records held them (integers where every record's was one)."""
    values = rows.number(column)
    return rows.as_recorded(column, values[~np.isnan(values)])


def cold_cache(data: RunData, per_replica: dict[str, Any], slo: dict[str, float] | None = None) -> dict[str, Any]:
    """The capacity with the measured prefix-cache hit share against a cold cache, from the cold family's requests
    at the capacity step's own load (the same users or rate, beside the cached families'):

    - on users: the load holds cold where the cold family's TTFT and e2e p95 there stayed within the SLO (the
      users a replica holds are its batch's, each holding one slot: a cold cache changes their latency);
    - on rate: the rate times the cached families' e2e p50 over the cold family's, where the batch bounds it
      (requests in flight are the rate times their service time);
    - without cold requests at that load: inconclusive, naming why. The hit share and the prefill it saved
      (the factor) are said beside it."""
    stage = per_replica.get("capacity_stage")
    out: dict[str, Any] = {"case": "cold prefix cache", "measured_hit_share": None, "prefill_tokens_factor": None,
                           "cold_requests": 0, "cold_ttft_p95_ms": None, "cached_ttft_p95_ms": None,
                           "cold_e2e_p50_ms": None, "cached_e2e_p50_ms": None, "max_users_at_slo_cold": None,
                           "max_sessions_per_s_at_slo_cold": None}
    if stage is None or not len(data.columns):
        out["inconclusive"] = "inconclusive, because no step held at the SLO"
        return out
    mine = data.columns.rows(str(stage))
    ok = mine[mine.code_is("status", "ok") & ~mine.flag("drill")]
    share, n = _hit_share(ok)
    out["measured_hit_share"], out["requests"] = share, n
    out["prefill_tokens_factor"] = 1.0 / (1.0 - share) if share is not None and share < 1 else None
    is_cold = ok.code_is("family", COLD_FAMILY)
    cold, cached = ok[is_cold], ok[~is_cold]
    out["cold_requests"] = len(cold)
    for name, rows in (("cold", cold), ("cached", cached)):
        out[f"{name}_ttft_p95_ms"] = percentile(_recorded(rows, "ttft_ms"), 0.95) if len(rows) else None
        out[f"{name}_e2e_p50_ms"] = percentile(_recorded(rows, "e2e_ms"), 0.5) if len(rows) else None
    if len(cold) < MIN_COLD:
        out["inconclusive"] = (f"inconclusive, because {len(cold)} cold-family requests ran at the capacity step "
                               f"({stage}; {MIN_COLD} needed): add `cold` to its mix")
        return out
    if per_replica.get("searched_on") == "sessions_per_s":
        rate, warm_e2e, cold_e2e = (per_replica.get("max_sessions_per_s_at_slo"), out["cached_e2e_p50_ms"],
                                    out["cold_e2e_p50_ms"])
        if rate and warm_e2e and cold_e2e:
            out["max_sessions_per_s_at_slo_cold"] = rate * warm_e2e / cold_e2e
        return out
    limits = slo or {}
    cold_e2e95 = percentile(_recorded(cold, "e2e_ms"), 0.95)
    over = [f"{what} p95 {value:.0f} ms > {limits[key]:.0f} ms" for what, key, value in
            (("TTFT", "ttft_p95_ms", out["cold_ttft_p95_ms"]), ("e2e", "e2e_p95_ms", cold_e2e95))
            if value is not None and key in limits and value > limits[key]]
    if over:
        out["below"] = (f"below {per_replica.get('max_users_at_slo')} users: there, the cold family's requests broke "
                        + ", ".join(over))
    else:
        out["max_users_at_slo_cold"] = per_replica.get("max_users_at_slo")
    return out


def assumptions(data: RunData, sources: int, routing: dict[str, Any] | None, source_kind: str | None,
                searched_on: str | None = None) -> list[str]:
    """The plan's assumptions, each in words a planner can check against their deployment."""
    out = ["an even router: each replica gets the same share of the agents (one replica, the target URL, "
           "was measured)"]
    if routing:  # the cache pillar's cache.routing rule (two or more replicas scraped:
    # analysis/pillars/cache/replicas.py)
        out.append(f"prefix affinity as tested ({routing.get('status')}): {routing.get('reason')}")
    else:
        out.append("prefix affinity not exercised: one replica served every turn, so every cache hit measured here "
                   "assumes a router that keeps a conversation on one replica (--k3-session-header)")
    if sources > 1:
        out.append(f"{sources} metrics sources behind the target: the capacity is of all of them together; with "
                   "data-parallel ranks or several nodes behind one URL, one rank's share is this divided by the "
                   "ranks, and GPUs per replica counts all of theirs")
    else:
        out.append("data parallel and multi-node: the capacity is of everything behind the target URL; a "
                   "replica with more ranks or nodes than the one measured needs its own run")
    if searched_on == "sessions_per_s":
        out.append("agent sessions arriving open-loop at each step's rate, each with its agents' gaps between turns "
                   "(the scenarios' tool run times and user think times), a session ending with the step it "
                   "arrived in: a fleet whose agents' gaps differ offers a different load per session")
    elif source_kind in STEP_KINDS:
        out.append("closed-loop users with no think time: each keeps one request in flight, back to back; agents "
                   "that think or run tools between turns hold fewer in flight each, so more of them fit per "
                   "replica, and sessions/s here are the sessions as the scenarios play them")
    if data.compat and (data.compat.get("target") or {}).get("is_sim"):
        out.append("the target is the k3load sim: a rehearsal of the method, never a capacity to plan with")
    return out


def telemetry_gpus(data: RunData) -> int | None:
    """The GPUs the run's telemetry saw (distinct node and index), when no inventory says it."""
    gpu = data.gpu
    if gpu.empty or "gpu" not in gpu:
        return None
    nodes = gpu["node"].fillna("") if "node" in gpu else pd.Series("", index=gpu.index)
    return int(pd.DataFrame({"node": nodes, "gpu": gpu["gpu"]}).drop_duplicates().shape[0]) or None


def search_said(data: RunData, per_replica: dict[str, Any]) -> dict[str, Any] | None:
    """What the live search decided (its last `search_end`), beside the judgment's own reading of the same steps:
    the two hold each step to the same rules (goodput, the full-batch queue, KV, preemptions, sustained waiting),
    but the judgment also to the latency p95s, the error rate and GPU memory, so where they differ it is said."""
    ends = data.events_named(Event.SEARCH_END)
    if not ends:
        return None
    end = ends[-1]
    said = {"stage": end.get("stage"), "largest_held_users": end.get("largest_held_users"),
            "first_failed_users": end.get("first_failed_users"),
            "largest_held_sessions_per_s": end.get("largest_held_sessions_per_s"),
            "first_failed_sessions_per_s": end.get("first_failed_sessions_per_s"), "ended": end.get("ended"),
            "steps": end.get("steps")}
    rate = per_replica.get("searched_on") == "sessions_per_s"
    live = said["largest_held_sessions_per_s"] if rate else said["largest_held_users"]
    judged = per_replica.get("max_sessions_per_s_at_slo" if rate else "max_users_at_slo")
    if live != judged:
        unit = "sessions/s" if rate else "users"
        said["differs"] = (f"the live search held {live} {unit}, the judgment of its steps {judged}: the judgment "
                           "holds each step to every rule of the stage table (the latency p95s, the error rate and "
                           "GPU memory too) over the requests that ended by the step's decision; it stands")
    return said
