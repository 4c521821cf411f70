"""What the capacity plan stands on: a what-if from the same run, and the assumptions it makes, said.

Why apart from the arithmetic (analysis/capacity.py): these read the run's records and metrics; the
sizing reads only the judged steps, so it can be unit-tested and recomputed for other targets.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from k3load.analysis.pillar import percentile
from k3load.analysis.rundata import RunData
from k3load.events import Event

COLD_FAMILY = "cold"


def _hit_share(ok: pd.DataFrame) -> tuple[float | None, int]:
    known = ok[ok["prompt_tokens"].notna() & ok["cached_tokens"].notna()]
    prompt = float(known["prompt_tokens"].sum())
    return (float(known["cached_tokens"].sum()) / prompt if prompt > 0 else None), len(known)


def cold_cache(data: RunData, per_replica: dict[str, Any]) -> dict[str, Any]:
    """The capacity step's measured prefix-cache hit share, and what a cold cache would ask: every request
    prefilling the tokens the cache saved too (the factor). No capacity number is made of it: where prefill
    bounds the load a cold cache costs up to that factor, where decode bounds it little, and one run at one
    hit share cannot tell which; the cold family's TTFT beside the cached families' in this run shows how
    much prefill weighs here."""
    stage = per_replica.get("capacity_stage")
    out: dict[str, Any] = {"case": "cold prefix cache", "measured_hit_share": None, "prefill_tokens_factor": None,
                           "cold_ttft_p50_ms": None, "cached_ttft_p50_ms": None}
    records = data.records
    if stage is None or records.empty:
        out["inconclusive"] = "inconclusive, because no step held at the SLO"
        return out
    ok = records[(records["status"] == "ok") & ~records["drill"].astype(bool)]
    share, n = _hit_share(ok[ok["stage"] == stage])
    out["measured_hit_share"], out["requests"] = share, n
    if share is None:
        out["inconclusive"] = "inconclusive, because no answer in the capacity step said its prompt and cached tokens"
        return out
    factor = 1.0 / (1.0 - share) if share < 1 else None
    out["prefill_tokens_factor"] = factor
    cold = ok[ok["family"] == COLD_FAMILY]["ttft_ms"].dropna().tolist()
    cached = ok[ok["family"] != COLD_FAMILY]["ttft_ms"].dropna().tolist()
    out["cold_ttft_p50_ms"] = percentile(cold, 0.5) if cold else None
    out["cached_ttft_p50_ms"] = percentile(cached, 0.5) if cached else None
    if not cold:
        out["note"] = "no cold-family answer in this run: the cold TTFT is unknown (add `cold` to a stage's mix)"
    return out


def assumptions(data: RunData, sources: int, routing: dict[str, Any] | None, source_kind: str | None,
                searched_on: str | None = None) -> list[str]:
    """The plan's assumptions, each in words a planner can check against their deployment."""
    out = ["an even router: each replica gets the same share of the agents (one replica, the target URL, "
           "was measured)"]
    if routing:  # the cache pillar's cache.routing rule (two or more replicas scraped: analysis/replicas.py)
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
    elif source_kind in ("concurrency", "search"):
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
