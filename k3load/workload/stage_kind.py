"""The kinds of stage a run can have: what a stage proves, and what a crash in it points to.

Why one declaration per kind: the plan's parser, the shape, the recovery hold and the analysis all branch on a
stage's kind. Each member carries what the stage proves (the plan schema's `kind` description and the list in
docs/scenarios-and-plans.md are generated from it: `python -m k3load.analysis.pillars.rule_docs --write`,
drift-tested) and the phase a crash in it points to (the resources pillar's crash table reads it). A new kind is
one member here and its test; a typo is an AttributeError, not a branch that silently never runs. A StrEnum, so
a kind compares equal to, and serialises as, the string written in plans, `stage_start` events and `verdict.json`.
"""

from __future__ import annotations

from enum import StrEnum

# A crash before the first stage (or outside every stage's window): the model's load.
BEFORE_STAGES_PHASE = "during model load or before the first stage: weights and GPU topology"


class StageKind(StrEnum):
    """A stage's `kind`: (value, what the stage proves, the phase a crash in it points to)."""

    proves: str
    crash_phase: str

    def __new__(cls, value: str, proves: str = "", crash_phase: str = "") -> StageKind:
        # the defaults are never used (every member gives all three); they let `StageKind("soak")`, the lookup by
        # value, type-check as the lookup it is
        member = str.__new__(cls, value)
        member._value_ = value
        member.proves = proves
        member.crash_phase = crash_phase
        return member

    LOAD = ("load", "the representative agent load, held at its users for its duration",
            "under the first representative load: weights and GPU topology, or KV sizing")
    LONG_INPUT = ("long_input", "the long-input scenarios, their document sized from the server's max_model_len",
                  "after a long input: context length and KV cache")
    CONCURRENCY = ("concurrency", "a concurrency ramp: `steps` runs each user count as its own stage NAME-cN, the "
                                  "ramp report's steps",
                   "after a concurrency step: scheduler and cache pressure")
    SOAK = ("soak", "the mixed load held long: fragmentation, reuse falling off, memory creeping",
            "after long running: fragmentation or poor reuse")
    RESTART = ("restart", "with --k3-restart-cmd, the restart drill: the server is restarted on purpose, then the "
                          "users and mix of the stage before it are held for duration_s (its own users and mix "
                          "apply without the drill)",
               "during the restart check: the server did not hold the same load after restarting")
    PREFIX_CONTROL = ("prefix_control", "the cache-control pair scenarios (prefix_salt pair) of its families, cold "
                                        "then warm; other stages leave them out",
                      "right after model load, at first requests: weights and GPU topology")
    SEARCH = ("search", "the largest number of users whose goodput stays at or above min_goodput within the "
                        "resource limits (docs/scenarios-and-plans.md, Searching for capacity): its steps run as "
                        "stages NAME-sK-cUSERS; it reserves max_total_s of the plan and the plan goes on as soon "
                        "as it ends",
              "during a capacity search step: scheduler and cache pressure at that step's users")
    REPLAY = ("replay", "a production trace (Mooncake format: `trace`) played open-loop at its own pace, its `users` "
                        "the most requests in flight; it has no mix",
              "while replaying production traffic: the trace's own pace and inputs")
    # never in a plan: the harness inserts it, a crashed stage's load held once the server is back
    # (k3load.loadgen.recovery)
    RECOVERY = ("recovery", "inserted by the harness, never planned: a crashed stage's users and mix held once the "
                            "server is back",
                "under the crash stage's load re-applied after the restart: the crash recurred")


# The kinds a plan may name (every kind but those the harness inserts itself).
PLAN_KINDS: tuple[StageKind, ...] = tuple(k for k in StageKind if k is not StageKind.RECOVERY)
# The kinds whose stages are steps of one ramp (a plan's concurrency `steps`, a search's steps).
STEP_KINDS: tuple[StageKind, ...] = (StageKind.CONCURRENCY, StageKind.SEARCH)
