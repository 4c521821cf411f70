"""`report.md`: the signable acceptance record in Markdown (the HTML report renders the same sections).

Why Markdown first: it diffs, it pastes into a change ticket, and every claim in it links to the
file that proves it. Dates come from the run, never from when the report was written, so a re-run of
`k3load analyze` gives the same bytes.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from k3load.analysis.decision.ramp import Ramp
from k3load.analysis.outputs import (
    report_capacity,
    report_drain,
    report_reference,
    report_reproducibility,
    report_retry_paths,
    report_reuse,
    report_signers,
    report_soak,
    report_tool_calls,
)
from k3load.analysis.outputs.markdown import fmt, table
from k3load.analysis.pillars.headroom.pillar_resources import SATURATED_CPU_PCT

# The seed's verdict names, each with its romanisation and the id: a reader (or a machine) without a Japanese
# font still reads the verdict (the HTML names a CJK font stack too: analysis/outputs/report_html.py).
LABELS = {"go": "導入可 (dōnyū-ka) — go", "limited": "制限付き観察 (seigen-tsuki kansatsu) — limited",
          "rebuild": "環境再構築 (kankyō saikōchiku) — rebuild", "scale_up": "リソース増強 (risōsu zōkyō) — scale_up"}
STAGE_COLUMNS = ("stage", "kind", "users", "attempts", "error_rate", "requests_per_s", "goodput", "ttft_p95_ms",
                 "ttfa_p95_ms", "itl_p95_ms", "e2e_p95_ms", "kv_usage_max", "waiting_sustained_s", "preemptions",
                 "gpu_memory_peak_mib", "gpu_growth_max_mib")
# A checklist line's mark by its status (analysis/checklist.ItemStatus): ticked, open, not applicable under the
# recipe, or the signer's own line.
TICKS = {"ok": "☑", "open": "☐", "not_applicable": "n/a", "to_sign": "✎ to sign"}
CONTROL_COLUMNS = ("pair", "role", "turn", "status", "prompt_tokens", "cached_tokens", "ttft_ms", "e2e_ms", "valid",
                   "failed_checks")


def header(j: Any) -> dict[str, str]:
    run = j.data.run
    started = run.get("started_ts")
    samples = j.data.path / "samples.sha256"
    return {"run_id": run.get("run_id", "?"), "host": run.get("host", "?"), "model": run.get("model", "?"),
            "plan": run.get("plan", "?"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)) if started else "?",
            "samples": hashlib.sha256(samples.read_bytes()).hexdigest()[:16] if samples.exists() else "missing",
            "judge": (run.get("options") or {}).get("k3_judge") or "",
            "is_sim": bool(((j.data.compat or {}).get("target") or {}).get("is_sim"))}


def _sections(j: Any) -> list[str]:
    h = header(j)
    out = [f"# k3load acceptance record: {LABELS[j.verdict]}\n",
           f"Run `{h['run_id']}` against `{h['host']}` (model `{h['model']}`), plan `{h['plan']}`, {h['date']}.\n"]
    if h["is_sim"]:
        out.append("> **The target is the k3load sim: a rehearsal, never evidence for a production verdict.**\n")
    out.append(f"## Verdict: `{j.verdict}`\n\n**Next action:** {j.verdict_json()['next_action']['action']}\n\n"
               + "".join(f"- {b}\n" for b in j.because))
    out.append(report_capacity.markdown(j.capacity.to_dict()))  # what a planner reads first (then the plots, in HTML)
    lim = j.limits.to_dict()  # one row of plain data, as the table takes it
    out.append("## Limits that hold\n\n" + table([lim], ("max_concurrency", "max_input_tokens",
                                                      "kv_cache_usage_ceiling", "ran_out_first",
                                                      "max_model_len")))
    out.append("## Pillars\n\n" + "".join(f"### {name}: `{p.status}`\n\n" + "".join(f"- {r}\n" for r in p.reasons)
                                        + "\n" for name, p in j.pillars.items()))
    out.append("## Checklist\n\n| ok | item | detail | evidence |\n|---|---|---|---|\n" + "".join(
        f"| {TICKS.get(c.get('status', ''), '☑' if c['ok'] else '☐')} | {fmt(c['item'])} | {_detail(c)} | "
        + ", ".join(_link(e, j.data.path) for e in c["evidence"]) + " |\n" for c in j.checklist))
    cache = j.pillars["prefix_cache"].numbers
    out.append("## Prefix cache: cold vs warm\n\n" + table(cache.get("control") or [], CONTROL_COLUMNS)
               + "\nServer counters over the control window:\n\n"
               + table([cache.get("window") or {}], tuple((cache.get("window") or {"window": None}).keys())))
    out += [_replicas(cache)] if cache.get("replicas") else []  # one replica: no section
    out.append(report_reuse.markdown(cache))
    stages = [s.to_dict() for s in j.stage_table]  # the stage table as plain data, as the table takes it
    out.append("## Stages\n\n" + table(stages, STAGE_COLUMNS)
               + "".join(f"\n- {s['stage']}: " + _breaches(s["problems"]) for s in stages if s["problems"])
               + _generator_cpu(j))
    # a long soak by window ("" otherwise: a shorter run's report is as it was)
    resources = j.pillars["resources"].numbers
    out.append(report_soak.markdown(resources) + _ramp(j) + _crashes(j) + report_drain.markdown(resources)
               + _agent(j) + report_tool_calls.markdown(j.pillars["agent_api"].numbers)
               + report_reference.markdown(j.pillars["agent_api"].numbers)
               + report_reproducibility.markdown(j.pillars["agent_api"].numbers))
    out.append(report_retry_paths.markdown(j.data))  # first tries, retries, fallbacks (the checklist's)
    out.append(f"## Signature\n\n| field | value |\n|---|---|\n| judge | {h['judge'] or '________'} |\n"
               f"| date | {h['date']} |\n| samples used | samples.sha256 (sha256 {h['samples']}…) |\n"
               f"| next action | {fmt(j.verdict_json()['next_action']['action'])} |\n\n"
               + report_signers.marked("signers", report_signers.signers_md([])) + "\n\n"
               "Every evidence file is fixed by `manifest.sha256`; check it with `k3load verify DIR`, and who "
               "signed it with `k3load verify DIR --allowed-signers FILE` (`k3load sign DIR --key KEY` signs).\n")
    return out


def _link(name: str, run_dir: Path) -> str:
    """A link to the evidence file as it is on disk: records and metrics are written compressed
    (`records.jsonl.gz`), while the checklist names the evidence (`records.jsonl`)."""
    if not (run_dir / name).exists() and (run_dir / f"{name}.gz").exists():
        name = f"{name}.gz"
    return f"[{name}]({name})"


REPLICA_COLUMNS = ("source", "requests", "control_requests", "kv_usage_max", "kv_usage_mean", "waiting_max",
                   "hit_share")


def _replicas(cache: dict[str, Any]) -> str:
    """Per replica (one per metrics source, only where there are several): its load over the run and where the
    control pairs went (analysis/pillars/cache/replicas.py)."""
    rows, routing = cache.get("replicas"), cache.get("routing") or {}
    if not rows:
        return ""
    reuse = (routing.get("reuse") or {}).get("all") or {}
    return ("## Replicas\n\n" + table(rows, REPLICA_COLUMNS)
            + f"\nControl pairs whose twins met one replica: {fmt(routing.get('same'))}; another replica: "
            f"{fmt(routing.get('split'))}; not told: {fmt(routing.get('unknown'))} (per-source "
            f"{fmt(routing.get('counters'))}). Warm twins that reused their prefix across the replicas: "
            f"{fmt(reuse.get('warm_reused'))} of {fmt(reuse.get('with_usage'))}.\n")


def _ramp(j: Any) -> str:
    r: Ramp = j.ramp
    if not r.steps:
        return "## Ramp\n\nNo concurrency steps in this plan.\n\n"
    cols = ("stage", "users", "sessions_per_s", "requests_per_s", "output_tokens_per_s", "goodput",
            "goodput_requests_per_s",
            "ttft_p95_ms", "ttfa_p95_ms", "e2e_p95_ms", "error_rate", "waiting_max", "past_capacity", "kv_usage_max",
            "preemptions", "within_limits")
    on_rate = r.largest_step_sessions_per_s is not None
    unit, largest = ("sessions/s", r.largest_step_sessions_per_s) if on_rate else ("users", r.largest_step_users)
    knee = r.knee_sessions_per_s if on_rate else r.knee_users
    if not r.first_step_past_knee:  # every step held: the largest is no knee, only as far as the ramp went
        said = f"No limit reached up to **{fmt(largest)} {unit}**: every step within the limits."
        per = j.capacity.to_dict()["per_replica"]
        if per.get("limit_reached"):  # the limits held, the goodput did not: the capacity plan says where
            said += (f" Goodput fell below {fmt(per.get('min_goodput'))} first: the capacity plan above holds "
                     f"{fmt(per.get('max_sessions_per_s_at_slo' if on_rate else 'max_users_at_slo'))} {unit}.")
    else:
        said = (f"Knee: **{fmt(knee)} {unit}** ({fmt(r.knee_stage)}); ran out first: "
                f"{fmt(r.ran_out_first)} ({fmt(r.first_step_past_knee)}).")
    return f"## Ramp\n\n{said}\n\n" + table(list(r.steps), cols) + "\n"


def _generator_cpu(j: Any) -> str:
    """Each load-generator process's highest CPU per stage (the master or local process, each worker): a
    saturated one measured its own delay along with the server's."""
    rows = [{"stage": s.stage, **s.load_generator_cpu_max_pct_by_process} for s in j.stage_table]
    processes = sorted({k for row in rows for k in row if k != "stage"}, key=lambda k: (k.startswith("worker"), k))
    if not processes:
        return ""
    hot = j.pillars["resources"].numbers.get("load_generator_saturated") or []
    said = (f"\n**The load generator was saturated** (CPU >= {SATURATED_CPU_PCT:.0f}% of a core) in "
            + "; ".join(f"{h['stage']} (" + ", ".join(f"{k} {v:.0f}%" for k, v in sorted(h["processes"].items()))
                        + ")" for h in hot)
            + ": the latencies measured there are the client's as much as the server's.\n") if hot else ""
    waits = [{"stage": s.stage, **(s.load_generator_cpu_wait_pct_by_process or {})} for s in j.stage_table]
    waiting = sorted({k for row in waits for k in row if k != "stage"}, key=lambda k: (k.startswith("worker"), k))
    waited = ("\n\nWaiting for a CPU (% of each stage's wall time the process was ready to run and got none: a "
              "host short of CPU starves the load generator without saturating it, and its latencies hold the "
              "wait):\n\n" + table(waits, ("stage", *waiting))) if waiting else ""
    return ("\n\n### Load generator CPU (highest % of one core per stage and process)\n\n"
            + table(rows, ("stage", *processes)) + said + waited)


def _crashes(j: Any) -> str:
    crashes = j.pillars["resources"].numbers.get("crashes", [])
    if not crashes:
        return "## Crashes and OOM\n\nNone.\n\n"
    rows = [{"stage": c["stage"], "phase": c["phase"], "oom": c["oom"], **c["conditions"],
             "restart": c["restart"]["detail"]} for c in crashes]
    return "## Crashes and OOM\n\n" + table(rows, tuple(rows[0].keys())) + "\n"


def _agent(j: Any) -> str:
    n = j.pillars["agent_api"].numbers
    layers = n.get("failed_by_layer") or {}
    rates = n.get("check_failure_rates") or {}
    checks = [{"check": k, "failures": v, "rate_ci95": _ci((rates.get(k) or {}).get("ci95"))}
              for k, v in (n.get("failed_by_check") or {}).items()]
    checks += [{"check": k, "failures": f"{v} (secondary)", "rate_ci95": None}
               for k, v in (n.get("secondary_failures_by_check") or {}).items()]
    return ("## Agent API\n\nRates with 95% Wilson intervals; each failed attempt counted once, under its primary "
            "layer.\n\n" + table([{"attempts": n.get("attempts"), "valid_rate": n.get("valid_rate"),
                                   "valid_ci95": _ci(n.get("valid_rate_ci95")),
                                   "tool_call_schema_accuracy": n.get("tool_call_schema_accuracy"),
                                   "schema_ci95": _ci(n.get("tool_call_schema_accuracy_ci95")), **layers}],
                                  ("attempts", "valid_rate", "valid_ci95", "tool_call_schema_accuracy", "schema_ci95",
                                   *layers.keys()))
            + "\n" + table(checks, ("check", "failures")) + "\n")


def _breaches(problems: list[dict[str, Any]]) -> str:
    return "; ".join(f"{p['reason']} (`{p['id']}`, {p['signal']})" for p in problems)


def _ci(bounds: list[float] | None) -> str | None:
    return f"{bounds[0]:.1%}-{bounds[1]:.1%}" if bounds else None


def _detail(item: dict[str, Any]) -> str:
    """A checklist line's detail; the signer's own line in its region (k3load sign fills in who signed)."""
    if item.get("signer_line"):
        return report_signers.marked("judge", report_signers.judge_md([], item.get("judge") or ""))
    return fmt(item["detail"])


def render(judgment: Any) -> str:
    return "\n".join(_sections(judgment))


def render_parts(judgment: Any) -> tuple[str, str]:
    """The record up to its capacity plan, and the rest: the HTML report puts the plots between them."""
    sections = _sections(judgment)
    cut = next((i + 1 for i, s in enumerate(sections) if s.startswith("## Capacity plan")), len(sections))
    return "\n".join(sections[:cut]), "\n".join(sections[cut:])

