"""Pillar 2, headroom under load: stage by stage limits, and every crash turned into a cause by phase.

Why by phase: "it ran out of memory" is not a conclusion. Right after model load points at weights
and GPU topology, after a long input at context length / KV cache, after a concurrency step at
scheduler and cache pressure, after long running at fragmentation or poor reuse. Each crash is
reported with the GPU-memory curve and the requests in flight around it, and whether the server came
back and served again (the restart check).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from k3load.analysis.pillars.cache.pillar_cache import cache_config
from k3load.analysis.pillars.headroom.buffering import stream_delivery
from k3load.analysis.pillars.headroom.drain_audit import drain_audit, drain_reasons
from k3load.analysis.pillars.headroom.full_batch import engine_cap
from k3load.analysis.pillars.headroom.goodput import Slo
from k3load.analysis.pillars.headroom.gpu_growth import (
    GpuGrowth,
    gpu_growth,
    memory_before,
    reservation_text,
    soak_creep,
)
from k3load.analysis.pillars.headroom.proxy_rejudge import proxy_judged
from k3load.analysis.pillars.headroom.recovery import ended, hold_at, holds, same_conditions
from k3load.analysis.pillars.headroom.restart_audit import drill_reason, planned_down, planned_windows, restart_drill
from k3load.analysis.pillars.headroom.soak_trend import soak_trends
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.headroom.stages import stage_breaches, stage_stats
from k3load.analysis.pillars.pillar import PillarResult
from k3load.analysis.pillars.rules import Breach
from k3load.analysis.run.down_spells import CUT_STATUSES, DETECTION_S, DownSpell, down_spells
from k3load.analysis.run.gpu_memory import memory_curve
from k3load.analysis.run.input_size import Ratios, input_tokens, live_frame, tokens_per_byte
from k3load.analysis.run.rundata import RunData
from k3load.analysis.run.timeline import MetricIndex
from k3load.events import Event
from k3load.outcomes import FAIL, INCONCLUSIVE, NOT_RUN, PASS, Signal
from k3load.workload.stage_kind import BEFORE_STAGES_PHASE, StageKind

# The phase a crash points to, by the kind of stage it came in (k3load.workload.stage_kind declares each)
PHASES: dict[str | None, str] = {None: BEFORE_STAGES_PHASE, **{kind: kind.crash_phase for kind in StageKind}}
CRASH_EVENTS = (Event.SERVER_DOWN, Event.LOG_OOM, Event.LOG_ENGINE_DEAD)
SATURATED_CPU_PCT = 95.0


LATENCY_SIGNALS = (Signal.LATENCY, Signal.QUEUE_LATENCY)


def _only_latency(problems: tuple[Breach, ...]) -> bool:
    return all(p.signal in LATENCY_SIGNALS for p in problems)


def saturated_processes(row: StageRow) -> dict[str, float]:
    """The load-generator processes (master or local, each worker) at or over SATURATED_CPU_PCT in the stage."""
    return {name: float(pct) for name, pct in row.load_generator_cpu_max_pct_by_process.items()
            if pct is not None and pct >= SATURATED_CPU_PCT}


def _hot(stage: str, hot: dict[str, float]) -> str:
    return f"{stage} (" + ", ".join(f"{name} {pct:.0f}%" for name, pct in sorted(hot.items())) + ")"


def _saturation(table: list[StageRow], reasons: list[str]) -> tuple[list[str], list[str]]:
    """Stages judged with a saturated load generator: (stages whose only problems are latencies: the pillar is
    inconclusive for them; stages within limits: said with the pass). A stage failing for more than latency
    is failed, its reason in `reasons` saying which process was saturated."""
    only_latency, within = [], []
    for row in table:
        hot = saturated_processes(row)
        if not row.problems:
            within += [_hot(row.stage, hot)] if hot else []
            continue
        if hot and _only_latency(row.problems):
            only_latency.append(_hot(row.stage, hot))  # our own client was the bottleneck there
            continue
        reason = f"stage {row.stage} ({row.users} users): " + "; ".join(p.reason for p in row.problems)
        if hot and any(p.signal in LATENCY_SIGNALS for p in row.problems):
            reason += (f" (the load generator was saturated there: {_hot(row.stage, hot)}: its latencies are "
                       "not the server's alone)")
        reasons.append(reason)
    return only_latency, within


def _crash_times(data: RunData, spells: list[DownSpell]) -> list[dict[str, Any]]:
    """One crash per burst of crash events (a down + its OOM line within 30 s are one crash); a
    health-check flap (requests answered while /health said down) is not a crash."""
    crashes: list[dict[str, Any]] = []
    flaps = {spell.down_ts for spell in spells if spell.flap}
    planned = planned_windows(data)  # the restart drill's own down spell is no crash
    ups = sorted(e["ts"] for e in data.events_named(Event.SERVER_UP))
    for event in data.events_named(*CRASH_EVENTS):
        if (event["event"] == Event.SERVER_DOWN and event["ts"] in flaps) or planned_down(event["ts"], planned):
            continue
        # each death its own crash: a server seen back (server_up) since the last one's first event died again
        back = crashes and any(crashes[-1]["ts"] < up <= event["ts"] for up in ups)
        if crashes and event["ts"] - crashes[-1]["last_ts"] < 30 and not back:
            crashes[-1]["events"].append(event)
            crashes[-1]["last_ts"] = event["ts"]
        else:
            crashes.append({"ts": event["ts"], "last_ts": event["ts"], "events": [event]})
    return crashes


def _memory_curve(data: RunData, ts: float, span_s: float = 60.0) -> list[dict[str, Any]]:
    """Every GPU's memory summed per sampling round in the minute either side of the crash
    (`gpu_memory.memory_curve`: each GPU once, whichever sources read it)."""
    curve = memory_curve(data.gpu, ts - span_s, ts + span_s)
    return [{"t_rel_s": round(t - ts, 1), "memory_used_mib": float(v)}
            for t, v in zip(curve["ts"], curve["memory_used_mib"], strict=True)]


def _in_flight(data: RunData, ts: float, ratios: Callable[[], Ratios]) -> dict[str, Any]:
    """The requests the crash caught: sent before it and either still running at it, or cut by it.

    The crash's `ts` is when the sampler saw the server gone, up to a poll after the process died,
    so a request cut by the crash may have ended just before it; one that finished well, or was
    refused a connection (it never reached the server), is not in flight however close it ended.
    Input sizes the server never reported are estimated (input_size)."""
    rows = data.columns.rows()
    cut = rows.code_is("status", *CUT_STATUSES) | (rows.code_is("status", "http_error")
                                                   & (rows.number("http_status") >= 500))
    cut &= ~rows.flag("error")  # the error says the connection was refused: nobody was listening, it never arrived
    sent, ended = rows.number("send_ts"), rows.number("end_ts")
    live = live_frame(rows[(sent <= ts) & ((ended >= ts) | (cut & (ended >= ts - DETECTION_S)))])
    sizes = input_tokens(live, ratios())  # tokens per byte learnt from the whole run
    known = sizes["input_tokens"].dropna()
    largest = int(known.max()) if not known.empty else None
    estimated = bool(sizes.loc[known.idxmax(), "input_tokens_estimated"]) if largest is not None else False
    return {"requests_in_flight": len(live), "max_prompt_tokens": largest, "max_prompt_tokens_estimated": estimated,
            "prompt_tokens_unknown": int(sizes["input_tokens"].isna().sum()),
            "max_max_tokens": int(live["max_tokens"].max()) if live["max_tokens"].notna().any() else None}


def _largest_prompt(conditions: dict[str, Any]) -> str:
    tokens = conditions["max_prompt_tokens"]
    if tokens is None:
        return "largest prompt unknown"
    if conditions["max_prompt_tokens_estimated"]:
        return f"largest prompt ~{tokens} tokens (estimated from the bytes sent)"
    return f"largest prompt {tokens} tokens"


def _restart_check(data: RunData, ts: float) -> dict[str, Any]:
    """Did the server come back after the crash at `ts` and serve again, and did our restart command
    (`--k3-restart-cmd`, its `restart_command` event) run for it. Why say who restarted it: "did not
    come back" reads differently when no command was given than when ours ran and failed, and a server
    back without our command was restarted by its own supervisor."""
    ups = [e for e in data.events_named(Event.SERVER_UP) if e["ts"] > ts]
    up = ups[0]["ts"] if ups else None
    commands = [e for e in data.events_named(Event.RESTART_COMMAND)
                if e["ts"] >= ts and (up is None or e["ts"] <= up)]
    command = {"attempt": commands[0].get("attempt"), "log": commands[0].get("log")} if commands else None
    ran = f"restart command {command['attempt']} ran (log {command['log']})" if command else None
    if up is None:
        why = f"{ran} without bringing it back" if ran else \
            "no restart command ran (--k3-restart-cmd not given, or its --k3-max-restarts used up)"
        return {"recovered": False, "command_run": command,
                "detail": f"the server did not come back within the run; {why}"}
    rows = data.columns.rows()
    sent = rows.number("send_ts")
    served = int(((sent >= up) & rows.code_is("status", "ok")).sum())
    during = int(((sent >= ts) & (sent < up)).sum())
    by = ran or "no restart command of ours ran: something else restarted it"
    return {"recovered": served > 0, "down_s": up - ts, "up_ts": up, "ok_after_restart": served,
            "sent_while_down": during,
            "command_run": command,
            "detail": f"back after {up - ts:.0f} s, {served} requests served after it ({during} sent while it "
                      f"was down, not counted as load errors); {by}"}


def _memory_evidence(oom: bool, growth: GpuGrowth, ts: float, growth_limit_pct: float) -> str | None:
    """Why this crash is a memory crash, or None: an OOM line in the log, or a GPU's memory grown over its
    start-up baseline beyond the growth limit in the minute before it. vLLM's reservation is no evidence:
    every healthy card sits there (analysis/pillars/headroom/gpu_growth.py). A crash with neither is a stability
    finding."""
    if oom:
        return "OOM line in the server log"
    before = memory_before(growth, ts)
    if before is not None and before["growth_pct"] > growth_limit_pct:
        return (f"GPU memory grew {before['growth_mib']:,.0f} MiB over its start-up baseline on {before['gpu']} "
                f"({before['growth_pct']:.0f}% of what was free after start-up; {before['used_share']:.0%} of the "
                "card) in the minute before the crash")
    return None


def classify_crashes(data: RunData, growth_limit_pct: float = 50.0, spells: list[DownSpell] | None = None,
                     growth: GpuGrowth | None = None) -> list[dict[str, Any]]:
    spells = down_spells(data) if spells is None else spells
    growth = growth if growth is not None else gpu_growth(data, spells)
    out = []
    found, all_holds = _crash_times(data, spells), holds(data)
    learnt: list[Ratios] = []

    def ratios() -> Ratios:  # the run's tokens per byte, learnt once if a crash caught a request
        if not learnt:
            learnt.append(tokens_per_byte(data.columns.rows()))
        return learnt[0]

    for n, crash in enumerate(found):
        stage = data.stage_of(crash["ts"])
        kinds = sorted({e["event"] for e in crash["events"]})
        lines = [e.get("line") for e in crash["events"] if e.get("line")]
        curve = _memory_curve(data, crash["ts"])
        oom = Event.LOG_OOM in kinds
        out.append({"ts": crash["ts"], "stage": stage.name if stage else None,
                    "phase": PHASES.get(stage.kind if stage else None, "unknown phase"), "events": kinds,
                    "oom": oom, "memory_evidence": _memory_evidence(oom, growth, crash["ts"], growth_limit_pct),
                    "memory_before": memory_before(growth, crash["ts"]),
                    "log_lines": lines[:3], "conditions": _in_flight(data, crash["ts"], ratios),
                    "memory_curve": curve, "restart": _restart_check(data, crash["ts"])})
        down = next((e for e in crash["events"] if e["event"] == Event.SERVER_DOWN), None)
        in_hold = hold_at(all_holds, crash["ts"])  # a crash under a hold repeats the crash before it
        out[-1]["recurrence_of"] = n - 1 if in_hold is not None and n > 0 else None
        out[-1]["restart"]["same_conditions"] = same_conditions(
            crash["ts"], found[n + 1]["ts"] if n + 1 < len(found) else None, in_hold, all_holds,
            out[-1]["restart"].get("up_ts"))
        out[-1]["ended"] = ended(data, crash["ts"], out[-1]["restart"].get("up_ts"),
                                 down.get("reason") if down else None)
    return out


def soak_loads(data: RunData) -> list[tuple[str, float, float]]:
    """The soak stages while load was offered: (name, start, when their users stopped; the drain is no load)."""
    stopped = {e.get("stage"): e.get("users_stopped_ts") for e in data.events_named(Event.STAGE_DRAIN)}
    return [(s.name, s.start_ts, min(s.end_ts, stopped.get(s.name) or s.end_ts)) for s in data.stages
            if s.kind == StageKind.SOAK]


def _soak_windows(data: RunData) -> list[tuple[float, float]]:
    return [(t0, t1) for _, t0, t1 in soak_loads(data)]


def _startup_log(data: RunData) -> str:
    """The vLLM start-up log the precheck saved (DIR/evidence/startup.log; per node evidence/startup/NODE.log,
    the first node's), its head only: the KV lines come before the server listens."""
    evidence = data.path / "evidence"
    for path in [evidence / "startup.log", *sorted((evidence / "startup").glob("*.log"))]:
        try:
            with path.open("rb") as handle:
                return handle.read(1 << 20).decode(errors="replace")
        except OSError:
            continue
    return ""


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min" if seconds >= 90 \
        else f"{seconds:.0f} s"


def gpu_memory_judgment(data: RunData, growth: GpuGrowth, resources: dict[str, float]
                        ) -> tuple[dict[str, Any], list[str], list[str]]:
    """(numbers, failing reasons, notes) of the run-wide GPU memory rules: the creep through the soak projected
    to when the free memory is gone, against `min_gpu_runway_h` and the plan's own soak; and what was
    reserved at start, said with the result (never judged)."""
    if growth.empty:
        return {"judged": False}, [], []
    soaks = _soak_windows(data)
    creep = soak_creep(growth, soaks)
    soak_s = sum(t1 - t0 for t0, t1 in soaks)
    required_s = max(resources.get("min_gpu_runway_h", 24.0) * 3600, soak_s)
    numbers: dict[str, Any] = {"judged": True, "reserved": reservation_text(growth, cache_config(data),
                                                                            _startup_log(data)),
                               "baselines": [{"gpu": b.gpu, "used_mib": b.used_mib, "total_mib": b.total_mib,
                                              "source": b.source,
                                              "life_start_ts": None if math.isinf(b.life_start_ts) else b.life_start_ts}
                                             for b in growth.baselines],
                               "creep": creep.to_dict() if creep else None, "soak_s": soak_s,
                               "required_runway_s": required_s}
    notes = [numbers["reserved"]] if numbers["reserved"] else []
    if not soaks:
        notes.append("GPU memory creep not judged: no soak stage ran")
        return numbers, [], notes
    if creep is None:
        return numbers, [], notes
    said = (f"GPU memory creeps {creep.mib_per_min:,.0f} MiB/min on {creep.gpu} through the soak (a line explains "
            f"{creep.r2:.0%} of {creep.readings} readings over {_duration(creep.span_s)}): at this rate out of memory "
            f"in {_duration(creep.runway_s)} ({creep.free_mib_at_end:,.0f} MiB free at the end)")
    if creep.runway_s < required_s:
        before = "before the end of another soak as long as the plan's" if creep.runway_s < soak_s else \
            f"under the {resources.get('min_gpu_runway_h', 24.0):g} h runway required (min_gpu_runway_h)"
        return numbers, [f"{said}, {before}: a leak or fragmentation outside the KV pool, which more GPUs only "
                         "delay (gpu.jsonl, soak)"], notes
    return numbers, [], [*notes, said]


def judge_resources(data: RunData, index: MetricIndex, limits: dict[str, dict[str, float]]
                    ) -> tuple[PillarResult, list[StageRow]]:
    """The pillar, and the per-stage table, typed (the ramp, the capacity plan, the limits and the reports read it
    too; plain data in the pillar's numbers, which verdict.json carries)."""
    if not len(data.columns):
        return PillarResult(NOT_RUN, ["no request was recorded"]), []
    spells = down_spells(data)  # once: the stages, the crashes and the numbers read the same spells
    growth = gpu_growth(data, spells)  # each GPU against its start-up baseline, read by stages and crashes
    table: list[StageRow] = []
    slo, cap = Slo.from_limits(limits), engine_cap(data.path)
    for stage in data.stages:
        row = stage_stats(data, index, stage, spells, growth, slo, cap)
        table.append(replace(row, problems=tuple(stage_breaches(row, limits))))
    delivery = stream_delivery(data.columns.rows(), index, [row.stage for row in table if saturated_processes(row)])
    if delivery.buffered:  # the client timed the proxy's blocks: the latency SLOs go to the server's histograms
        table = [proxy_judged(row, index, limits) for row in table]
    plain = [row.to_dict() for row in table]  # the stage table as verdict.json carries it
    resources = limits.get("resources") or {}
    crashes = classify_crashes(data, resources.get("max_gpu_growth_pct", 50.0), spells, growth)
    memory, memory_reasons, memory_notes = gpu_memory_judgment(data, growth, resources)
    trends, trend_reasons, trend_notes = soak_trends(data, index, soak_loads(data), limits, spells, growth)
    memory_reasons, memory_notes = memory_reasons + trend_reasons, memory_notes + trend_notes
    numbers: dict[str, Any] = {"stages": plain, "crashes": crashes, "gpu_memory": memory,
                               "health_spells": [s.to_dict() for s in spells], "stream_delivery": delivery.to_dict()}
    if trends:  # only a soak of several windows has them: a shorter run's verdict.json is as it was
        numbers["soak_windows"] = trends
    reasons = [delivery.reason] if delivery.buffered else []
    reasons += [f"stage {row.stage}: {text}" for row in table for text in row.latency_unjudged or ()]
    for crash in crashes:
        what = "OOM crash" if crash["oom"] else "server crash" + ("" if crash["memory_evidence"] else
                                                                   " (no memory evidence)")
        reasons.append(f"{what} in stage {crash['stage']} ({crash['phase']}); "
                       f"{crash['conditions']['requests_in_flight']} requests in flight, "
                       f"{_largest_prompt(crash['conditions'])}; restart: {crash['restart']['detail']}"
                       f"; same conditions: {crash['restart']['same_conditions']['why']}")
    for stage, count in Counter(c["stage"] for c in crashes).items():
        if count > 1:
            reasons.append(f"{count} crashes in stage {stage}: the server died again under the same stage's load "
                           "(a recurrence, each crash listed)")
    reasons += memory_reasons
    saturated, saturated_within = _saturation(table, reasons)
    numbers["load_generator_saturated"] = [{"stage": row.stage, "processes": saturated_processes(row)}
                                           for row in table if saturated_processes(row)]
    numbers["drain"] = drain_audit(data, index, limits)  # after every stage: was everything let go?
    numbers["restart_drill"] = restart_drill(data, table)
    reasons += drain_reasons(numbers["drain"])
    drill = drill_reason(numbers["restart_drill"])
    if numbers["restart_drill"]["status"] == FAIL and drill:
        reasons.append(drill)
    if reasons:
        return PillarResult(FAIL, reasons, numbers), table
    if saturated:
        return PillarResult(INCONCLUSIVE, [f"inconclusive, because the load generator was saturated (CPU >= "
                                           f"{SATURATED_CPU_PCT:.0f}%) in {', '.join(saturated)}: the latencies "
                                           "measured there are the client's, not the server's (add workers: "
                                           "--processes N, or worker machines)"], numbers), table
    if not any(row.metrics_present for row in table):
        return PillarResult(INCONCLUSIVE, ["server metrics missing: KV usage, queue and preemptions are unknown "
                                           "(only the client's latencies and errors were judged)"], numbers), table
    gpu_note = "" if any(row.gpu_memory_peak_mib is not None for row in table) else \
        " (GPU telemetry unavailable: memory headroom not judged)"
    saturation_note = [f"the load generator was saturated (CPU >= {SATURATED_CPU_PCT:.0f}%) in "
                       f"{', '.join(saturated_within)}: the latencies there are the client's as much as the "
                       "server's (within the SLOs even so)"] if saturated_within else []
    return PillarResult(PASS, [f"all {len(table)} stages within the SLOs and resource limits, no crash"
                               + gpu_note] + ([drill] if drill else []) + saturation_note + memory_notes,
                        numbers), table
