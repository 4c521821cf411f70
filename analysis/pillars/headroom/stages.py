"""Per-stage figures: the client's latencies and errors joined with the server's and the GPUs' view.

Why per stage: OOM and queueing have causes by phase (load, long input, concurrency, soak), and a
capacity planner reads each concurrency step on its own. A stage is judged against the plan's SLOs
and resource limits; the checks that failed are named.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from k3load.analysis.pillars.headroom.arrival_lag import (
    LATE_S,
    LATE_SHARE,
    arrival_lag,
    offered_late,
    offered_short,
    replay_figures,
    sessions_started,
)
from k3load.analysis.pillars.headroom.full_batch import EngineCap, stage_batch_queue
from k3load.analysis.pillars.headroom.goodput import Slo, stage_goodput
from k3load.analysis.pillars.headroom.gpu_growth import GPU_NOISE_MIB, GpuGrowth, gpu_growth, stage_figures
from k3load.analysis.pillars.headroom.restart_audit import planned_down, planned_windows
from k3load.analysis.pillars.headroom.stage_row import ArrivalLag, StageRow
from k3load.analysis.pillars.limit_rules import LIMIT_RULES, RuleId
from k3load.analysis.pillars.pillar import percentiles
from k3load.analysis.pillars.rules import Breach, breach
from k3load.analysis.run.down_spells import DownSpell, down_spells
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.rundata import RunData, StageWindow
from k3load.analysis.run.stats import wilson
from k3load.analysis.run.timeline import MetricIndex
from k3load.events import Event
from k3load.outcomes import Signal
from k3load.sampler.vllm_metrics import VllmMetric
from k3load.workload.stage_kind import STEP_KINDS, StageKind

QUEUED_S = 2.0  # latency over its SLO while requests waited at least this long grows with the queue
# STEP_KINDS (k3load.workload.stage_kind): the stages that are load steps: a step the server only queued is past
# capacity (analysis/pillars/headroom/full_batch.py)


def _latency(rows: Rows) -> dict[str, float | None]:
    ok = rows[rows.code_is("status", "ok")]
    out: dict[str, float | None] = {}
    # ttfa: the first answer token after any reasoning; only streamed answers have one (none: unknown, None)
    for column, label in (("ttft_ms", "ttft"), ("ttfa_ms", "ttfa"), ("itl_mean_ms", "itl"), ("e2e_ms", "e2e")):
        values = ok.number(column)
        for q, value in zip((50, 95, 99), percentiles(values[~np.isnan(values)], (0.50, 0.95, 0.99)), strict=True):
            out[f"{label}_p{q}_ms"] = value
    return out


def sampler_process(data: RunData) -> str:
    """The process that sampled metrics.jsonl (its `load_generator_cpu_pct`): the master of a distributed run
    (--processes or --master), else the one local process."""
    return "master" if (data.run.get("options") or {}).get("master") else "local"


def _readings(data: RunData, line_key: str, event_key: str, t0: float, t1: float) -> dict[str, list[float]]:
    """Per load-generator process, its readings of one meter in [t0, t1]: the sampling process from
    metrics.jsonl (`line_key`), each worker from its `load_generator_cpu` events (`event_key`,
    k3load.loadgen.cpu); a reading that is no number is unknown, left out."""
    out: dict[str, list[float]] = {}
    readings = [(sampler_process(data), m.get("ts"), m.get(line_key)) for m in data.metrics]
    workers = data.events_named(Event.LOAD_GENERATOR_CPU)  # a worker's own CPU, written by the master as it arrives
    readings += [(str(e.get("process")), e.get("ts"), e.get(event_key)) for e in workers]
    for process, ts, value in readings:
        if isinstance(value, int | float) and not isinstance(value, bool) and ts is not None and t0 <= ts <= t1:
            out.setdefault(process, []).append(float(value))
    return dict(sorted(out.items()))


def cpu_by_process(data: RunData, t0: float, t1: float) -> dict[str, float]:
    """Each load-generator process's highest CPU in [t0, t1] (% of one core)."""
    return {p: max(v) for p, v in _readings(data, "load_generator_cpu_pct", "cpu_pct", t0, t1).items()}


def cpu_wait_in(data: RunData, windows: list[tuple[float, float]]) -> float | None:
    """The most-waiting load-generator process's mean wait for a CPU over all of `windows` (one stage's, a
    stage name played more than once has several), % of wall time; None where none was recorded."""
    merged: dict[str, list[float]] = {}
    for t0, t1 in windows:
        for process, values in _readings(data, "load_generator_cpu_wait_pct", "cpu_wait_pct", t0, t1).items():
            merged.setdefault(process, []).extend(values)
    return max((round(sum(v) / len(v), 1) for v in merged.values()), default=None)


def cpu_wait_by_process(data: RunData, t0: float, t1: float) -> dict[str, float]:
    """Each load-generator process's mean share of wall time waiting for a CPU in [t0, t1] (%,
    k3load.sampler.cpu_wait): a mean, not a peak, because the question is how much of the stage's
    measuring it held, and its windows are the sampler's equal intervals. Empty where none was recorded."""
    waits = _readings(data, "load_generator_cpu_wait_pct", "cpu_wait_pct", t0, t1)
    return {p: round(sum(v) / len(v), 1) for p, v in waits.items()}


def load_errors(rows: Rows) -> np.ndarray:
    """Failures load can cause: 5xx, 408, 429, timeouts, cut streams, transport errors. A 4xx refusal
    (e.g. vLLM's 400 '"auto" tool choice requires --enable-auto-tool-choice') is the request's or the
    configuration's fault, not a shortage: it stays a failure of the agent pillar (layer `server`). A
    `client_raised` (our client raised: nothing known of the answer) is never the server's."""
    status = rows.number("http_status")
    refused = (rows.code_is("status", "http_error") & (status >= 400) & (status <= 499)
               & ~np.isin(status, (408.0, 429.0)))
    return ~rows.code_is("status", "ok", "client_raised") & ~refused


def _error_kinds(errors: Rows) -> dict[str, int]:
    """What the failed requests were, most frequent first: `HTTP 502`, `truncated`, `timeout` ..."""
    http = errors.number("http_status")
    with_status = errors.code_is("status", "http_error") & ~np.isnan(http)
    counts: Counter[Any] = Counter()
    for value, n in zip(*np.unique(http[with_status], return_counts=True), strict=True):
        counts[f"HTTP {int(value)}"] += int(n)
    for status, n in errors[~with_status].counts("status").items():
        if status is not None:  # a status that is no value is no kind (as value_counts left it out)
            counts[status] += n
    return {str(k): int(v) for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))}


def sent_while_down(rows: Rows, spells: list[DownSpell]) -> np.ndarray:
    """Requests sent while the server was down (a crash, not a flap): refused because nobody was
    listening. They are the crash's consequence, said with it, not load errors of their own."""
    send = rows.number("send_ts")
    mask = np.zeros(len(send), dtype=bool)
    for spell in spells:
        if not spell.flap:
            end = spell.up_ts if spell.up_ts is not None else float("inf")
            mask |= (send >= spell.down_ts) & (send < end)
    return mask


def _errors(rows: Rows, spells: list[DownSpell]) -> dict[str, Any]:
    down = sent_while_down(rows, spells)
    mask = load_errors(rows) & ~down
    errors = rows[mask]
    layers: Counter[Any] = Counter()
    for layer, n in errors.counts("primary_layer").items():
        layers["unknown" if layer is None else layer] += n  # fillna("unknown"): one key with any "unknown"
    # Per attempt, not per distinct request (docs/verdict-rules.md): a load error (5xx, 429, a timeout, a cut
    # stream) is the server's state when the attempt was sent, not its prompt's, and the same bytes sent again
    # fail or not on their own. The distinct requests are said beside it.
    rate = wilson(int(mask.sum()), int((~down).sum()))
    return {"errors": int(mask.sum()), "error_rate": rate.value, "error_rate_ci95": [rate.low, rate.high],
            "error_rate_distinct_requests": rows[~down].distinct("request_sha256"),
            "sent_while_down": int(down.sum()),
            "errors_by_layer": {str(k): int(v) for k, v in sorted(layers.items())},
            "error_kinds": _error_kinds(errors) if len(errors) else {}}


def _capacity_figures(frame: Rows, duration: float, index: MetricIndex, stage: StageWindow,
                      slo: Slo | None, cap: EngineCap | None, labelled: Rows) -> dict[str, Any]:
    """Goodput (analysis/pillars/headroom/goodput.py), the arrival lag of an open-loop stage, and the queue behind
    a full batch (analysis/pillars/headroom/full_batch.py), as the row's fields; `labelled`: every record naming the
    stage (drills and those ended after a step's decision too: its sessions started)."""
    started = sessions_started(labelled, stage.end_ts) if stage.sessions_per_s is not None else None
    lag = arrival_lag(frame, started)  # open-loop stages only (an empty dict elsewhere: closed-loop rows unchanged)
    queue = stage_batch_queue(index, stage.start_ts, stage.end_ts, cap, stage.users)
    return {"goodput": stage_goodput(frame, slo, duration) if slo is not None else None,
            "arrival": ArrivalLag(**lag) if lag else None,
            "sessions_per_s": stage.sessions_per_s,  # the arrival rate offered (a rate search's step: its load)
            "search": stage.search,  # the plan's search stage this step belongs to
            "full_batch_scrapes": queue.scrapes if queue else None,
            "full_batch_queued_scrapes": queue.queued if queue and queue.cap is not None else None,
            "full_batch_cap": queue.cap if queue else None, "full_batch_cap_from": queue.cap_from if queue else None,
            "past_capacity": queue.past_capacity if queue and queue.cap is not None else None}


def stage_stats(data: RunData, index: MetricIndex, stage: StageWindow, spells: list[DownSpell] | None = None,
                growth: GpuGrowth | None = None, slo: Slo | None = None, cap: EngineCap | None = None
                ) -> StageRow:
    """`slo`: each request's limits, for the goodput (none: not computed); `cap`: the engine's max_num_seqs
    where the server said it (analysis/pillars/headroom/full_batch.py). The row's problems are judged after
    (`stage_breaches`)."""
    t0, t1 = stage.start_ts, stage.end_ts
    labelled = data.columns.rows(stage.name)
    frame = labelled[~labelled.flag("drill")]
    if stage.search is not None:  # a search step: what ended by its decision, the evidence the live search judged
        frame = frame[frame.number("end_ts") <= t1]
    planned = planned_windows(data)  # the restart drill's down on purpose is not the stage's
    # rates over the time load was offered: a restart drill's wait for the server is no load time
    duration = max(t1 - t0 - sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in planned), 1e-9)
    ok = frame[frame.code_is("status", "ok")]
    kv = index.gauge(VllmMetric.KV_CACHE_USAGE, t0, t1)
    waiting = index.gauge(VllmMetric.NUM_REQUESTS_WAITING, t0, t1)
    running = index.gauge(VllmMetric.NUM_REQUESTS_RUNNING, t0, t1)
    preemptions = index.delta(VllmMetric.NUM_PREEMPTIONS_TOTAL, t0, t1)
    spells = down_spells(data) if spells is None else spells
    flaps = {spell.down_ts for spell in spells if spell.flap}
    downs = [e for e in data.events_named(Event.SERVER_DOWN) if t0 <= e["ts"] <= t1 and e["ts"] not in flaps
             and not planned_down(e["ts"], planned)]
    cpu = cpu_by_process(data, t0, t1)
    errors = _errors(frame, spells)
    latency: dict[str, Any] = _latency(frame)
    gpu: dict[str, Any] = stage_figures(growth if growth is not None else gpu_growth(data, spells), t0, t1)
    return StageRow(
        stage=stage.name, kind=stage.kind, users=stage.users, start_ts=t0, duration_s=t1 - t0,
        attempts=len(frame), **(errors | {"error_rate_ci95": tuple(errors["error_rate_ci95"])}),
        requests_per_s=len(ok) / duration,
        output_tokens_per_s=float(np.nan_to_num(ok.number("completion_tokens"), nan=0.0).sum()) / duration,
        max_prompt_tokens_ok=_largest(ok.number("prompt_tokens")),
        **latency,
        kv_usage_mean=kv["mean"] if kv else None, kv_usage_max=kv["max"] if kv else None,
        kv_usage_max_by_source={src or "target": g["max"] for src, g in
                                index.gauge_by_source(VllmMetric.KV_CACHE_USAGE, t0, t1).items()},
        waiting_max=waiting["max"] if waiting else None,
        waiting_sustained_s=index.sustained_queue_s(t0, t1),
        running_max=running["max"] if running else None,
        load_generator_cpu_max_pct=max(cpu.values()) if cpu else None,  # over every process
        load_generator_cpu_max_pct_by_process=cpu,
        load_generator_cpu_wait_pct_by_process=cpu_wait_by_process(data, t0, t1) or None,
        preemptions=preemptions, preemptions_per_min=preemptions / duration * 60 if preemptions is not None
        else None, server_down_events=len(downs),
        health_flaps=sum(1 for ts in flaps if t0 <= ts <= t1 and not planned_down(ts, planned)),
        # The engine's own gauges, not any vllm:* series: with --disable-log-stats vLLM 0.32 still
        # serves vllm:tool_call_parser_invocations_total, and KV, queue and preemptions are unknown.
        metrics_present=kv is not None or waiting is not None or running is not None,
        **gpu,
        **_capacity_figures(frame, duration, index, stage, slo, cap, labelled),
        replay=replay_figures(data.events_named(Event.REPLAY_END), stage.name).get("replay"),  # arrival_lag.py
    )


def _largest(values: np.ndarray) -> int | None:
    known = values[~np.isnan(values)]
    return int(known.max()) if len(known) else None


def _over(value: float | None, limit: float) -> bool:
    return value is not None and value > limit


def _error_breach(row: StageRow, limit: float) -> Breach | None:
    """Errors breach the SLO only when the rate's lower 95% bound is above it (a few unlucky
    requests in a short stage are not a verdict); the reason names the layers and kinds."""
    low = (row.error_rate_ci95 or (0.0,))[0]
    if not row.attempts or low is None or low <= limit:
        return None
    layers = ", ".join(f"{k} {v}" for k, v in row.errors_by_layer.items())
    kinds = ", ".join(f"{k} x{v}" for k, v in list(row.error_kinds.items())[:3])
    return breach(RuleId.SLO_ERROR_RATE, Signal.ERRORS, row.error_rate, limit,
                  f"error rate {row.error_rate:.1%} (95% CI from {low:.1%}, over "
                  f"{row.attempts - row.sent_while_down:,} attempts of "
                  f"{row.error_rate_distinct_requests} distinct requests: a load error is drawn per "
                  f"attempt) > {limit:.1%} "
                  f"(by layer: {layers}; {kinds})", f"records.jsonl stage={row.stage}")


def gpu_breaches(row: StageRow, resources: dict[str, float]) -> list[Breach]:
    """GPU memory against what the load added (analysis/pillars/headroom/gpu_growth.py), never against vLLM's
    reservation:
    growth over the start-up baseline beyond `max_gpu_growth_pct` of what was free then; headroom under
    `min_gpu_headroom_pct` of the card only where the load took it there (a card reserved below the floor at
    start is said with the pass, not judged); free memory at the peak that could not hold another jump as
    large as the largest seen. The GPU figures are measured together (gpu_growth.stage_figures): all or none."""
    grown = row.gpu_growth_max_pct
    if grown is None:
        return []
    grown_mib, headroom, baseline = row.gpu_growth_max_mib, row.gpu_headroom_min_pct, row.gpu_baseline_headroom_min_pct
    free = row.gpu_free_min_mib
    if grown_mib is None or headroom is None or baseline is None or free is None:
        raise ValueError(f"stage {row.stage}: GPU growth measured without its other GPU figures")
    out: list[Breach] = []
    where = f"gpu.jsonl stage={row.stage}"
    limit = resources["max_gpu_growth_pct"]
    if grown > limit and grown_mib >= GPU_NOISE_MIB:
        out.append(breach(RuleId.GPU_GROWTH, Signal.RESOURCE, grown, limit,
                          f"GPU memory grew {grown_mib:,.0f} MiB over its start-up baseline on "
                          f"{row.gpu_growth_gpu} ({grown:.0f}% of what was free after start-up) > {limit:.0f}%",
                          where))
    floor = resources["min_gpu_headroom_pct"]
    if headroom < floor <= baseline:
        out.append(breach(RuleId.GPU_HEADROOM, Signal.RESOURCE, headroom, floor,
                          f"GPU memory headroom fell to {headroom:.1f}% < {floor:.0f}% (from "
                          f"{baseline:.1f}% after start-up)", where))
    jump = row.gpu_largest_jump_mib or 0.0
    if jump >= GPU_NOISE_MIB and free < jump:
        out.append(breach(RuleId.GPU_JUMP, Signal.RESOURCE, free, jump,
                          f"only {free:,.0f} MiB free on {row.gpu_free_min_gpu} at the stage's peak, less than "
                          f"the largest jump seen ({jump:,.0f} MiB between two readings): another as large would "
                          "not fit", where))
    return out


def full_batch_breach(row: StageRow) -> Breach:
    """A load step the server only queued: requests waited behind a full batch for most of it (`past_capacity`
    is said only with the scrapes counted, full_batch.py)."""
    queued, scrapes = row.full_batch_queued_scrapes or 0, row.full_batch_scrapes or 0
    share = queued / scrapes
    return breach(RuleId.FULL_BATCH_QUEUE, Signal.RESOURCE, share, 0.5,
                  f"requests waited behind a full batch in {queued} of "
                  f"{scrapes} scrapes ({share:.0%}; running at {row.full_batch_cap}, "
                  f"{row.full_batch_cap_from}): the server queued this load, it did not hold it",
                  f"metrics.jsonl stage={row.stage}")


def stage_breaches(row: StageRow, limits: dict[str, dict[str, float]]) -> list[Breach]:
    """The limits a stage exceeded, as typed breaches (empty: within limits), in the order of the rule table
    (analysis/pillars/limit_rules.py) and then the rules whose check is code."""
    problems: list[Breach] = []
    errors = _error_breach(row, limits["slo"]["max_error_rate"])
    if errors:
        problems.append(errors)
    queued = (row.waiting_sustained_s or 0) >= QUEUED_S
    where = f"stage={row.stage}"
    for rule in LIMIT_RULES:
        limit, value = limits[rule.section][rule.key], getattr(row, rule.stats_key)
        if _over(value, limit):
            signal = rule.signal
            if signal == Signal.LATENCY and queued:
                signal = Signal.QUEUE_LATENCY  # over the SLO while requests queued: it grows with the queue
            source = "records.jsonl" if rule.section == "slo" else "metrics.jsonl"
            problems.append(breach(rule.id, signal, value, limit, rule.reason.format(v=value, lim=limit),
                                   f"{source} {where}"))
    problems += gpu_breaches(row, limits["resources"])
    step = row.kind in STEP_KINDS
    if step and row.past_capacity:
        problems.append(full_batch_breach(row))
    problems += _offered_breaches(row, step)
    if row.server_down_events:
        problems.append(breach(RuleId.SERVER_DOWN, Signal.STABILITY, row.server_down_events, 0,
                               f"server down {row.server_down_events} time(s)", f"events.jsonl {where}"))
    if row.health_flaps:
        problems.append(breach(RuleId.HEALTH_FLAP, Signal.HEALTH_FLAP, row.health_flaps, 0,
                               f"/health said down {row.health_flaps} time(s) while requests kept being answered "
                               "(a flapping health check, not a crash)", f"events.jsonl {where}",
                               f"records.jsonl {where}"))
    return problems


def _offered_breaches(row: StageRow, step: bool) -> list[Breach]:
    """An open-loop stage that did not offer its load: sessions short of its rate, turns (or a trace's rows) sent
    late. Figures of `row.arrival` (absent: a closed-loop stage, nothing to judge)."""
    out: list[Breach] = []
    arrival = row.arrival
    arrived = (arrival.sessions_arrived if arrival else None) or 0
    offered = (row.sessions_per_s or 0) * (row.duration_s or 0)
    if step and row.sessions_per_s is not None and offered_short(offered, arrived):
        out.append(breach(RuleId.OFFERED_SHORT, Signal.RESOURCE, arrived, offered,
                          f"{arrived} sessions started of {offered:.0f} its rate "
                          "offered: every session slot was busy, the step did not offer its rate",
                          f"records.jsonl stage={row.stage}"))
    if arrival is None or not offered_late(arrival.scheduled_turns or 0, arrival.late_turns or 0):
        return out
    if step:  # sessions outlasting their slots: the server slowed (a resource)
        out.append(breach(RuleId.OFFERED_LATE, Signal.RESOURCE, arrival.late_share, LATE_SHARE,
                          f"{arrival.late_turns} of {arrival.scheduled_turns} scheduled turns went out more "
                          f"than {LATE_S:g} s late (p95 {arrival.send_lag_p95_ms:.0f} ms): every session slot "
                          "was busy, so the step did not offer its rate and its latencies leave out the wait",
                          f"records.jsonl stage={row.stage}"))
    if row.kind == StageKind.REPLAY:  # the trace's pace not offered: its latencies leave out the wait
        why = "; ".join((row.replay or {}).get("fell_behind") or []) or "the load generator fell behind"
        out.append(breach(RuleId.OFFERED_LATE, Signal.RESOURCE, arrival.late_share, LATE_SHARE,
                          f"{arrival.late_turns} of {arrival.scheduled_turns} trace rows went out more than "
                          f"{LATE_S:g} s late: {why}", f"records.jsonl stage={row.stage}",
                          f"events.jsonl replay_end stage={row.stage}"))
    return out
