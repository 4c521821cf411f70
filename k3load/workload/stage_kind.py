"""The kinds of stage a run can have: what a stage proves, and how the analysis reads it.

Why an enum of its own module: the plan's parser, the shape, the recovery hold and the analysis all
branch on a stage's kind; spelled once here, a new kind is one member (and its line in
`k3load/schemas/plan.schema.json`, which a test holds to this list), and a typo is an AttributeError,
not a branch that silently never runs. A StrEnum, so a kind compares equal to, and serialises as, the
string written in plans, `stage_start` events and `verdict.json` (byte for byte as before).
"""

from __future__ import annotations

from enum import StrEnum


class StageKind(StrEnum):
    """A stage's `kind` (the plan schema describes what each proves)."""

    LOAD = "load"
    LONG_INPUT = "long_input"
    CONCURRENCY = "concurrency"
    SOAK = "soak"
    RESTART = "restart"
    PREFIX_CONTROL = "prefix_control"
    SEARCH = "search"
    REPLAY = "replay"
    # never in a plan: the harness inserts it, a crashed stage's load held once the server is back
    # (k3load.loadgen.recovery)
    RECOVERY = "recovery"


# The kinds a plan may name (every kind but those the harness inserts itself).
PLAN_KINDS: tuple[StageKind, ...] = tuple(k for k in StageKind if k is not StageKind.RECOVERY)
# The kinds whose stages are steps of one ramp (a plan's concurrency `steps`, a search's steps).
STEP_KINDS: tuple[StageKind, ...] = (StageKind.CONCURRENCY, StageKind.SEARCH)
