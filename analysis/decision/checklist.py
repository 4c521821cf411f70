"""The spec's signed-record checklist, each item ticked only from evidence in the run directory.

Why "only from evidence": a reviewer signs the record, so an item is `ok` only when the file that
proves it is there and says so; anything else is unticked with the reason (`missing` when the file is
absent). Each line has a `status` (`ItemStatus`): `ok`, `open` (not proven: the verdict is then never
`go`, analysis/verdict.py reads these lines and nothing else for it), `not_applicable` (the recipe says
the line does not apply: the local-dev recipe's CUDA, driver and GPU lines, said as such, not as
failures) or `to_sign` (the signer's own line: the judge's name, filled in when the record is signed).
Why the verdict reads the checklist: the seed's 導入可 is "all four indicators pass, with reproducible
logs", and its signed checklist asks for the logs of model load, long input, concurrency and continuous
operation; a `go` beside an open line would contradict the record it is signed on.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from k3load.analysis.pillars.agent.retry_paths import checklist_line, path_counts
from k3load.analysis.pillars.pillar import PillarResult
from k3load.analysis.run.rundata import RunData, StageWindow
from k3load.events import Event
from k3load.outcomes import NOT_APPLICABLE, PASS
from k3load.workload.stage_kind import StageKind


class ItemStatus(StrEnum):
    OK = "ok"
    OPEN = "open"
    NOT_APPLICABLE = "not_applicable"
    TO_SIGN = "to_sign"


# The stage kinds the seed's checklist asks logs of, and what a run without one did not prove.
REQUIRED_KINDS = {StageKind.LOAD: "representative load", StageKind.LONG_INPUT: "long input",
                  StageKind.CONCURRENCY: "a concurrency ramp", StageKind.SOAK: "continuous operation"}


def _rules(data: RunData, *ids: str) -> list[dict[str, Any]]:
    return [r for r in (data.compat or {}).get("rules", []) if r.get("id") in ids]


def _item(item: str, ok: bool, detail: str, evidence: list[str], status: ItemStatus | None = None
          ) -> dict[str, Any]:
    status = status or (ItemStatus.OK if ok else ItemStatus.OPEN)
    return {"item": item, "ok": ok, "status": status.value, "detail": detail, "evidence": sorted(set(evidence))}


def open_items(checklist: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines that keep a run from `go` (older checklists without `status`: every unticked line)."""
    return [i for i in checklist if i.get("status", "ok" if i.get("ok") else "open") == ItemStatus.OPEN.value]


def _rule_item(data: RunData, item: str, ids: tuple[str, ...]) -> dict[str, Any]:
    rules = _rules(data, *ids)
    if not rules:
        return _item(item, False, "missing: no precheck evidence", [])
    evidence = ["compat.json", *(f"evidence/{e}" for r in rules for e in r.get("evidence", []))]
    statuses = {r["id"]: r["status"] for r in rules}
    said = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
    if all(s == NOT_APPLICABLE for s in statuses.values()):
        recipe = ((data.compat or {}).get("recipe") or {}).get("name", "?")
        return _item(item, False, f"not applicable under recipe {recipe}: {said}", evidence, ItemStatus.NOT_APPLICABLE)
    ok = all(s in (PASS, NOT_APPLICABLE) for s in statuses.values()) and PASS in statuses.values()
    return _item(item, ok, said, evidence)


def node_item(data: RunData) -> dict[str, Any]:
    """The node line covers every node: each inventoried node (and each named in the per-node evidence) with
    its driver, container tag and which of its own collect-env / startup log were given; a node without
    what the others have keeps node_consistency inconclusive, so the line open. An older compat.json
    (no per-node table) reads as it always did."""
    item = _rule_item(data, "Every node's GPU model, count and topology",
                      ("gpu_count", "gpu_model", "node_consistency"))
    nodes = next((r.get("details", {}).get("nodes") for r in _rules(data, "node_consistency")), None)
    if not nodes:
        return item
    kinds = [(key, said) for key, said in (("collect_env", "collect-env"), ("startup_log", "startup log"))
             if any(n.get(key) for n in nodes.values())]
    listed = ", ".join(f"{name} ({', '.join(_node_facts(facts, kinds))})" for name, facts in nodes.items())
    return {**item, "detail": f"{item['detail']}; {len(nodes)} node(s): {listed}"}


def _node_facts(facts: dict[str, Any], kinds: list[tuple[str, str]]) -> list[str]:
    said = [f"driver {facts.get('driver') or 'not recorded'}", facts.get("image") or "container tag not recorded"]
    return said + [what if facts.get(key) else f"no {what}" for key, what in kinds]


def _stage_logs(data: RunData) -> dict[str, Any]:
    """A capacity search is a concurrency ramp whose steps the evidence chose: it stands for one."""
    def kind(stage: StageWindow) -> str:
        return StageKind.CONCURRENCY if stage.kind == StageKind.SEARCH else stage.kind

    kinds = {kind(s) for s in data.stages}
    needed = set(REQUIRED_KINDS)
    ran = set(data.columns.rows().seen("stage"))
    present = {kind(s) for s in data.stages if s.name in ran}
    ok = needed <= present and bool(data.metrics)
    missing = [k for k in REQUIRED_KINDS if k not in present]
    said = [f"no {k} stage {'ran' if k not in kinds else 'recorded a request'}: {REQUIRED_KINDS[k]} not proven"
            for k in missing]
    detail = "records and server metrics for every stage kind" if ok else \
        "; ".join(said + ([] if data.metrics else ["no server metrics recorded"]))
    return _item("Logs of load, long input, concurrency and soak", ok and needed <= kinds, detail,
                 ["records.jsonl", "metrics.jsonl", "events.jsonl"])


def _families(data: RunData) -> dict[str, Any]:
    """Every family the plan's stages mixed in sent at least one request: a family that never ran (a worker
    lost, a scenario file missing where a worker started, a long input that fits no server) left its part of
    the seed unproven, however well the rest did."""
    planned: dict[str, list[str]] = {}
    for stage in (data.plan.stages if data.plan else ()):
        for family, weight in stage.mix.items():
            if weight > 0:
                planned.setdefault(family, []).append(stage.name)
    ran = set(data.columns.rows().seen("family"))
    missing = [f"family {family} (planned in {', '.join(stages)}) never ran: no attempt recorded"
               for family, stages in sorted(planned.items()) if family not in ran]
    detail = "; ".join(missing) if missing else f"{len(planned)} planned families ran: {', '.join(sorted(planned))}"
    return _item("Every family of the plan's mix ran", not missing, detail, ["plan.yaml", "records.jsonl"])


def _workers(data: RunData) -> dict[str, Any]:
    """Every load generator stayed: a worker the master lost mid-run (`worker_lost`) took its users' load with
    it, so the stages after it ran on part of the plan's load."""
    lost = data.events_named(Event.WORKER_LOST)
    item, evidence = "Every load generator stayed to the end", ["events.jsonl"]
    if not lost:
        counts = {w for e in data.events_named(Event.STAGE_START) if (w := e.get("workers")) is not None}
        said = f"workers per stage: {', '.join(str(c) for c in sorted(counts))}" if counts else "one process"
        return _item(item, True, said, evidence)
    told = "; ".join(f"in stage {e.get('stage')}: {e.get('workers_now')} of {e.get('workers_before')} workers left"
                     for e in lost)
    return _item(item, False, f"a worker was lost ({told}): the load after it was part of the plan's", evidence)


def _restart(pillars: dict[str, PillarResult]) -> dict[str, Any]:
    """The seed's restart check: the server restarted under load (the plan's restart stage with
    --k3-restart-cmd) came back and held the same load (analysis/pillars/headroom/restart_audit.py); or, after a
    crash, the crash
    stage's load re-applied once it was back held (analysis/pillars/headroom/recovery.py: every crash's same
    conditions held).
    A crash that recurred under its same conditions leaves the line open whatever the drill said."""
    numbers = pillars["resources"].numbers
    drill = numbers.get("restart_drill") or {}
    status, why = drill.get("status"), drill.get("why") or ""
    item, evidence = "Restart check (back and serving the same load)", ["events.jsonl", "records.jsonl"]
    same = [(c.get("restart") or {}).get("same_conditions") or {} for c in numbers.get("crashes") or []
            if c.get("recurrence_of") is None]
    recurred = [s["why"] for s in same if s.get("recurred")]
    if recurred:
        return _item(item, False, f"restart not proven: the crash recurred under the same load ({recurred[0]})",
                     [*evidence, "verdict.json crashes[].restart.same_conditions"])
    if status == PASS:
        return _item(item, True, why or "the restart drill passed", evidence)
    if same and all(s.get("status") == "held" for s in same):
        return _item(item, True, f"after {len(same)} crash(es) the server came back and held the crash stage's "
                     f"load: {same[0]['why']}", [*evidence, "verdict.json crashes[].restart.same_conditions"])
    return _item(item, False, f"restart not proven: the restart drill {why or (status or 'not_run')}", evidence)


def _gpu_curves(data: RunData, crashes: list[dict[str, Any]]) -> dict[str, Any]:
    """GPU memory curves around any OOM: not applicable on a CPU recipe's server (no GPU to read)."""
    platform = ((data.compat or {}).get("recipe") or {}).get("platform")
    item = "GPU memory curves tied to request conditions around any OOM"
    evidence = ["gpu.jsonl", "events.jsonl", "records.jsonl"]
    if data.gpu.empty and platform == "cpu":
        return _item(item, False, f"not applicable: the recipe's platform is cpu; {len(crashes)} crash(es)", evidence,
                     ItemStatus.NOT_APPLICABLE)
    ok = (bool(crashes) and all(c["memory_curve"] for c in crashes)) or (not crashes and not data.gpu.empty)
    return _item(item, ok, f"{len(crashes)} crash(es)" + ("" if not data.gpu.empty else "; no GPU telemetry"),
                 evidence)


def _spells(data: RunData) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The `metrics_missing` events of spells still open at the run's end (no `metrics_back` from that
    source after them) and of spells that ended. Why apart: a restarted engine serves /metrics without
    its gauges for a moment and the sampler says so; monitoring is impossible only where the gauges
    never came back."""
    last: dict[Any, dict[str, Any] | None] = {}
    ended: list[dict[str, Any]] = []
    for event in data.events_named(Event.METRICS_MISSING, Event.METRICS_BACK):
        source, opened = event.get("source"), last.get(event.get("source"))
        if event.get("event") == Event.METRICS_MISSING:
            last[source] = event
        elif opened is not None:
            ended.append(opened)
            last[source] = None
    return [e for e in last.values() if e is not None], ended


def _monitoring(data: RunData) -> dict[str, Any]:
    """Going live needs the engine's own metrics (spec, "After go-live"): a /metrics the harness could
    not read, or one whose engine gauges were still absent at the run's end, means monitoring is not
    possible as deployed."""
    good = [m for m in data.metrics if m.get("ok") and m.get("vllm_series")]
    failed = [m for m in data.metrics if not m.get("ok")]
    still_missing, ended = _spells(data)
    if good and not still_missing:
        detail = f"{len(good)} scrapes with the engine's series from {len({m.get('source') for m in good})} source(s)"
        if ended:
            detail += (f"; the engine's series were absent {len(ended)} time(s) and came back (last: "
                       f"{ended[-1].get('reason')})")
        return _item("Server metrics for monitoring (/metrics)", True, detail, ["metrics.jsonl", "events.jsonl"]
                     if ended else ["metrics.jsonl"])
    why = (still_missing[-1].get("reason") if still_missing else failed[-1].get("error") if failed
           else "no scrape")
    return _item("Server metrics for monitoring (/metrics)", False,
                 f"monitoring is not possible as deployed: {why} ({len(failed)} failed scrapes; point "
                 "--k3-metrics-url or --k3-prometheus-url at where the engine's metrics are)",
                 ["metrics.jsonl", "events.jsonl"])


def build_checklist(data: RunData, pillars: dict[str, PillarResult]) -> list[dict[str, Any]]:
    cache = pillars["prefix_cache"].numbers
    window = cache.get("window") or {}
    agent = pillars["agent_api"].numbers
    crashes = pillars["resources"].numbers.get("crashes", [])
    drill = agent.get("timeout_drill") or {}
    judge = (data.run.get("options") or {}).get("k3_judge") or ""
    items = [
        _item("Container tag, vLLM version and model id", bool(data.compat and data.run.get("model")),
              f"model {data.run.get('model')!r}", ["run.json", "compat.json"]),
        _rule_item(data, "CUDA 13 container build vs R580+ host driver", ("cuda_build", "driver_branch")),
        node_item(data),
        _rule_item(data, "Clean startup log (communication, kernels, NCCL)", ("startup_log",)),
        _stage_logs(data),
        _families(data),
        _workers(data),
        _monitoring(data),
        _gpu_curves(data, crashes),
        _restart(pillars),
        _item("Cold vs warm prefix-cache comparison", len(cache.get("control") or []) >= 2,
              f"{len(cache.get('control') or [])} control requests", ["records.jsonl", "metrics.jsonl"]),
        _item("prefix_cache_queries, prefix_cache_hits, prompt_tokens_cached",
              all(window.get(k) is not None for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                        "prompt_tokens_cached")),
              ", ".join(f"{k} {window.get(k)}" for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                          "prompt_tokens_cached")), ["metrics.jsonl"]),
        _item("Schema validation of tool calls, reasoning, content and structured output",
              bool(agent.get("attempts")), f"{agent.get('attempts', 0)} attempts validated", ["records.jsonl"]),
        _item("Retry and API fallback behaviour", *checklist_line(path_counts(data), drill),
              ["records.jsonl"]),
        _item("Judge, date, samples used and next action", bool(judge),
              f"judge {judge!r}" if judge else "judge to be filled in before signing",
              ["run.json", "samples.sha256", "verdict.json"], None if judge else ItemStatus.TO_SIGN)
        | {"signer_line": True, "judge": judge},  # the reports add who signed (analysis/outputs/report_signers.py)
    ]
    return items
