"""The rules read from the server's startup log, per node: its warnings (startup_log) and the server
options in effect (serve_flags, with /metrics).

Why per node: a multi-node K3 logs one startup per node, and an NCCL warning on one node is that
node's broken communication stack; each log is judged alone and a reason names its node. A single
bare --startup-log is judged as before, word for word (its reason names no node).
"""

from __future__ import annotations

from typing import Any

from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.precheck.evidence import Evidence
from k3load.precheck.node_evidence import NodeFacts, missing_nodes, startups
from k3load.precheck.node_rules import not_given
from k3load.precheck.recipe import Recipe
from k3load.precheck.rule_base import files_of, option, result
from k3load.precheck.server_rules import metrics_gap
from k3load.precheck.startup_log import cuda_init_problems, quote
from k3load.sampler.vllm_metrics import VllmMetric


def _same(value: Any, required: Any) -> bool:
    return str(value).strip().lower() == str(required).strip().lower()


def _flag_value(flag: str, ev: Evidence, log: NodeFacts | None) -> tuple[Any, str] | None:
    """(value, where) of one server option on one node; None when no evidence can tell."""
    cache = (ev.server or {}).get("cache_config") or {}
    if flag == "enable_prefix_caching" and "enable_prefix_caching" in cache:
        return cache["enable_prefix_caching"], VllmMetric.CACHE_CONFIG_INFO.value
    args = (log.facts if log else {}).get("args") or {}
    at = f", {log.where}" if log and log.node else ""
    if flag in args:
        return args[flag], f"startup log non-default args{at}"
    if args and flag != "enable_prefix_caching":  # absent from non-default args: vLLM's default (off/None)
        return None, f"not among the startup log's non-default args{at}"
    return None


def serve_flags(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """The recipe's server options are in effect on every node: read from what the server reports, not from
    a launch script."""
    required = recipe.section("serve")["required"]
    logs: list[NodeFacts | None] = list(startups(ev)) or [None]
    files = files_of(ev, "server_metrics") + [log.file for log in logs if log]
    wrong: dict[str, None] = {}
    unknown: dict[str, None] = {}
    good = []
    for flag, want in required.items():
        seen = [_flag_value(flag, ev, log) for log in logs]
        for value in seen:
            if value is not None and not _same(value[0], want):
                wrong[f"{flag} {'not set' if value[0] is None else f'is {value[0]}'} ({value[1]}), needs {want}"] = None
        if any(value is None for value in seen):
            unknown[flag] = None
        elif all(_same(value[0], want) for value in seen if value is not None):
            good.append(f"{flag}={want}")
    if wrong:
        return result("serve_flags", FAIL, "; ".join(wrong), files)
    if unknown:
        gap = metrics_gap(ev) if ev.server is not None else None
        return result("serve_flags", INCONCLUSIVE, (f"inconclusive, because {gap}; " if gap else "")
                      + "not readable from /metrics or a startup log: "
                      f"{', '.join(unknown)}" + (f" (confirmed: {', '.join(good)})" if good else ""), files)
    return result("serve_flags", PASS, ", ".join(good), files)


def _judge_log(recipe: Recipe, log: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(status, reason, details) of one node's startup log."""
    details = {"flagged": log["flagged"], "other_warnings": log["other_warnings"]}
    fails, gaps = cuda_init_problems(log) if recipe.platform == "cuda" else ([], [])
    if log["flagged"]:
        fails.insert(0, f"{len(log['flagged'])} NCCL/communication/kernel warning(s): {quote(log['flagged'])}")
    if fails:
        return FAIL, "; ".join(fails), details
    notes = sorted({w["notice"] for w in log["other_warnings"] if w.get("notice")})
    noted = f"; noted, not judged: {'; '.join(notes)}" if notes else ""
    if gaps:
        return INCONCLUSIVE, "; ".join(gaps) + noted, details
    seen = [f"{k} {(log[k] or {}).get('value')}" for k in ("device", "comm_backend", "nccl_version") if log[k]]
    other = f"; {len(log['other_warnings'])} other warning(s), not about compatibility" if log["other_warnings"] else ""
    return PASS, (f"no NCCL, communication or kernel warnings in {log['lines']} lines"
                  f"{'; ' + ', '.join(seen) if seen else ''}{other}{noted}"), details


def startup_log(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """No NCCL, communication or kernel warnings; on CUDA, initialisation, NCCL and kernels seen, on every
    node that gave its log. Known configuration notices (--enforce-eager and the like, startup_log.NOTICES)
    are named, not judged. An inventoried node without its log, while others have theirs, is named."""
    given = startups(ev)
    if not given:
        return result("startup_log", INCONCLUSIVE, f"no startup log saved ({option('startup-log')}): CUDA "
                      "initialisation, communication backend and kernel loading not checked")
    files = [log.file for log in given]
    judged = [(log, *_judge_log(recipe, log.facts)) for log in given]
    if len(judged) == 1 and judged[0][0].node is None:  # the single-node form, as it always read
        _, status, reason, details = judged[0]
        return result("startup_log", status, reason, files, **details)
    missing = missing_nodes(ev, given)
    statuses = {status for _, status, _, _ in judged}
    status = FAIL if FAIL in statuses else INCONCLUSIVE if (missing or INCONCLUSIVE in statuses) else PASS
    shown = [f"{log.where}: {reason}" for log, s, reason, _ in judged if status != FAIL or s == FAIL]
    lead = [not_given(missing, "startup log", "startup-log")] if missing else []
    nodes = {str(log.node): details for log, _, _, details in judged}
    return result("startup_log", status, "; ".join(lead + shown), files, nodes=nodes)
