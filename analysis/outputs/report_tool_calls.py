"""The report's section on Kimi's known tool-calling failures: parallel calls, streaming equivalence
per concurrency level, tool-call cadence, answers left in the reasoning.

Why its own section: these are the failures an operator meets only under load and only when
streaming (vllm#54701, #50604, #53246, #24478); the valid rate above says how often something failed,
this says which of the known ways it failed, at which concurrency, with intervals.
"""

from __future__ import annotations

from typing import Any

from k3load.analysis.outputs.markdown import fmt, table
from k3load.workload.stream_equivalence import OUTCOMES

EQUIVALENCE_COLUMNS = ("stage", "users", "compared", "same", "differ, both valid", "streaming path wrong",
                       "rate_ci95", "not compared")


def _ci(rate: dict[str, Any] | None) -> str | None:
    if not rate or not rate.get("n"):
        return None
    low, high = rate["ci95"]
    distinct = rate.get("distinct_requests")  # the interval is over these (analysis/run/clusters.py)
    return f"{rate['rate']:.1%} ({low:.1%}-{high:.1%}" + (f", {distinct} distinct requests)" if distinct is not None
                                                          else ")")


def _parallel(n: dict[str, Any]) -> str:
    if not n.get("answers"):
        return "### Parallel calls\n\nNo turn expecting several calls in one answer (`expect.calls`) was played.\n\n"
    row = {"answers": n["answers"], "exact": n["exact"], "exact_ci95": _ci(n["exact_rate"]),
           "calls per answer": ", ".join(f"{k}: {v}" for k, v in n["calls_per_answer"].items()),
           "failed checks": ", ".join(f"{k} x{v}" for k, v in n["failed_checks"].items()) or "none",
           "primary layer": ", ".join(f"{k} {v}" for k, v in n["by_primary_layer"].items()) or "none"}
    return ("### Parallel calls\n\nAnswers to turns that expect several calls (`expect.calls`, any order), with what "
            "went wrong in the others: a call short, arguments merged (`tool_call.arguments_json`), a call emitted "
            "twice (`tool_call.unique_ids`).\n\n" + table([row], tuple(row)) + "\n")


def _equivalence(n: dict[str, Any]) -> str:
    head = "### Streaming equivalence\n\n"
    if not n.get("drill"):
        return head + "Not tested: the plan has no `stream_equivalence` drill.\n\n"
    if not n.get("pairs"):
        return head + "The drill was asked for but compared no pair (no eligible turn was played).\n\n"
    rows = [{"stage": stage, **row, "rate_ci95": _ci(row["stream_path_failure_rate"])}
            for stage, row in n["by_stage"].items()]
    other = [o for o in OUTCOMES if o not in EQUIVALENCE_COLUMNS and n["outcomes"].get(o)]
    note = "".join(f"- {o}: {n['outcomes'][o]}\n" for o in other)
    return (head + f"Chosen turns ({fmt(n['drill']['turns'])}, share {n['drill']['share']}) sent streamed and whole "
            "at once, at temperature 0, under each stage's concurrency. *Streaming path wrong*: the streamed answer "
            "failed where its non-streamed twin passed, differing as a parser makes them differ (the parser's, "
            "vllm#54701); *differ, both valid*: batched kernels at temperature 0 are not bit-exact, not a "
            f"failure. In all: {_ci(n['stream_path_failure_rate'])} of {n['compared']} compared.\n\n"
            + table(rows, EQUIVALENCE_COLUMNS) + ("\n" + note if note else "") + "\n")


def _cadence(n: dict[str, Any]) -> str:
    head = "### Tool-call cadence\n\n"
    if not n.get("streamed_tool_calls") and not n.get("stalls"):
        return head + "No streamed tool call was recorded.\n\n"
    rows = [{"measure": name, **n[key]} for name, key in (("first tool delta to arguments' end (ms)", "span_ms"),
                                                          ("longest silence inside the call (ms)", "max_gap_ms"),
                                                          ("deltas per call", "deltas"))]
    return (head + f"Streamed answers with a tool call: {n['streamed_tool_calls']}; silences past the limit of "
            f"{fmt(n['limit_ms'])} ms: {n['over_limit']}; stalls cut by our deadline: {n['stalls']} "
            f"({_ci(n['over_limit_rate']) or '–'}). A call that arrives in one delta after a long silence is held back "
            "by the parser (vllm#50604), not decoded slowly.\n\n" + table(rows, ("measure", "n", "p50", "p95", "max"))
            + "\n")


def _transition(n: dict[str, Any]) -> str:
    if not n.get("answers"):
        return ""
    layers = ", ".join(f"{k} {v}" for k, v in n["by_layer"].items())
    return ("### Answers left in the reasoning\n\n"
            f"{n['answers']} answers had reasoning but neither content nor calls ({layers}): with the call's markup "
            "inside the reasoning, the model omitted the think-to-answer transition and the parser kept it all "
            "(vllm#53246); without it, the model said nothing.\n\n")


def markdown(numbers: dict[str, Any]) -> str:
    """The section, from the agent pillar's numbers (empty parts say why they are empty)."""
    return ("## Tool calls: Kimi's known failures\n\n" + _parallel(numbers.get("parallel_calls") or {})
            + _equivalence(numbers.get("stream_equivalence") or {}) + _cadence(numbers.get("tool_call_cadence") or {})
            + _transition(numbers.get("no_transition") or {}))
