"""The judgment's words are declared once: stage kinds (and a ramp step's plan stage), held to the plan schema."""

from __future__ import annotations

import json
from importlib import resources

from k3load.workload.plan import Stage, parse_plan
from k3load.workload.stage_kind import PLAN_KINDS, StageKind


def test_the_schema_names_exactly_the_kinds_a_plan_may_have() -> None:
    schema = json.loads(resources.files("k3load").joinpath("schemas/plan.schema.json").read_text())
    assert schema["$defs"]["stage"]["properties"]["kind"]["enum"] == [str(k) for k in PLAN_KINDS]


def test_a_ramps_steps_name_their_plan_stage_and_kinds_are_the_enum() -> None:
    plan = parse_plan({"name": "p", "stages": [
        {"name": "load", "kind": "load", "duration_s": 1, "users": 2, "mix": {"agent": 1}},
        {"name": "ramp", "kind": "concurrency", "duration_s": 1, "steps": [1, 4], "mix": {"agent": 1}}]}, "p")
    assert [(s.name, s.users, s.step_of) for s in plan.stages] == [("load", 2, None), ("ramp-c1", 1, "ramp"),
                                                                  ("ramp-c4", 4, "ramp")]
    assert all(type(s.kind) is StageKind for s in plan.stages) and plan.stages[1].kind == "concurrency"
    assert json.dumps({"kind": plan.stages[1].kind}) == '{"kind": "concurrency"}'


def test_a_stage_given_its_kind_as_a_string_holds_the_enum() -> None:
    stage = Stage("soak", "soak", 0, 1, 1, 1.0)  # asdict's round trip through a message, or a caller's literal
    assert stage.kind is StageKind.SOAK


def test_every_stage_kind_names_the_phase_a_crash_in_it_points_to() -> None:
    from k3load.analysis.pillars.headroom.pillar_resources import PHASES
    # declared with the kind (k3load.workload.stage_kind): a crash in any stage names where it points
    assert set(StageKind) <= set(PHASES) and all(PHASES[kind] == kind.crash_phase for kind in StageKind)
    assert PHASES[StageKind.SEARCH].startswith("during a capacity search step")


def test_the_vocabulary_serialises_as_the_strings_it_replaced() -> None:
    from k3load.analysis.verdict import EXIT_CODES
    from k3load.outcomes import FAIL, LAYERS, Pillar, Status, Verdict
    assert (FAIL, Pillar.AGENT_API, Verdict.SCALE_UP) == ("fail", "agent_api", "scale_up")
    assert LAYERS == ("model_output", "parser", "server", "gateway", "client") and Status("not_run") is Status.NOT_RUN
    assert json.dumps({Verdict.GO: [Status.PASS]}) == '{"go": ["pass"]}' and EXIT_CODES["limited"] == 3
