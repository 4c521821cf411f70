"""Stage plans (`plans/*.yaml`): the staged pressure of a run, expanded into a flat timeline.

Why a flat timeline: the Locust shape, the records' `stage` tags and the analysis must agree on
exactly when each stage ran. Concurrency `steps` become one sub-stage per step (`NAME-cN`) so each
step can be judged on its own (the ramp report's knee).

A `search` stage (issue 27) is one entry that reserves `max_total_s` of the timeline: its steps are
decided live (k3load.loadgen.search), run as stages `NAME-sK-cUSERS` that are in no plan, and the shape
skips what is left of the reservation when the search ends early (k3load.loadgen.shape).

A `replay` stage (issue 28) plays a production trace (k3load.workload.trace) open-loop at its own pace
(k3load.loadgen.replay); it has no family mix. Its `trace:` is resolved against the plan file's directory
when the plan is loaded, so the run directory's copy of the plan names the file that was played.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from k3load.errors import InputError
from k3load.workload.stage_kind import StageKind
from k3load.workload.trace import TraceError, read_trace_once
from k3load.yamlfile import YamlFileError, read_yaml_file

FAMILIES = ("agent", "shared_prefix", "cold", "long_input")
SEARCH_ON = ("users", "sessions_per_s")  # what a search varies: closed-loop users, or open-loop sessions
HISTORIES = ("scripted", "model")  # what drives a conversation's history (the plan's `history`)


class PlanError(InputError):
    """A plan that cannot be used: the message names the file and the field."""


@dataclass(frozen=True)
class SearchSpec:
    """A `kind: search` stage's settings, its defaults filled in (the schema describes each key)."""

    max_users: int
    step_s: float
    max_total_s: float
    start_users: int = 1
    factor: float = 2.0
    resolution: float = 0.1
    min_goodput: float = 0.99
    max_step_s: float = 0.0  # 0: 3 x step_s (filled in by `search_spec`)
    search_on: str = "users"
    # search_on sessions_per_s: the rates tried, and how sessions arrive at each (a step's `arrival`)
    start_sessions_per_s: float = 1.0
    max_sessions_per_s: float = 0.0
    arrival_process: str = "poisson"
    burstiness: float = 1.0

    @property
    def on_rate(self) -> bool:
        return self.search_on == "sessions_per_s"


@dataclass(frozen=True)
class ArrivalSpec:
    """A stage's `arrival:` block (the schema describes each key)."""

    sessions_per_s: float
    process: str = "poisson"
    burstiness: float = 1.0

    @classmethod
    def of(cls, raw: ArrivalSpec | dict[str, Any] | None) -> ArrivalSpec | None:
        if raw is None or isinstance(raw, ArrivalSpec):
            return raw
        return cls(float(raw["sessions_per_s"]), str(raw.get("process", "poisson")),
                   float(raw.get("burstiness", 1.0)))


@dataclass(frozen=True)
class ReplaySpec:
    """A `kind: replay` stage's trace and how it is played (the schema describes each key). `trace` is the
    path as resolved (absolute when the plan came from a file)."""

    trace: str
    speed: float = 1.0
    block_tokens: int = 512
    max_rows: int | None = None

    @classmethod
    def of(cls, raw: ReplaySpec | dict[str, Any] | None) -> ReplaySpec | None:
        if raw is None or isinstance(raw, ReplaySpec):
            return raw
        max_rows = raw.get("max_rows")
        return cls(str(raw["trace"]), float(raw.get("speed", 1.0)), int(raw.get("block_tokens", 512)),
                   int(max_rows) if max_rows is not None else None)


@dataclass(frozen=True)
class Stage:
    name: str
    kind: StageKind  # a str where a stage came whole in a message or from a caller: made a StageKind here
    start_s: float  # offset from the run's start
    duration_s: float
    users: int
    spawn_rate: float
    mix: dict[str, int] = field(default_factory=dict)
    iterations_per_user: int | None = None
    # A search: on the plan's stage (kind "search") its settings; on each step the shape runs, the same
    # settings and `step`, the 1-based step index (repeats counted). None elsewhere.
    search: SearchSpec | None = None
    step: int | None = None
    # Open-loop: the stage's `arrival` (k3load.loadgen.arrivals schedules it, k3load.loadgen.users plays it);
    # None: closed-loop users. A dict where a stage came whole in a message (dataclasses.asdict): `ArrivalSpec.of`.
    arrival: ArrivalSpec | None = None
    # A replay stage's trace (k3load.loadgen.replay plays it); None elsewhere. A dict where a stage came whole.
    replay: ReplaySpec | None = None
    # A step of a plan's concurrency `steps` (the stage `NAME-cN`): NAME, the plan stage it is a step of (its
    # `users` are the step's); None elsewhere. Why a field: nobody parses `-c` back out of a stage's name.
    step_of: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StageKind):  # asdict's round trip, or a caller's literal
            object.__setattr__(self, "kind", StageKind(self.kind))

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class Plan:
    name: str
    stages: tuple[Stage, ...]
    source: str  # the plan as written (saved into the run directory)
    thresholds: dict[str, dict[str, float]] = field(default_factory=dict)
    tool_turns: str = "auto"  # how turns that expect a tool call are sent (k3load.workload.scenario.with_tool_turns)
    stream_equivalence: dict[str, Any] | None = None  # the drill's settings (turns, share); None: not run
    # Per family, `temperature` and `seed` sent over its turns' own settings (`sampled`); empty: as written
    sampling: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The plan's `capacity:` block as written (targets, headroom, GPUs per replica, cost; read by the analysis)
    capacity: dict[str, Any] = field(default_factory=dict)
    # scripted: each conversation's history is its scenario's script; model: the model's own answers and tool
    # calls drive it (k3load.workload.model_history)
    history: str = "scripted"

    @property
    def duration_s(self) -> float:
        return self.stages[-1].end_s if self.stages else 0.0

    def stage_at(self, elapsed_s: float) -> Stage | None:
        for stage in self.stages:
            if elapsed_s < stage.end_s:
                return stage
        return None

    def families(self) -> set[str]:
        return {f for s in self.stages for f, w in s.mix.items() if w > 0}

    def sampled(self, scenario: Any) -> Any:
        """The scenario with every turn's temperature and seed as the plan's `sampling` sets them for its
        family (the body, so its bytes and hash, say so: k3load.workload.stored_requests); as written
        when the plan sets none. Why per family: at temperature 0 repeats of one request are one trial
        (analysis/run/clusters.py); an operator who wants repeats to be draws says so here."""
        settings = self.sampling.get(scenario.family)
        if not settings:
            return scenario
        turns = tuple(replace(t, settings={**t.settings, **settings}) for t in scenario.turns)
        return replace(scenario, turns=turns)


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(resources.files("k3load").joinpath("schemas/plan.schema.json").read_text())
    return schema


def resolve(name_or_path: str, plans_dir: Path) -> Path:
    """`smoke` -> plans/smoke.yaml; a path is taken as it is."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return plans_dir / f"{name_or_path}.yaml"


def _expand(raw: dict[str, Any]) -> list[tuple[str, int, str | None]]:
    """(stage name, users, the `steps` stage it is a step of) for each stage a plan entry runs as."""
    if raw["kind"] == StageKind.SEARCH:
        return [(raw["name"], int(raw.get("start_users", 1)), None)]
    if "steps" in raw:
        return [(f"{raw['name']}-c{n}", n, raw["name"]) for n in raw["steps"]]
    return [(raw["name"], raw["users"], None)]


def _replay(raw: dict[str, Any], base_dir: Path | None) -> ReplaySpec | None:
    """A replay stage's settings, its trace resolved against the plan file's directory (as written when the
    plan came from no file: a relative path then means the working directory)."""
    if raw["kind"] != StageKind.REPLAY:
        return None
    trace = Path(raw["trace"]).expanduser()
    if base_dir is not None and not trace.is_absolute():
        trace = (base_dir / trace).resolve()
    return ReplaySpec.of({**raw, "trace": str(trace)})


def parse_plan(data: Any, where: str, source: str = "", base_dir: Path | None = None) -> Plan:
    """`base_dir`: the plan file's directory, for a replay stage's relative `trace:` (None: as written)."""
    errors = sorted(jsonschema.Draft202012Validator(_schema()).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in errors[0].absolute_path)
        raise PlanError(f"{where}: {path.lstrip('.') or '(top level)'}: {_message(errors[0])}")
    stages: list[Stage] = []
    start = 0.0
    for i, raw in enumerate(data["stages"]):
        if "arrival" in raw and (raw["kind"] == StageKind.SEARCH or "steps" in raw):
            raise PlanError(f"{where}: stages[{i}].arrival: open-loop arrivals are for a stage of its own `users` (the "
                            "most sessions in flight), not for concurrency steps or a search (search_on: users)")
        kind = StageKind(raw["kind"])
        search = search_spec(raw, f"{where}: stages[{i}]") if kind == StageKind.SEARCH else None
        duration = search.max_total_s if search else float(raw["duration_s"])
        for name, users, step_of in _expand(raw):
            stages.append(Stage(name=name, kind=kind, start_s=start, duration_s=duration,
                                users=users, spawn_rate=float(raw.get("spawn_rate", search.max_users if search
                                                                      else users)),  # default: all at once
                                mix={k: v for k, v in raw.get("mix", {}).items() if v > 0},
                                iterations_per_user=raw.get("iterations_per_user"), search=search,
                                arrival=ArrivalSpec.of(raw.get("arrival")), replay=_replay(raw, base_dir),
                                step_of=step_of))
            start += duration
    names = [s.name for s in stages]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise PlanError(f"{where}: stage names must be unique: {sorted(duplicates)}")
    return Plan(name=data["name"], stages=tuple(stages), source=source, thresholds=data.get("thresholds", {}),
                tool_turns=data.get("tool_turns", "auto"), stream_equivalence=_drill(data.get("stream_equivalence")),
                sampling={k: dict(v) for k, v in (data.get("sampling") or {}).items() if v},
                capacity=dict(data.get("capacity") or {}), history=data.get("history", "scripted"))


def search_spec(raw: dict[str, Any], where: str) -> SearchSpec:
    """A search stage's settings with their defaults; what the schema cannot say is one PlanError line."""
    on = raw.get("search_on", "users")
    if on == "sessions_per_s" and "max_sessions_per_s" not in raw:
        raise PlanError(f"{where}.max_sessions_per_s: required for a search on sessions_per_s")
    step_s = float(raw["step_s"])
    spec = SearchSpec(max_users=int(raw["max_users"]), step_s=step_s, max_total_s=float(raw["max_total_s"]),
                      start_users=int(raw.get("start_users", 1)), factor=float(raw.get("factor", 2.0)),
                      resolution=float(raw.get("resolution", 0.1)), min_goodput=float(raw.get("min_goodput", 0.99)),
                      max_step_s=float(raw.get("max_step_s", 3 * step_s)), search_on=on,
                      max_sessions_per_s=float(raw.get("max_sessions_per_s", 0.0)),
                      start_sessions_per_s=min(float(raw.get("start_sessions_per_s", 1.0)),
                                               float(raw.get("max_sessions_per_s", 1.0))),
                      arrival_process=str(raw.get("arrival_process", "poisson")),
                      burstiness=float(raw.get("burstiness", 1.0)))
    if spec.start_users > spec.max_users:
        raise PlanError(f"{where}.start_users: {spec.start_users} is above max_users {spec.max_users}")
    if spec.max_step_s < spec.step_s:
        raise PlanError(f"{where}.max_step_s: {spec.max_step_s:g} is below step_s {spec.step_s:g}")
    if spec.max_total_s < spec.step_s or not math.isfinite(spec.max_total_s):
        raise PlanError(f"{where}.max_total_s: {spec.max_total_s:g} leaves no room for one step of {spec.step_s:g} s")
    return spec


def _message(error: jsonschema.ValidationError) -> str:
    """The schema's own words for a key a stage of this kind may not carry (`{"not": {}, "description"}`),
    else jsonschema's."""
    if error.validator == "not" and error.validator_value == {} and isinstance(error.schema, dict):
        return str(error.schema.get("description") or error.message)
    return error.message


def _drill(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """The streaming-equivalence drill with its defaults filled in (None when the plan has none)."""
    if raw is None:
        return None
    return {"turns": list(raw.get("turns", ["tool_call"])), "share": float(raw.get("share", 0.5))}


def load_plan(path: Path) -> Plan:
    """One file; every failure (unreadable, YAML syntax, schema) is one line naming it."""
    try:
        text, data = read_yaml_file(path, "plan")
    except YamlFileError as exc:
        raise PlanError(str(exc)) from None
    plan = parse_plan(data, str(path), text, path.resolve().parent)
    check_traces(plan, str(path))
    return plan


def check_traces(plan: Plan, where: str) -> None:
    """Every replay stage's trace read and checked now, so a missing file or a bad line stops the run before its
    first request (k3load.workload.trace; its error names the file and line)."""
    for stage in plan.stages:
        if stage.replay is not None:
            try:
                read_trace_once(Path(stage.replay.trace), stage.replay.block_tokens, stage.replay.max_rows)
            except TraceError as exc:
                raise PlanError(f"{where}: stage {stage.name}: trace: {exc}") from None
