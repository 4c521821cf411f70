"""The drain audit: after each stage, did the server let go of everything its clients left behind?

Why: a request the server keeps decoding after its client left (our deadline, a cut stream, a
gateway that never passes the disconnect on) is GPU time spent for nobody and duplicate work hidden
behind the retry; KV that stays allocated after every request ended is a leak. Neither shows in the
client's latencies. Evidence, per stage (k3load.loadgen.drain writes the `stage_drain` event):

- running and waiting back to 0 within `resources.max_drain_s` after every client of the stage left
  (`drained`); a slow drain within the bound is fine, still busy at the bound is a server-layer failure;
- KV usage back to the stage's baseline: vllm:kv_cache_usage_perc at the last reading before the stage
  began (the previous drain's last reading, or the sampler's last scrape before it), within
  KV_TOLERANCE. vLLM's usage counts only blocks that running requests hold: a prefix-cached block
  whose request ended goes back to the free queue (vllm/v1/core/block_pool.py `free_blocks` appends
  it there, `get_usage` is 1 - free/total), so the cache staying warm does not raise it;
- the server's own count of aborted requests over the stage (vllm:request_success_total
  {finished_reason="abort"}) next to the attempts whose client left early (timeouts, cut streams);
- tokens the server generated after every client had left (vllm:generation_tokens_total over the
  window) and the requests still running or waiting at that moment: work for departed clients.

Where a reading is missing the row says "inconclusive, because ..." and judges nothing.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
from k3load.analysis.run.rundata import RunData, StageWindow
from k3load.analysis.run.timeline import MetricIndex
from k3load.events import Event
from k3load.sampler.vllm_metrics import VllmMetric
from k3load.workload.stage_kind import StageKind


class DrainStatus(StrEnum):
    """A drain row's `status` (the resources pillar fails on NOT_DRAINED and KV_HELD)."""

    DRAINED = "drained"
    NOT_DRAINED = "not_drained"
    KV_HELD = "kv_held"
    INCONCLUSIVE = "inconclusive"
    NOT_AUDITED = "not_audited"  # a ramp's or a search's step whose users went on into the next: audited after it


FAILED = (DrainStatus.NOT_DRAINED, DrainStatus.KV_HELD)
KV_TOLERANCE = 0.02  # absolute KV usage: the gauge is a step behind, and a step may hold a block or two
LEFT_EARLY = ("timeout", "truncated", "stream_error", "transport_error")  # the client end was cut
ABORTED = (VllmMetric.REQUEST_SUCCESS_TOTAL, {"finished_reason": "abort"})


def _last_before(index: MetricIndex, name: str, ts: float, match: dict[str, str] | None = None) -> float | None:
    points = index.points(name, float("-inf"), ts, match)
    return points[-1][1] if points else None


def _baseline_kv(index: MetricIndex, stage: StageWindow, previous: dict[str, Any] | None) -> float | None:
    """KV usage before the stage began: the later of the previous drain's last reading and the sampler's
    last scrape at or before the stage's start."""
    candidates = []
    last = (previous or {}).get("last") or {}
    if last.get("kv_usage") is not None and last.get("ts", 0) <= stage.start_ts:
        candidates.append((last["ts"], last["kv_usage"]))
    points = index.points(VllmMetric.KV_CACHE_USAGE, float("-inf"), stage.start_ts)
    if points:
        candidates.append(points[-1])
    return max(candidates)[1] if candidates else None


def _aborts(index: MetricIndex, stage: StageWindow, event: dict[str, Any] | None) -> float | None:
    """Aborts from the last scrape before the stage to the drain's last reading (or the stage's end)."""
    name, match = ABORTED
    last = (event or {}).get("last") or {}
    before = _last_before(index, name, stage.start_ts, match)
    if last.get("aborted") is not None and before is not None:
        return last["aborted"] - before if last["aborted"] >= before else None  # a restart in between: unknown
    return index.delta(name, stage.start_ts, stage.end_ts, match)


def _left_early(data: RunData, stage: StageWindow) -> dict[str, int]:
    rows = data.columns.rows(stage.name)
    return {"attempts": len(rows), "clients_left_early": int(rows.code_is("status", *LEFT_EARLY).sum()),
            "timeout_drills": int((rows.flag("drill") & rows.code_is("status", "timeout")).sum())}


def _row(data: RunData, index: MetricIndex, stage: StageWindow, event: dict[str, Any] | None,
         previous: dict[str, Any] | None, bound_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"stage": stage.name, **_left_early(data, stage), "bound_s": bound_s,
                           "server_aborts": _aborts(index, stage, event)}
    if event is None:
        status, why = _no_window(data, stage, bound_s)
        return row | {"status": status, "why": why}
    first, last = event.get("first") or {}, event.get("last") or {}
    tokens = (last["generation_tokens"] - first["generation_tokens"]
              if last.get("generation_tokens") is not None and first.get("generation_tokens") is not None else None)
    baseline = _baseline_kv(index, stage, previous)
    row |= {"drained": event.get("drained"), "waited_s": event.get("waited_s"),
            "running_when_clients_left": first.get("running"), "waiting_when_clients_left": first.get("waiting"),
            "running_after": last.get("running"), "waiting_after": last.get("waiting"),
            "tokens_after_clients_left": tokens, "kv_usage_baseline": baseline, "kv_usage_after": last.get("kv_usage")}
    if event.get("drained") is None:
        return row | {"status": DrainStatus.INCONCLUSIVE, "why": "inconclusive, because the drain window had no "
                      f"reading of the server's running gauge ({event.get('error') or 'metrics missing'})"}
    if not event["drained"]:
        return row | {"status": DrainStatus.NOT_DRAINED, "why": _not_drained(row)}
    kv_after = last.get("kv_usage")
    if baseline is not None and kv_after is not None and kv_after > baseline + KV_TOLERANCE:
        return row | {"status": DrainStatus.KV_HELD, "why": f"KV usage {kv_after:.1%} after every request ended, above "
                      f"the {baseline:.1%} before the stage (tolerance {KV_TOLERANCE:.0%}): blocks not given back"}
    note = "" if baseline is not None and kv_after is not None else " (KV usage not read: not compared)"
    return row | {"status": DrainStatus.DRAINED, "why": f"drained in {event.get('waited_s', 0):.1f} s{note}"}


def _steps_of(data: RunData) -> dict[str, str]:
    """Each ramp step's plan stage (the plan's `steps`: k3load.workload.plan.Stage.step_of), by stage name."""
    stages = data.plan.stages if data.plan is not None else ()
    return {s.name: s.step_of for s in stages if s.step_of is not None}


def _no_window(data: RunData, stage: StageWindow, bound_s: float) -> tuple[DrainStatus, str]:
    """A stage with no drain window after it: (not audited, why) for a step whose users went on, else
    (inconclusive, why)."""
    if bound_s <= 0:
        return DrainStatus.INCONCLUSIVE, "inconclusive, because the plan set resources.max_drain_s to 0: no drain " \
            "window was kept"
    later = [s for s in data.stages if s.start_ts > stage.start_ts]
    steps_of = _steps_of(data)
    if later and stage.kind == later[0].kind == StageKind.CONCURRENCY and steps_of.get(stage.name) is not None \
            and steps_of.get(stage.name) == steps_of.get(later[0].name):
        return DrainStatus.NOT_AUDITED, "not audited: a step of a ramp, whose users went on into the next step " \
            "(audited after its last step)"
    if later and stage.search is not None and later[0].search == stage.search:
        return DrainStatus.NOT_AUDITED, "not audited: a step of a search, whose users went on into the next step " \
            "(audited after its last step)"
    return DrainStatus.INCONCLUSIVE, "inconclusive, because no drain window was recorded after this stage (a run " \
        "stopped early, or one recorded before the drain audit existed)"


def _not_drained(row: dict[str, Any]) -> str:
    tokens = row["tokens_after_clients_left"]
    spent = f"; {tokens:.0f} tokens generated after every client had left" if tokens is not None else ""
    aborts = row["server_aborts"]
    told = (f"; the server aborted {aborts:.0f} request(s) while {row['clients_left_early']} attempt(s) left early"
            if aborts is not None else "")
    return (f"still {row['running_after'] or 0:.0f} running and {row['waiting_after'] or 0:.0f} waiting "
            f"{row['waited_s'] or 0:.1f} s after every client of the stage left (bound {row['bound_s']:g} s: "
            f"resources.max_drain_s){spent}{told}: the server keeps decoding for clients that are gone (does "
            "the disconnect reach the engine? a gateway that does not pass it on)")


def drain_audit(data: RunData, index: MetricIndex, limits: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """One row per stage, in order; `status` drained / not_drained / kv_held / inconclusive / not_audited."""
    bound = float((limits.get("resources") or DEFAULT_THRESHOLDS["resources"]).get("max_drain_s", 0.0))
    events = {e.get("stage"): e for e in data.events_named(Event.STAGE_DRAIN)}
    rows, previous = [], None
    for stage in data.stages:
        event = events.get(stage.name)
        rows.append(_row(data, index, stage, event, previous, bound))
        previous = event or previous
    return rows


def drain_reasons(rows: list[dict[str, Any]]) -> list[str]:
    """Resources-pillar failures (server layer): a stage that did not drain, or kept KV after it."""
    return [f"drain audit, stage {r['stage']} (server layer): {r['why']}" for r in rows
            if r["status"] in FAILED]
