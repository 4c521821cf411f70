"""The four-way verdict from the four pillars, by the spec's rules, in the spec's order.

    rebuild   compatibility failed (CUDA / driver / image / dependency mismatch) — decided first
    scale_up  compatible, but OOM, crashes, queueing or KV pressure persist under load
    limited   major functions work, but explicit limits are needed (concurrency, input length,
              cache use) or a pillar is not proven; the limits that hold are named
    go        all four pillars pass

Pure functions of the pillar results: the same run directory gives the same verdict, byte for byte.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from k3load.analysis.decision.checklist import open_items as open_lines
from k3load.analysis.decision.ramp import Ramp
from k3load.analysis.pillars.agent.pillar_agent import context_reason
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.limit_rules import RuleId
from k3load.analysis.pillars.pillar import PillarResult
from k3load.analysis.pillars.rules import RESOURCE_SIGNALS
from k3load.outcomes import FAIL, INCONCLUSIVE, NOT_APPLICABLE, NOT_RUN, PASS, Pillar, Verdict
from k3load.workload.stage_kind import STEP_KINDS, StageKind

NEXT_ACTION = {
    Verdict.GO: "Fix the exposure scope and monitoring: deploy alerts.yaml and watch GPU memory, KV usage, waiting "
          "requests, preemptions, prefix-cache hits, TTFT and tool-call schema failures.",
    Verdict.LIMITED: "Go live only within the limits below (concurrency, input length, users), and re-run the "
               "acceptance after the open items are fixed.",
    Verdict.REBUILD: "Return to the official build (K3 image, CUDA 13, driver R580+, pinned vLLM) and re-run the "
               "acceptance from the precheck.",
    Verdict.SCALE_UP: "Redesign topology, parallelism or GPU capacity (more or larger GPUs, fewer concurrent "
                "sequences, a smaller max_model_len), then re-run the load stages.",
}
EXIT_CODES = {Verdict.GO: 0, Verdict.LIMITED: 3, Verdict.REBUILD: 4, Verdict.SCALE_UP: 5}


def compat_pillar(compat: dict[str, Any] | None, unreadable: str | None = None) -> PillarResult:
    """`unreadable`: why a compat.json that is there could not be read (k3load.analysis.run.rundata._json_object)."""
    if compat is None and unreadable:
        return PillarResult(INCONCLUSIVE, [f"inconclusive, because compat.json is {unreadable}"])
    if compat is None:
        return PillarResult(NOT_RUN, ["no compat.json: the precheck did not run"])
    rules = compat.get("rules", [])
    failed = [r for r in rules if r.get("status") == FAIL]
    undecided = [r for r in rules if r.get("status") == INCONCLUSIVE]
    skipped = [r["id"] for r in rules if r.get("status") == NOT_APPLICABLE]
    recipe = (compat.get("recipe") or {}).get("name", "?")
    numbers = {"recipe": recipe, "rules": len(rules), "failed": [r["id"] for r in failed],
               "inconclusive": [r["id"] for r in undecided], "not_applicable": skipped}
    reasons = [f"{r['id']}: {r.get('reason', '')}" for r in failed or undecided]
    status = compat.get("status", INCONCLUSIVE)
    if status == PASS:
        reasons = [f"recipe {recipe}: {len(rules) - len(skipped)} rules pass"
                   + (f", {len(skipped)} not applicable ({', '.join(skipped)})" if skipped else "")]
    return PillarResult(status if status in (PASS, FAIL) else INCONCLUSIVE, reasons, numbers)


@dataclass(frozen=True)
class Limits:
    """The limits that hold, as the verdict names them; plain data (`to_dict`) in verdict.json."""

    max_concurrency: int | None
    max_input_tokens: int | None
    kv_cache_usage_ceiling: float | None
    ran_out_first: str | None
    max_model_len: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _limits(stage_table: list[StageRow], ramp: Ramp, context: dict[str, Any] | None = None) -> Limits:
    good = [s for s in stage_table if not s.problems]
    long_ok = [s.max_prompt_tokens_ok for s in good if s.kind == StageKind.LONG_INPUT and s.max_prompt_tokens_ok]
    any_ok = [s.max_prompt_tokens_ok for s in good if s.max_prompt_tokens_ok]
    kv = [s.kv_usage_max for s in good if s.kv_usage_max is not None]
    users = [s.users for s in good if s.users]
    refused = [v["max_model_len"] for v in (context or {}).values()]
    return Limits(max_concurrency=ramp.knee_users if ramp.steps else (max(users) if users else None),
                  max_input_tokens=max(long_ok or any_ok) if (long_ok or any_ok) else None,
                  kv_cache_usage_ceiling=max(kv) if kv else None,
                  ran_out_first=ramp.ran_out_first,
                  max_model_len=min(refused) if refused else None)


def _resource_breaches(stage: StageRow) -> list[str]:
    return [p.reason for p in stage.problems if p.signal in RESOURCE_SIGNALS]


def _scale_up_reasons(resources: PillarResult, stage_table: list[StageRow], ramp: Ramp) -> list[str]:
    """`scale_up` needs a resource signal: an OOM or a crash with memory evidence, KV at its limit,
    sustained waiting, preemptions, GPU memory, or latency over its SLO while requests queued. Errors,
    flapping health checks and crashes without memory evidence are never a reason to buy GPUs."""
    reasons = []
    crashes = resources.numbers.get("crashes", [])
    for n, crash in enumerate(crashes):
        same = (crash.get("restart") or {}).get("same_conditions") or {}
        if not crash.get("memory_evidence") or same.get("status") == "held":
            continue  # no memory evidence: a stability finding; held under the same load: a one-off (limited)
        if crash.get("recurrence_of") is not None:
            continue  # the recurrence itself: said with the crash it repeated
        text = f"{'OOM' if crash['oom'] else 'crash'} {crash['phase']} (stage {crash['stage']}; " \
               f"{crash['memory_evidence']})"
        if same.get("recurred"):
            again = crashes[n + 1] if n + 1 < len(crashes) else {}
            text += (f", and again under the same load after the restart ({same['why']}; "
                     f"{again.get('memory_evidence') or 'no memory evidence'}): a continuing OOM")
        reasons.append(text)
    loads = [s for s in stage_table if s.kind == StageKind.LOAD]
    if loads and all(_resource_breaches(s) for s in loads):
        reasons.append("even the base load stage exceeded its resource limits: "
                       + "; ".join(_resource_breaches(loads[0])))
    steps = [s for s in stage_table if s.kind in STEP_KINDS]
    if steps and ramp.knee_users is None and _resource_breaches(min(steps, key=lambda s: s.users or 0)):
        reasons.append(f"no {steps[0].kind} step stayed within limits ({ramp.ran_out_first} ran out first)")
    return reasons


def _failing_layers(stage_table: list[StageRow]) -> str | None:
    """Failures without a resource signal, by layer: what to fix instead of buying GPUs."""
    layers: dict[str, int] = {}
    for stage in stage_table:
        ids = {p.id for p in stage.problems}
        if RuleId.SLO_ERROR_RATE not in ids or _resource_breaches(stage) or RuleId.SERVER_DOWN in ids:
            continue  # errors under KV or queue pressure, or cut by a crash, are said with that cause
        for layer, count in stage.errors_by_layer.items():
            layers[layer] = layers.get(layer, 0) + count
    if not layers:
        return None
    named = ", ".join(f"{k} {v}" for k, v in sorted(layers.items(), key=lambda kv: -kv[1]))
    return f"failed requests without a resource signal (KV, queue, preemptions, GPU memory): by layer {named}; " \
           "fix that layer, not the GPU capacity"


def _context_item(pillars: dict[str, PillarResult]) -> str | None:
    refusals = pillars[Pillar.AGENT_API].numbers.get("context_length_refusals") or {}
    reason = context_reason(refusals)
    return f"input length: {reason}" if reason else None


def not_proven(checklist: list[dict[str, Any]]) -> list[str]:
    """The checklist's open lines as reasons: what the run did not prove, so never `go`
    (analysis/decision/checklist.py).
    The verdict reads these lines, not a second list of its own, so the two can never disagree."""
    return [f"not proven: {item['item']} ({item['detail']})" for item in open_lines(checklist)]


def verdict_of(pillars: dict[str, PillarResult], stage_table: list[StageRow], ramp: Ramp,
               unfinished: str | None = None, checklist: list[dict[str, Any]] | None = None
               ) -> tuple[Verdict, list[str], Limits]:
    """(verdict, why, limits). `unfinished`: the plan did not finish (never `go`). `checklist`: the signed
    record's lines; an open one is never `go` (it leads the reasons of a run otherwise `go`)."""
    limits = _limits(stage_table, ramp, pillars[Pillar.AGENT_API].numbers.get("context_length_refusals"))
    if pillars[Pillar.COMPAT].status == FAIL:
        return Verdict.REBUILD, ["compatibility failed: " + "; ".join(pillars[Pillar.COMPAT].reasons)] + \
            ([unfinished] if unfinished else []), limits
    resources = pillars[Pillar.RESOURCES]
    if resources.status == FAIL:
        hard = _scale_up_reasons(resources, stage_table, ramp)
        if hard:
            return Verdict.SCALE_UP, hard + ([unfinished] if unfinished else []), limits
    open_items = [f"{name}: {p.status}" + (f" ({p.reasons[0]})" if p.reasons else "")
                  for name, p in pillars.items() if p.status != PASS]
    if resources.status == FAIL:
        layers = _failing_layers(stage_table)
        open_items += [layers] if layers else []
    context = _context_item(pillars)
    open_items += [context] if context else []
    open_items += [unfinished] if unfinished else []
    unproven = not_proven(checklist or [])
    if unproven and not open_items:
        return Verdict.LIMITED, unproven, limits  # every pillar passed on a run that did not prove the whole seed
    open_items += unproven
    if open_items:
        if limits.max_concurrency is not None and resources.status == FAIL:
            above = (f"{limits.ran_out_first} ran out above it" if limits.ran_out_first
                     else "the largest step run; every step held")  # the failure was elsewhere
            open_items.insert(0, f"hold concurrency at {limits.max_concurrency} users ({above})")
        return Verdict.LIMITED, open_items, limits
    return Verdict.GO, ["all four pillars pass"], limits
