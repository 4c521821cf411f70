"""`k3load analyze DIR`: judge a run directory and write verdict.json, the reports, alerts and manifest.

Why a pure pipeline (load -> pillars -> verdict -> outputs): the directory is the whole evidence, so
the same files must give the same verdict.json byte for byte on any machine, and a test can judge a
hand-made directory. Nothing here reads the clock or the network.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from k3load.analysis.decision.capacity import CapacityPlan, PlannerInputs, capacity_plan, min_goodput, planner_inputs
from k3load.analysis.decision.capacity_context import assumptions, cold_cache, search_said, telemetry_gpus
from k3load.analysis.decision.checklist import build_checklist
from k3load.analysis.decision.ramp import Ramp, RampMarks, ramp_of
from k3load.analysis.outputs.plot_inputs import plot_inputs
from k3load.analysis.outputs.plots_beside import PlotsBeside
from k3load.analysis.pillars.agent.agreement import read_reference
from k3load.analysis.pillars.agent.pillar_agent import judge_agent_api, tool_turns_reason
from k3load.analysis.pillars.cache.pillar_cache import cache_config, judge_prefix_cache
from k3load.analysis.pillars.cache.reuse import apply_reuse, judge_reuse
from k3load.analysis.pillars.headroom.buffering import Delivery
from k3load.analysis.pillars.headroom.pillar_resources import judge_resources
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.pillar import PillarResult, rounded, thresholds
from k3load.analysis.run.rundata import RunData, gc_paused, load_run
from k3load.analysis.run.timeline import MetricIndex, shared_indexes
from k3load.analysis.verdict import EXIT_CODES, NEXT_ACTION, Limits, compat_pillar, verdict_of
from k3load.events import Event
from k3load.outcomes import NOT_RUN, Verdict
from k3load.rundir import write_atomic
from k3load.sampler.vllm_metrics import VllmMetric
from k3load.workload.stage_kind import StageKind

OUTPUTS = ("verdict.json", "capacity.json", "report.md", "report.html", "alerts.yaml", "dashboard.json",
           "manifest.sha256")


@dataclass
class Judgment:
    data: RunData
    pillars: dict[str, PillarResult]
    stage_table: list[StageRow]  # typed; plain data where verdict.json and the reports are written
    ramp: Ramp
    verdict: Verdict
    because: list[str]
    limits: Limits  # the limits that hold (verdict.json's `limits`)
    checklist: list[dict[str, Any]]
    capacity: CapacityPlan  # capacity.json (analysis/decision/capacity.py), plain where written

    def verdict_json(self) -> dict[str, Any]:
        """Exactly the contract's top-level keys."""
        return {"verdict": self.verdict,
                "pillars": {name: p.to_dict() for name, p in self.pillars.items()},
                "limits": rounded(self.limits.to_dict()), "checklist": self.checklist,
                "next_action": {"action": NEXT_ACTION[self.verdict], "because": self.because}}

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def judge(run_dir: Path, plotter: PlotsBeside | None = None) -> Judgment:
    """`plotter`: given the report's plot inputs as soon as they are known (the rest is judged meanwhile)."""
    with gc_paused():  # the rules build lists and tuples by the million and no reference cycle
        return _judge(run_dir, plotter)


def _judge(run_dir: Path, plotter: PlotsBeside | None = None) -> Judgment:
    data = load_run(run_dir)
    limits = thresholds(data.plan.thresholds if data.plan else None)
    index = MetricIndex(data.metrics)
    cache_limits, config = limits["prefix_cache"] | limits["resources"], cache_config(data)
    # The stage table first: the report's plots need only it, so their child draws them on the other core
    # while this process judges the rest. Every pillar is judged here, in turn: the rules are Python (the
    # GIL held), and the reuse replay in a thread beside the resources pillar slowed both (an hour's soak:
    # 0.3 s alone for the resources, 1.85 s beside the reuse thread, the plots' inputs later by as much).
    resources, stage_table = judge_resources(data, index, limits)
    ramp_table = replace(ramp_of(stage_table), marks=_capacity_marks(data, stage_table, limits))
    if plotter is not None:  # drawn in its child while the other pillars are judged
        plotter.submit(plot_inputs(ramp_table, data, index, resources.numbers.get("crashes", []),
                                   resources.numbers.get("soak_windows", [])))
    pillars = {"compat": compat_pillar(data.compat, data.unreadable.get("compat.json")), "resources": resources,
               "prefix_cache": judge_prefix_cache(data, index, cache_limits, buffered=(resources.numbers.get(
                   "stream_delivery") or {}).get("delivery") == Delivery.BUFFERED),
               "agent_api": judge_agent_api(data, limits["agent_api"], data.plan,
                                            read_reference(run_dir, data.problems))}
    _server_aborts(pillars["agent_api"], data, index)
    reuse = judge_reuse(data, index, cache_limits, config)  # designed vs achieved reuse per family (issue 15)
    apply_reuse(pillars["prefix_cache"], data, index, cache_limits, config, reuse)
    checklist = build_checklist(data, pillars)  # the signed record's lines: an open one is never `go`
    verdict, because, verdict_limits = verdict_of(pillars, stage_table, ramp_table, unfinished_plan(data),
                                                 checklist)
    if ((data.compat or {}).get("target") or {}).get("is_sim"):
        because = [*because, "the target is the k3load sim: a rehearsal, never evidence for a production verdict"]
    if data.plan and (steered := tool_turns_reason(data.plan.tool_turns)):
        because = [*because, steered]
    if data.problems:
        because = [*because, evidence_gaps(data.problems)]
    capacity = plan_capacity(data, index, pillars, stage_table, verdict_limits)
    return Judgment(data, pillars, stage_table, ramp_table, verdict, because, verdict_limits, checklist, capacity)


def plan_capacity(data: RunData, index: MetricIndex, pillars: dict[str, PillarResult],
                  stage_table: list[StageRow], limits: Limits,
                  inputs: PlannerInputs | None = None) -> CapacityPlan:
    """capacity.json: `inputs` as the run asked (its options and plan) unless given (`k3load capacity`)."""
    inputs = inputs or planner_inputs(data.run, data.plan, data.compat, telemetry_gpus(data))
    bound = min_goodput(data.plan)
    kind = next((k for k in (StageKind.SEARCH, StageKind.CONCURRENCY) if any(s.kind == k for s in stage_table)),
                None)  # a search first: the capacity was read from it
    routing = next((r for r in pillars["prefix_cache"].numbers.get("rules", []) if r.get("id") == "cache.routing"),
                   None)
    plan = capacity_plan(stage_table, inputs, bound, limits.max_input_tokens)
    per = plan.per_replica
    slo = thresholds(data.plan.thresholds if data.plan else None)["slo"]
    return replace(plan, assumptions=tuple(assumptions(data, len(index.sources), routing, kind, per["searched_on"])),
                   what_if=(cold_cache(data, per, slo),), search=search_said(data, per))


def _capacity_marks(data: RunData, stage_table: list[StageRow], limits: dict[str, dict[str, float]]
                    ) -> RampMarks:
    """What the ramp's plots mark: the SLO lines, the goodput bound and the capacity point
    (analysis/decision/capacity.py,
    from the stage table alone, so the plots can be drawn before the other pillars are judged)."""
    bound = min_goodput(data.plan)
    per = capacity_plan(stage_table, PlannerInputs(), bound, None).per_replica
    gpus = planner_inputs(data.run, data.plan, data.compat, telemetry_gpus(data)).gpus_per_replica
    on_rate = per["searched_on"] == "sessions_per_s"  # the ramp's steps are then the rate search's: x is the rate
    return RampMarks(slo=dict(limits["slo"]), min_goodput=bound, gpus=gpus, on_rate=on_rate,
                     capacity_load=per["max_sessions_per_s_at_slo" if on_rate else "max_users_at_slo"])


def unfinished_plan(data: RunData) -> str | None:
    """A run cut short (kill -9, power loss: no `run_end`) or stopped before its last stage proved less
    than its plan asked: said with the verdict, which is then never `go`."""
    if data.plan is None or not data.plan.stages:
        return None
    if any(e.get("load_skipped") for e in data.events_named(Event.PRECHECK)):
        return ("no load ran: the precheck's outcome is rebuild, so the run stopped before its first stage "
                "(--k3-load-after-rebuild runs the plan anyway)")
    started = {e.get("stage") for e in data.events_named(Event.STAGE_START)}
    started |= {s.search for s in data.stages if s.search}  # a search ran when one of its steps did
    missing = [s.name for s in data.plan.stages if s.name not in started]
    ended = bool(data.events_named(Event.RUN_END))
    if not missing and ended:
        return None
    how = "the run was cut short (no run_end in events.jsonl)" if not ended else "the run was stopped early"
    stages = f": stages {', '.join(missing)} not run" if missing else ": every stage started, the last one did not end"
    return f"the plan did not finish, {how}{stages}"


def _server_aborts(agent: PillarResult, data: RunData, index: MetricIndex) -> None:
    """The server's own count of requests it aborted over the run (abandoned attempts it worked on:
    our deadlines, cut streams), next to the client's count of duplicate work; None when not scraped."""
    requests = agent.numbers.get("requests")
    if requests is None or not data.stages:
        return
    t0, t1 = data.stages[0].start_ts, data.stages[-1].end_ts
    requests["server_aborted_requests"] = index.delta(VllmMetric.REQUEST_SUCCESS_TOTAL, t0, t1,
                                                      {"finished_reason": "abort"})


class NothingJudged(ValueError):
    """Every pillar `not_run`: the directory holds evidence of nothing. A harness error (exit 2, one line,
    nothing written), never a verdict: `limited` on nothing would read as a judgment (issue 38)."""


def nothing_judged(judgment: Judgment) -> str | None:
    """Why nothing could be judged (each pillar's first reason), or None when a pillar was judged."""
    if any(p.status != NOT_RUN for p in judgment.pillars.values()):
        return None
    why = "; ".join(f"{name}: {p.reasons[0]}" if p.reasons else name for name, p in judgment.pillars.items())
    return f"{judgment.data.path}: nothing could be judged, every pillar is not_run ({why})"


def evidence_gaps(problems: list[str], shown: int = 3) -> str:
    """Files the judgment could not fully read are said with the verdict, never only skipped."""
    more = f" (+{len(problems) - shown} more)" if len(problems) > shown else ""
    return f"evidence incomplete, judged on what was readable: {'; '.join(problems[:shown])}{more}"


def analyze(run_dir: Path, plots_beside: bool = False) -> Judgment:
    """Judge and write every output (atomically); the manifest is written last and covers the rest.
    A run in which every pillar is `not_run` raises NothingJudged before anything is written.
    `plots_beside`: the report's plots drawn in a forked child meanwhile (analysis/outputs/plots_beside.py; only
    from a plain process with no other thread, as `k3load analyze` is)."""
    from k3load.analysis.outputs import alerts, dashboard, manifest, report_html, report_md

    plotter = PlotsBeside() if plots_beside else None  # forked first: before any thread or any of the run
    try:
        # The inputs are hashed for the manifest while the run is judged (hashlib releases the GIL).
        with ThreadPoolExecutor(max_workers=1) as pool, shared_indexes():  # one metrics index: verdict and plots
            inputs = pool.submit(manifest.digests, run_dir, OUTPUTS)
            judgment = judge(run_dir, plotter)
            if why := nothing_judged(judgment):
                raise NothingJudged(why)
            text = json.dumps(judgment.verdict_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            write_atomic(run_dir / "verdict.json", text)
            write_atomic(run_dir / "capacity.json", json.dumps(judgment.capacity.to_dict(), indent=2, sort_keys=True,
                                                               ensure_ascii=False) + "\n")
            write_atomic(run_dir / "report.md", report_md.render(judgment))
            pngs = plotter.result() if plotter is not None else None
            write_atomic(run_dir / "report.html", report_html.render(judgment, pngs))
            write_atomic(run_dir / "alerts.yaml", alerts.render(judgment))
            write_atomic(run_dir / "dashboard.json", dashboard.render(judgment))
            signed = (run_dir / manifest.MANIFEST).read_bytes() if (run_dir / manifest.MANIFEST).is_file() else None
            manifest.write(run_dir, inputs.result())
            _set_aside_stale_signatures(run_dir, signed)
    finally:
        if plotter is not None:
            plotter.close()
    return judgment


def _set_aside_stale_signatures(run_dir: Path, signed: bytes | None) -> None:
    """A re-judged signed run: its signatures over the earlier manifest kept aside, marked stale (`k3load analyze`
    and `k3load verify` say so: k3load.signing.record.stale_sets)."""
    from k3load.signing.record import refresh_reports, set_aside_stale

    set_aside_stale(run_dir, signed)
    refresh_reports(run_dir)  # the signatures still over this manifest (the same evidence), in the reports
