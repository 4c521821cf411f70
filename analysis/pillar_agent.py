"""Pillar 4, agent API correctness: rates per check and layer over every attempt of the run.

Why rates and minimum counts: one successful demo is not evidence; the recipe itself warns that K3
sometimes emits a tool-call format its parser does not expect, so the judgment is how often, where
(which layer) and whether retries recovered. Timeout-drill attempts are judged on their own: their
timeout is the point of the drill, the retry after it must succeed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from k3load.analysis.pillar import FAIL, INCONCLUSIVE, NOT_RUN, PASS, PillarResult
from k3load.records import LAYERS, Attempt


def _rates(attempts: list[Attempt]) -> dict[str, Any]:
    layers = Counter(layer for a in attempts for layer in a.failed_layers)
    checks = Counter(f.check for a in attempts for f in a.findings if not f.ok)
    tool_responses = [a for a in attempts if a.tool_calls or a.finish_reason == "tool_calls"]
    schema_ok = [a for a in tool_responses if not any(
        not f.ok and f.check.startswith("tool_call.") for f in a.findings)]
    return {
        "attempts": len(attempts), "valid": sum(a.valid for a in attempts),
        "valid_rate": sum(a.valid for a in attempts) / len(attempts) if attempts else None,
        "failed_by_layer": {layer: layers.get(layer, 0) for layer in LAYERS},
        "failed_by_check": dict(sorted(checks.items())),
        "tool_call_responses": len(tool_responses),
        "tool_call_schema_accuracy": len(schema_ok) / len(tool_responses) if tool_responses else None,
    }


def _chains(attempts: list[Attempt]) -> dict[str, Any]:
    by_chain: dict[str, list[Attempt]] = {}
    for attempt in attempts:
        by_chain.setdefault(attempt.chain_id, []).append(attempt)
    finals = [sorted(chain, key=lambda a: a.attempt)[-1] for chain in by_chain.values()]
    retried = [c for c in by_chain.values() if len(c) > 1]
    recovered = [c for c in retried if sorted(c, key=lambda a: a.attempt)[-1].valid]
    return {"requests": len(finals), "requests_valid": sum(a.valid for a in finals),
            "retried_requests": len(retried), "recovered_by_retry": len(recovered),
            "duplicate_attempts": sum(len(c) - 1 for c in retried)}


def _drill(attempts: list[Attempt]) -> tuple[dict[str, Any], list[str]]:
    """Chains whose deliberately short first deadline expired must be answered on retry. A drill
    answered within its deadline proves nothing either way (not a failure); a chain the run's end cut
    before its retry is left out."""
    drills = [a for a in attempts if a.drill]
    timed_out = {a.chain_id for a in drills if a.status == "timeout"}
    finals: dict[str, Attempt] = {}
    for attempt in attempts:
        if attempt.chain_id in timed_out and attempt.attempt > getattr(finals.get(attempt.chain_id), "attempt", 0):
            finals[attempt.chain_id] = attempt
    judged = [a for a in finals.values() if not a.will_retry]
    recovered = sum(1 for a in judged if a.attempt > 1 and a.status == "ok")
    numbers = {"drills": len(drills), "timed_out": len(timed_out), "judged": len(judged), "recovered": recovered}
    if recovered < len(judged):
        return numbers, [f"timeout drill: only {recovered} of {len(judged)} timed-out requests were answered on "
                         "retry"]
    return numbers, []


def judge_agent_api(attempts: list[Attempt], limits: dict[str, float]) -> PillarResult:
    if not attempts:
        return PillarResult(NOT_RUN, ["no request was recorded"])
    judged = [a for a in attempts if not a.drill]
    numbers = _rates(judged) | {"requests": _chains(judged)}
    drill, drill_reasons = _drill(attempts)
    numbers["timeout_drill"] = drill
    if len(judged) < limits["min_attempts"]:
        return PillarResult(INCONCLUSIVE, [f"only {len(judged)} attempts (at least {int(limits['min_attempts'])} "
                                           "are needed: one success is not evidence)"], numbers)
    reasons = []
    rate = numbers["valid_rate"]
    if rate < limits["min_valid_rate"]:
        worst = sorted(((n, c) for c, n in numbers["failed_by_check"].items()), reverse=True)[:4]
        layers = ", ".join(f"{k} {v}" for k, v in numbers["failed_by_layer"].items() if v)
        reasons.append(f"{rate:.1%} of {len(judged)} attempts valid, below {limits['min_valid_rate']:.0%} "
                       f"(failures by layer: {layers}; most frequent checks: "
                       + ", ".join(f"{c} x{n}" for n, c in worst) + ")")
    reasons += drill_reasons
    if reasons:
        return PillarResult(FAIL, reasons, numbers)
    return PillarResult(PASS, [f"{rate:.1%} of {len(judged)} attempts valid (tool calls, structured output, "
                               "reasoning/content separation, expectations)"], numbers)
