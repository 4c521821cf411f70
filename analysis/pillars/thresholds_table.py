"""Every threshold a plan may set, declared once: from this table come the analysis's defaults
(analysis/pillars/pillar.py DEFAULT_THRESHOLDS) and the `thresholds` part of k3load/schemas/plan.schema.json.

Why generated: a default changed in the code but not in the schema (or the docs) is a plan the harness accepts
and then judges by another number than the one written. The schema's part is rendered from here and a test
fails when the committed file differs (`.venv/bin/python -m k3load.analysis.pillars.rule_docs --write`
regenerates it, with the docs' rules table). A simple limit rule's threshold is declared with its rule
(analysis/pillars/limit_rules.py) and takes its place here.
"""

from __future__ import annotations

from typing import Any

from k3load.analysis.pillars.limit_rules import LIMIT_RULES
from k3load.analysis.pillars.threshold import Bound, Threshold


def _limits(section: str) -> tuple[Threshold, ...]:
    return tuple(rule.threshold for rule in LIMIT_RULES if rule.section == section)


# Section by section, in the order the defaults and the schema list them.
THRESHOLDS: tuple[Threshold, ...] = (
    # agent_api
    Threshold("agent_api", "min_attempts", 20, Bound.COUNT, "count",
              "Fewer attempts: inconclusive (one success is not evidence)."),
    Threshold("agent_api", "min_valid_rate", 0.95, Bound.SHARE, "share",
              "Share of attempts that must pass every check."),
    Threshold("agent_api", "max_tool_call_gap_ms", 30000.0, Bound.POSITIVE, "ms",
              "The longest silence allowed inside a streamed tool call (the silence leading into its first delta "
              "included): longer is a finding on the attempt (a parser holding the arguments back, vllm#50604), and "
              "a timeout after such a silence is a stall, not our deadline."),
    Threshold("agent_api", "min_stream_pairs", 10, Bound.COUNT, "count",
              "Fewer streamed/whole pairs compared by the streaming-equivalence drill, none of them failing: "
              "inconclusive."),
    Threshold("agent_api", "min_reference_attempts", 20, Bound.COUNT, "count",
              "With --k3-reference (or `k3load analyze --reference`): fewer answers comparable with the reference "
              "run (same scenario and turn, the reference's majority behaviour decided) leave the reference rules "
              "inconclusive."),
    Threshold("agent_api", "min_reference_trigger_f1", 0.9, Bound.SHARE, "share",
              "Tool-call trigger F1 against the reference run (did the model call a tool where the reference did, "
              "per scenario and turn): the interval's upper bound below it fails the pillar (model_output), its "
              "lower bound at or above it passes."),
    Threshold("agent_api", "max_reference_schema_accuracy_drop", 0.05, Bound.SHARE, "share",
              "How far the tool-call argument schema accuracy may fall below the reference run's (Newcombe interval "
              "of the difference): a drop surely above it fails the pillar, one surely within it passes."),
    Threshold("agent_api", "min_reproducible_share", 0.99, Bound.SHARE, "share",
              "Reproducibility (issue 33): of the requests sent more than once at temperature 0 or with a fixed "
              "seed, the share whose repeats agree (the tools called, their arguments as canonical JSON, the "
              "structured output); the interval's upper bound under it fails the agent pillar with "
              "\"non-reproducible tool calls\", the seed's rollback condition. Default 0.99: an agent acts on its "
              "tool call, so one request in a hundred answering otherwise under load is already an agent that "
              "behaves differently in production than in the acceptance run."),
    # slo
    *_limits("slo"),
    Threshold("slo", "max_error_rate", 0.02, Bound.SHARE, "share",
              "Transport/HTTP failures per attempt."),
    # resources
    *_limits("resources"),
    Threshold("resources", "min_gpu_headroom_pct", 5.0, Bound.PERCENT, "%",
              "Free GPU memory, as a share of the card, below which the load may not take it. A card that vLLM "
              "reserved below this at start-up (--gpu-memory-utilization) is not judged by it: a reservation is "
              "never pressure; max_gpu_growth_pct judges what the load added."),
    Threshold("resources", "max_gpu_growth_pct", 50.0, Bound.NON_NEGATIVE, "%",
              "Most a GPU's memory may grow over its start-up baseline (vLLM's reservation, read before the first "
              "request), as a share of the memory that was free then."),
    Threshold("resources", "min_gpu_runway_h", 24.0, Bound.NON_NEGATIVE, "h",
              "A GPU memory creep measured through the soak, projected: the free memory must last at least this many "
              "hours of the same load (and at least the plan's soak)."),
    Threshold("resources", "soak_window_s", 300.0, Bound.POSITIVE, "s",
              "A soak whose load lasted three such windows or more is reported window by window (TTFT and TTFA p95, "
              "error rate, KV usage, GPU memory growth, prefix-cache hit share) with each figure's trend."),
    Threshold("resources", "soak_horizon_h", 24.0, Bound.NON_NEGATIVE, "h",
              "How long the deployment must hold what the soak ran: a figure whose trend through the soak's windows "
              "(the cautious end of its 99% interval) crosses its limit within this many hours of the soak's end "
              "fails the resources pillar, named with its rate."),
    Threshold("resources", "max_drain_s", 10.0, Bound.NON_NEGATIVE, "s",
              "The drain audit: after each plan stage (not between the steps of one ramp) the users stop and the "
              "load generator waits up to this long for the server's running and waiting requests to reach 0 (the "
              "plan's clock waits with it). Still busy then: the stage did not drain, a resources failure (requests "
              "decoding for clients that left). 0: no drain window, the audit is inconclusive."),
    Threshold("resources", "max_restart_s", 600.0, Bound.POSITIVE, "s",
              "The restart drill (--k3-restart-cmd): the longest the restart command may take to bring the server "
              "back (/health and /v1/models answering); longer, or never, fails the drill. The restart stage's "
              "duration_s is the load held after it."),
    Threshold("resources", "recovery_hold_s", None, Bound.POSITIVE, "s",
              "After a crash, once the server is back: how long the crash stage's users, family mix and input "
              "lengths are re-applied before the plan goes on (the restart check's same conditions). Unset: that "
              "stage's duration, at most 120 s. At most 3600 s: every load loop is bounded, and a plan that wants an "
              "hour's soak after a crash says so in a soak stage.", at_most=3600),
    # prefix_cache
    Threshold("prefix_cache", "min_warm_hit_ratio", 0.3, Bound.SHARE, "share",
              "Cached share of a warm control request's prompt."),
    Threshold("prefix_cache", "min_latency_gain", 0.1, Bound.SHARE, "share",
              "Relative TTFT (or prefill) reduction warm vs cold."),
    Threshold("prefix_cache", "min_reuse_of_design", 0.5, Bound.SHARE, "share",
              "Designed vs achieved reuse (issue 15): the share of its designed prefix reuse (measured at run start "
              "with the server's /tokenize, reuse_design.json) a shared family must reach in the responses' "
              "cached_tokens; clearly below it with enough evidence fails the pillar, a cold family reusing well "
              "above its design is a finding."),
    # diff
    Threshold("diff", "min_comparable_attempts", 20, Bound.COUNT, "count",
              "Fewer of B's answers comparable with A (same scenario and turn, A's majority behaviour decided): the "
              "agreement rules are inconclusive."),
    Threshold("diff", "min_trigger_f1", 0.9, Bound.SHARE, "share",
              "Tool-call trigger F1 of B against A (K2-Vendor-Verifier's ToolCalls-Trigger Similarity): the "
              "interval's upper bound below it fails."),
    Threshold("diff", "min_tool_name_agreement", 0.9, Bound.SHARE, "share",
              "Share of B's tool calls, where A called one too, that name the same tools as A's majority: the "
              "interval's upper bound below it fails."),
    Threshold("diff", "max_schema_accuracy_drop", 0.05, Bound.SHARE, "share",
              "Tool-call argument schema accuracy A minus B: the difference's interval entirely above it fails."),
    Threshold("diff", "max_structured_output_drop", 0.05, Bound.SHARE, "share",
              "Structured-output (JSON) validity A minus B: the difference's interval entirely above it fails."),
    Threshold("diff", "max_latency_p95_increase", 0.5, Bound.NON_NEGATIVE, "share",
              "Relative increase of a stage's TTFT, ITL or e2e p95 (0.5: 50%): B's interval entirely above A's upper "
              "bound times (1 + this) fails."),
    Threshold("diff", "max_throughput_drop", 0.3, Bound.SHARE, "share",
              "Relative drop of a stage's requests/s or output tokens/s: B's interval entirely below A's lower bound "
              "times (1 - this) fails."),
    Threshold("diff", "min_relative_change", 0.25, Bound.NON_NEGATIVE, "share",
              "A stage figure is flagged 'changed beyond noise' only when the two runs' intervals do not overlap and "
              "it moved by at least this share of A's value: within-run intervals do not see run-to-run variation "
              "(another tenant on the host, a different warm-up), so smaller moves are not flagged however narrow "
              "the intervals. Not gating."),
    Threshold("diff", "min_latency_change_ms", 5.0, Bound.NON_NEGATIVE, "ms",
              "A stage latency is flagged 'changed beyond noise', and a p95 increase fails the diff, only when it "
              "also moved by at least this many milliseconds: on a fast server a large share of a few milliseconds "
              "is the client machine's scheduling jitter."),
    Threshold("diff", "max_load_generator_cpu_wait", 0.2, Bound.SHARE, "share",
              "A stage is compared beyond noise, and its latency and throughput rules judged, only while neither "
              "run's load generator waited for a CPU more than this share of the stage's wall time (the kernel's "
              "run-queue time, k3load.sampler.cpu_wait; measured: 4-8% on a quiet two-core machine, 28-52% with six "
              "busy loops beside it). Above it the stage's flags stay empty and its rules are inconclusive: a starved "
              "client measures its own wait and, in a closed loop, sends less. A run that did not record the wait "
              "is judged as before. Not a gate of its own."),
)

SECTION_HELP = {
    "diff": "`k3load diff A B`: how much worse run B (whose plan these are read from) may be than the reference run A "
            "before the command exits non-zero (analysis/diff.py). A rule fails only when the evidence is clear "
            "(intervals beyond the limit), is inconclusive when it is not.",
}
# `thresholds.agent` is the agent pillar's section by the name issue 33 gave it (`thresholds.agent.
# min_reproducible_share`): one section, two spellings in a plan, merged into `agent_api` before any rule reads it.
SECTION_ALIASES = {"agent": "agent_api"}
ALIASED_KEYS = {"agent": ("min_reproducible_share",)}
ALIAS_HELP = {"agent": "The agent pillar's section under the name issue 33 gave it: merged into agent_api "
                       "(analysis/pillars/pillar.py SECTION_ALIASES)."}
THRESHOLDS_HELP = ("What counts as within limits for this deployment; each section overrides the harness defaults key "
                   "by key (analysis/pillars/pillar.py).")


def sections() -> dict[str, tuple[Threshold, ...]]:
    out: dict[str, tuple[Threshold, ...]] = {}
    for threshold in THRESHOLDS:
        out[threshold.section] = (*out.get(threshold.section, ()), threshold)
    return out


def defaults() -> dict[str, dict[str, float]]:
    """Each section's defaults, keys in declared order (a threshold with no fixed default left out)."""
    return {section: {t.key: t.default for t in rows if t.default is not None} for section, rows in sections().items()}


def _section_schema(rows: tuple[Threshold, ...], help_text: str | None) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, **({"description": help_text} if help_text else {}),
            "properties": {t.key: t.schema() for t in rows}}


def schema_part() -> dict[str, Any]:
    """The plan schema's `thresholds` property."""
    by_key = {t.path: t for t in THRESHOLDS}
    properties = {name: _section_schema(rows, SECTION_HELP.get(name)) for name, rows in sections().items()}
    for alias, target in SECTION_ALIASES.items():
        rows = tuple(by_key[f"{target}.{key}"] for key in ALIASED_KEYS[alias])
        properties[alias] = _section_schema(rows, ALIAS_HELP[alias])
    return {"type": "object", "additionalProperties": False, "description": THRESHOLDS_HELP, "properties": properties}
