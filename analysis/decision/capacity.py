"""The capacity plan: the largest load one replica held at the SLO, turned into replicas, GPUs and cost.

Why from the judged steps and not a fit: a planner signs a number the run showed, with the bracket it
lies in (the largest step held, the smallest that failed). A step held when it stayed within every
limit of the plan (analysis/pillars/headroom/stages.py: SLO p95s, errors, KV, queue, the full-batch queue, GPU memory)
and its goodput was at or above `min_goodput` (the point estimate, as the live search decides: its 95%
interval is said beside it; analysis/pillars/headroom/goodput.py).
The search's steps are read where the plan searched (kind `search`), else the concurrency ramp's.
Written as `capacity.json` by `k3load analyze` and recomputed by `k3load capacity RUN` with other
targets: a pure function of the run directory and the planner's inputs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from k3load.analysis.decision.ramp import load_steps
from k3load.analysis.pillars.headroom.full_batch import MIN_SCRAPES, PAST_CAPACITY_SHARE
from k3load.analysis.pillars.headroom.goodput import DEFAULT_MIN_GOODPUT
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.limit_rules import EXHAUSTED_BY_RULE, RuleId
from k3load.analysis.pillars.pillar import rounded
from k3load.analysis.pillars.rules import Breach

CAPACITY_FORMAT = 1
DEFAULT_HEADROOM = 0.3
GOODPUT_RULE = "slo.goodput"
RATE = "sessions_per_s"  # a stage row's arrival rate (an open-loop step's)


@dataclass(frozen=True)
class PlannerInputs:
    """What the planner asks: targets, headroom, GPUs per replica, the GPU-hour price. The run's options
    (--k3-target-users ...) win over the plan's `capacity:` block, key by key."""

    target_users: tuple[int, ...] = ()
    target_sessions_per_s: tuple[float, ...] = ()
    headroom: float = DEFAULT_HEADROOM
    gpus_per_replica: int | None = None
    gpu_hour_cost: float | None = None

    @classmethod
    def of(cls, options: dict[str, Any], plan_capacity: dict[str, Any] | None) -> PlannerInputs:
        plan = plan_capacity or {}

        def pick(option: str, key: str, default: Any) -> Any:
            value = options.get(option)
            return value if value not in (None, [], "") else plan.get(key, default)

        headroom = pick("k3_headroom", "headroom", DEFAULT_HEADROOM)
        gpus, cost = pick("k3_gpus_per_replica", "gpus_per_replica", None), pick("k3_gpu_hour_cost", "gpu_hour_cost",
                                                                                   None)
        # numbers as numbers whatever carried them (run.json, a plan): a text "4" never multiplies a string
        return cls(target_users=tuple(int(v) for v in pick("k3_target_users", "target_users", ()) or ()),
                   target_sessions_per_s=tuple(float(v) for v in
                                               pick("k3_target_sessions_per_s", "target_sessions_per_s", ()) or ()),
                   headroom=float(DEFAULT_HEADROOM if headroom is None else headroom),
                   gpus_per_replica=int(gpus) if gpus not in (None, "") else None,
                   gpu_hour_cost=float(cost) if cost not in (None, "") else None)


def replicas_for(target: float, per_replica: float, headroom: float) -> int | None:
    """ceil(target / (per-replica capacity x (1 - headroom))): each replica planned to run at (1 - headroom)
    of what it held. None when the replica held nothing (no number of them serves the target)."""
    usable = per_replica * (1.0 - headroom)
    if per_replica <= 0 or usable <= 0:
        return None
    return max(1, math.ceil(target / usable - 1e-9))


def min_goodput(plan: Any, search: str | None = None) -> float:
    """The bound a search's steps are held to: that search stage's `min_goodput` (`search`: its name; None: the
    plan's last search, the one the capacity is read from), else the default 0.99 (a concurrency ramp)."""
    found = [s.search for s in getattr(plan, "stages", ()) or ()
             if getattr(s, "search", None) is not None and (search is None or s.name == search)]
    return float(found[-1].min_goodput) if found else DEFAULT_MIN_GOODPUT


def step_held(row: StageRow, bound: float) -> bool:
    """Within every limit and goodput at or above the bound. The point estimate decides, as the live search
    decides a step whose interval still straddles the bound after its repeat (k3load.loadgen.search): the
    interval is said beside it (an interval clearly above or below agrees with its point anyway)."""
    return load_held([row], bound)


def load_goodput(rows: list[StageRow]) -> float | None:
    """The goodput of one load over all its steps together (a near-bound step and its repeat are one body
    of evidence, as the live search judged them); None where no request was judged."""
    requests = sum(r.goodput.requests for r in rows if r.goodput)
    good = sum(r.goodput.good_requests for r in rows if r.goodput)
    return good / requests if requests else None


def _pooled_queue(rows: list[StageRow]) -> bool:
    """The queue behind a full batch over every step at one load, their scrapes together (as the live search
    pools a repeat's): past capacity where most of them showed it."""
    scrapes = sum(r.full_batch_scrapes or 0 for r in rows if r.full_batch_queued_scrapes is not None)
    queued = sum(r.full_batch_queued_scrapes or 0 for r in rows)
    return scrapes >= MIN_SCRAPES and queued / scrapes > PAST_CAPACITY_SHARE


def load_held(rows: list[StageRow], bound: float) -> bool:
    """One load, over every step run at it: within every limit (the queue behind a full batch over their
    scrapes together), and their goodput together at the bound; a load no request was judged at never held."""
    other = [p for r in rows for p in r.problems if p.id != RuleId.FULL_BATCH_QUEUE]
    goodput = load_goodput(rows)
    queued = _pooled_queue(rows) if len(rows) > 1 else any(p.id == RuleId.FULL_BATCH_QUEUE for r in rows
                                                            for p in r.problems)
    return not other and not queued and goodput is not None and goodput >= bound


@dataclass(frozen=True)
class Limiting:
    """What ran out at the first failed step: the rule, the resource it names, the breach's reason (capacity.json's
    `limiting`, with the step's stage and load beside it)."""

    rule: str
    resource: str
    reason: str


def _limiting(row: StageRow, bound: float) -> Limiting:
    """What ran out at the first failed step, by rule id (never by the reason's wording)."""
    ids: dict[str, Breach] = {p.id: p for p in row.problems}
    for rule_id, resource in EXHAUSTED_BY_RULE:
        if rule_id in ids:
            return Limiting(rule_id, resource, ids[rule_id].reason)
    if row.problems:
        first = row.problems[0]
        return Limiting(str(first.id), "unknown", first.reason)
    good = row.goodput
    ci = good.share_ci95 if good else None
    if good is None or not good.requests or ci is None or good.share is None:
        return Limiting(GOODPUT_RULE, "goodput",
                        "no request was judged at this load (none answered or counted): it cannot be said to hold")
    misses = good.misses or {}
    said = ", ".join(f"{k} {v}" for k, v in misses.items() if v)
    what = ("the answers' validity, not the load: every miss was an answer that was not valid"
            if misses and misses.get("invalid") and not misses.get("latency") and not misses.get("error")
            else "goodput")
    return Limiting(GOODPUT_RULE, what, f"{good.share:.1%} of {good.requests} requests met "
                    f"every SLO (95% CI {ci[0]:.1%}-{ci[1]:.1%}) < {bound:.0%}"
                    + (f"; attempts missed by {said}" if said else ""))


def _most_requests(row: StageRow) -> tuple[int, str]:
    """Of repeats at one load, the step with the most evidence speaks for it."""
    return (row.goodput.requests if row.goodput else 0) or 0, row.stage


def _worst(rows: list[StageRow], bound: float) -> StageRow:
    """The failed load's step that speaks for it: one that broke a limit, else the one with most evidence."""
    broke = [r for r in rows if r.problems]
    return broke[0] if broke else max(rows, key=_most_requests)


def _load_key(rows: list[StageRow]) -> str:
    """What the steps varied: the arrival rate where they were open-loop (a search on sessions_per_s), else users."""
    return RATE if rows and all(r.sessions_per_s is not None for r in rows) else "users"


def _load(row: StageRow, key: str) -> float:
    """The step's load on the axis the steps varied (`_load_key`'s): its arrival rate, else its users (an int,
    as capacity.json says it; a load step has its load, `load_steps`)."""
    load = row.sessions_per_s if key == RATE else row.users
    return load if load is not None else 0


def _bracket(rows: list[StageRow], bound: float, key: str) -> tuple[StageRow | None, StageRow | None]:
    """(the capacity step, the first failed step): the largest load held below the smallest that failed;
    a load held only where every step at it held (a repeat that failed counts)."""
    by_load: dict[float, list[StageRow]] = {}
    for row in rows:
        by_load.setdefault(float(_load(row, key)), []).append(row)
    failed = sorted(u for u, group in by_load.items() if not load_held(group, bound))
    first_bad = failed[0] if failed else None
    held = [u for u in by_load if u not in failed and (first_bad is None or u < first_bad)]
    best = max(held) if held else None
    return (max(by_load[best], key=_most_requests) if best is not None else None,
            _worst(by_load[first_bad], bound) if first_bad is not None else None)


def _per_replica(kind: str | None, rows: list[StageRow], bound: float, max_input: int | None) -> dict[str, Any]:
    key = _load_key(rows)
    held, bad = _bracket(rows, bound, key)
    tried = max((_load(r, key) for r in rows), default=None)
    out: dict[str, Any] = {"source": kind, "min_goodput": bound, "max_users_at_slo": None,
                           "max_users_at_slo_interval": None, "max_sessions_per_s_at_slo": None,
                           "max_sessions_per_s_at_slo_interval": None, "searched_on": key,
                           "requests_per_s_at_slo": None, "output_tokens_per_s_at_slo": None,
                           "sessions_per_s_at_slo": None, "goodput_at_max": None, "limiting": None,
                           "limit_reached": bad is not None, "largest_load_tried": tried,
                           "max_input_tokens_held": max_input, "capacity_stage": None}
    if not rows:
        out["inconclusive"] = "inconclusive, because the plan ran no concurrency or search steps"
        return out
    unit = "sessions/s" if key == RATE else "users"
    if bad is not None:
        out["limiting"] = {**asdict(_limiting(bad, bound)), "stage": bad.stage, "users": bad.users,
                           RATE: bad.sessions_per_s}
    field = "max_sessions_per_s_at_slo" if key == RATE else "max_users_at_slo"
    if held is None:
        out["inconclusive"] = (f"no step held at the SLO: the smallest ({_load(bad, key) if bad else '?'} {unit}) "
                               "already failed; capacity is below it")
        out[f"{field}_interval"] = [0, _below(_load(bad, key), key)] if bad else None
        return out
    good = held.goodput  # a held step's goodput was judged (load_held)
    out |= {field: _load(held, key), "capacity_stage": held.stage,
            f"{field}_interval": [_load(held, key), _below(_load(bad, key), key) if bad else None],
            "requests_per_s_at_slo": good.requests_per_s if good else None,
            "output_tokens_per_s_at_slo": good.output_tokens_per_s if good else None,
            "sessions_per_s_at_slo": good.sessions_per_s if good else None,
            "goodput_at_max": {"share": good.share if good else None, "ci95": _ci95(held),
                               "requests": good.requests if good else None}}
    return out


def _ci95(row: StageRow) -> list[float] | None:
    """The step's goodput interval as capacity.json carries it (a list; None: not judged)."""
    return list(row.goodput.share_ci95) if row.goodput and row.goodput.share_ci95 else None


def _below(failed: float, key: str) -> float:
    """The top of the bracket: one user below the first that failed; a rate, the failed rate itself (open)."""
    return int(failed) - 1 if key == "users" else failed


def _other_bracket(per: dict[str, Any]) -> dict[str, Any]:
    """The other search's capacity and what ran out there (a plan searching on users and on rate): the primary
    is the plan's last search; the targets of each kind are sized by their own."""
    key = "max_sessions_per_s_at_slo" if per["searched_on"] == RATE else "max_users_at_slo"
    return {key: per[key], f"{key}_interval": per[f"{key}_interval"],
            f"{per['searched_on']}_search": {"limiting": per["limiting"], "capacity_stage": per["capacity_stage"],
                                             "limit_reached": per["limit_reached"]}}


@dataclass(frozen=True)
class Target:
    """One target sized: `kind` users or sessions_per_s, `target` its figure; `basis` which per-replica figure it
    was sized by. Plain data (`to_dict`) in capacity.json, the figure under its kind's name and the whys only
    where they apply."""

    kind: str
    target: float
    per_replica: float | None
    basis: str
    headroom: float
    replicas: int | None
    gpus_per_replica: int | None
    gpus: int | None
    cost_per_hour: float | None

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {self.kind: self.target, "per_replica": self.per_replica, "basis": self.basis,
                               "headroom": self.headroom, "replicas": self.replicas,
                               "gpus_per_replica": self.gpus_per_replica, "gpus": self.gpus}
        if self.replicas is None:
            row["why_unknown"] = "the run measured no capacity at the SLO to size by"
        elif self.gpus is None:
            row["why_gpus_unknown"] = "GPUs per replica unknown: --k3-gpus-per-replica, or a precheck inventory"
        if self.cost_per_hour is not None:
            row["cost_per_hour"] = self.cost_per_hour
        return row


@dataclass(frozen=True)
class Cost:
    """Per replica planned at (1 - headroom) of its capacity: what an hour, a million output tokens and an agent
    session served within the SLO cost there (None: not measured)."""

    gpu_hour_cost: float
    replica_cost_per_hour: float
    per_million_output_tokens: float | None
    per_agent_session: float | None


def _target(kind: str, target: float, per_replica: float | None, inputs: PlannerInputs, basis: str) -> Target:
    """One target sized; `basis`: which per-replica figure it was sized by, said in the row."""
    replicas = replicas_for(target, per_replica, inputs.headroom) if per_replica else None
    gpus = replicas * inputs.gpus_per_replica if replicas is not None and inputs.gpus_per_replica else None
    cost = gpus * inputs.gpu_hour_cost if inputs.gpu_hour_cost is not None and gpus is not None else None
    return Target(kind, target, per_replica, basis, inputs.headroom, replicas, inputs.gpus_per_replica, gpus, cost)


def _cost(per: dict[str, Any], inputs: PlannerInputs) -> Cost | None:
    """Per replica planned at (1 - headroom) of its capacity: the price of a million output tokens and of
    an agent session served within the SLO there."""
    if inputs.gpu_hour_cost is None or not inputs.gpus_per_replica:
        return None
    hourly = inputs.gpus_per_replica * inputs.gpu_hour_cost
    load = 1.0 - inputs.headroom
    tokens, sessions = per.get("output_tokens_per_s_at_slo"), per.get("sessions_per_s_at_slo")
    return Cost(inputs.gpu_hour_cost, hourly, hourly / (tokens * load * 3600 / 1e6) if tokens else None,
                hourly / (sessions * load * 3600) if sessions else None)


def planner_inputs(run: dict[str, Any], plan: Any, compat: dict[str, Any] | None, gpu_count: int | None
                   ) -> PlannerInputs:
    """The run's options and plan, GPUs per replica from them, else the precheck's inventory, else the GPUs
    the run's telemetry saw (`gpu_count`)."""
    inputs = PlannerInputs.of(run.get("options") or {}, getattr(plan, "capacity", None))
    if inputs.gpus_per_replica:
        return inputs
    rule = next((r for r in (compat or {}).get("rules", []) if r.get("id") == "gpu_count"), None)
    total = ((rule or {}).get("details") or {}).get("total")
    found = total if isinstance(total, int) and total > 0 else gpu_count
    return PlannerInputs(inputs.target_users, inputs.target_sessions_per_s, inputs.headroom, found or None,
                         inputs.gpu_hour_cost)


@dataclass(frozen=True)
class CapacityPlan:
    """capacity.json, typed until it is written (`to_dict`): per replica (its figures under capacity.json's keys,
    and the other search's where a plan searched on both), the targets sized, the cost, the steps read, and what
    analysis/analyze.py adds (the what-ifs, the assumptions, what the live search said)."""

    per_replica: dict[str, Any]
    targets: tuple[Target, ...]
    cost: Cost | None
    steps: tuple[dict[str, Any], ...]
    what_if: tuple[dict[str, Any], ...] = ()
    assumptions: tuple[str, ...] = ()
    search: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """capacity.json as written (and as the reports read it): plain data, its floats rounded."""
        plain: dict[str, Any] = rounded({"format": CAPACITY_FORMAT, "per_replica": self.per_replica,
                                         "targets": [t.to_dict() for t in self.targets],
                                         "cost": asdict(self.cost) if self.cost is not None else None,
                                         "what_if": list(self.what_if),
                                         "assumptions": list(self.assumptions), "steps": list(self.steps),
                                         "search": self.search})
        return plain


def capacity_plan(stage_table: list[StageRow], inputs: PlannerInputs, bound: float,
                  max_input: int | None) -> CapacityPlan:
    """The capacity plan: per replica, the targets sized, the cost and the steps it read."""
    kind, rows = load_steps(stage_table)
    per = _per_replica(kind, rows, bound, max_input)
    other = load_steps(stage_table, on_rate=per["searched_on"] != RATE)  # a plan that searched on both
    if other[1]:
        per |= _other_bracket(_per_replica(*other, bound, max_input))
    targets = [_target("users", float(n), per["max_users_at_slo"], inputs, "max_users_at_slo: closed-loop users")
               for n in inputs.target_users]
    searched = per["max_sessions_per_s_at_slo"] is not None  # a rate search's, else the sessions the step completed
    rate, basis = ((per["max_sessions_per_s_at_slo"], "max_sessions_per_s_at_slo: the rate search") if searched else
                   (per["sessions_per_s_at_slo"], "sessions_per_s_at_slo: the sessions the capacity step's closed-loop "
                                                  "users started and served within the SLO (no think time)"))
    targets += [_target("sessions_per_s", r, rate, inputs, basis) for r in inputs.target_sessions_per_s]
    cost = _cost(per, inputs)
    steps = [{"stage": r.stage, "users": r.users, RATE: r.sessions_per_s, "held": step_held(r, bound),
              "goodput": r.goodput.share if r.goodput else None,
              "goodput_ci95": _ci95(r), "past_capacity": r.past_capacity,
              "problems": [str(p.id) for p in r.problems]} for r in rows]
    return CapacityPlan(per, tuple(targets), cost, tuple(steps))
