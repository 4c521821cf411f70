"""`k3load capacity RUN [--target-users N ...]`: the capacity plan of a judged run, for other targets.

Re-judges the run directory (a pure function of it, as `k3load analyze`) and sizes the targets given
here; what is not given comes from the run's own options and plan. Writes nothing into the run
directory (its manifest covers the capacity.json `k3load analyze` wrote): the plan is printed, and
written as JSON to --out where asked.

Exit codes: 0 the plan was made (whatever it says), 2 bad input (not a run directory, unreadable
records, a bad number).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from k3load.analysis.cli import HARNESS_ERROR_EXIT, run_dir_problem


def _number(kind: type, fits: Callable[[float], bool], said: str) -> Callable[[str], Any]:
    """argparse type: `kind` of the text, finite and `fits`, else an error saying what it must be."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not fits(value):
            raise argparse.ArgumentTypeError(f"must be {said}, got {text!r}")
        return value
    return parse


_positive_int = _number(int, lambda v: v > 0, "a whole number > 0")
_positive = _number(float, lambda v: v > 0, "a finite number > 0")
_headroom = _number(float, lambda v: 0 <= v < 1, "within [0, 1)")
_cost = _number(float, lambda v: v >= 0, "a finite number >= 0")


def add_planner_arguments(parser: argparse.ArgumentParser | Any, prefix: str = "--") -> None:
    """The planner's inputs, as `k3load capacity` takes them; with `prefix` "--k3-", as the run's Locust
    options (each with its K3_* environment variable, configargparse's `env_var`)."""
    def env(name: str) -> dict[str, Any]:
        return {"env_var": "K3_" + name.upper().replace("-", "_")} if prefix == "--k3-" else {}

    parser.add_argument(f"{prefix}target-users", action="append", default=[], type=_positive_int, metavar="N",
                        help="size for N concurrent agents (repeatable): replicas = ceil(N / (capacity per replica "
                        "x (1 - headroom))), GPUs, cost", **env("target-users"))
    parser.add_argument(f"{prefix}target-sessions-per-s", action="append", default=[], type=_positive,
                        metavar="R", help="size for R agent sessions arriving per second (repeatable)",
                        **env("target-sessions-per-s"))
    parser.add_argument(f"{prefix}headroom", type=_headroom, default=None, metavar="H",
                        help="share of each replica's capacity kept free (default 0.3, or the plan's capacity:)",
                        **env("headroom"))
    parser.add_argument(f"{prefix}gpus-per-replica", type=_positive_int, default=None, metavar="G",
                        help="GPUs one replica uses (default: the precheck's inventory, else the GPUs the run's "
                        "telemetry saw)", **env("gpus-per-replica"))
    parser.add_argument(f"{prefix}gpu-hour-cost", type=_cost, default=None, metavar="C",
                        help="price of one GPU-hour: cost per hour, per million output tokens at the SLO and per "
                        "agent session", **env("gpu-hour-cost"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="a run directory written by locustfiles/agent.py")
    add_planner_arguments(parser)
    parser.add_argument("--out", type=Path, metavar="FILE", help="write the plan as JSON here (never into RUN)")


def run(args: argparse.Namespace) -> int:
    from k3load.analysis.analyze import NothingJudged, judge, nothing_judged, plan_capacity
    from k3load.analysis.decision.capacity import planner_inputs
    from k3load.analysis.decision.capacity_context import telemetry_gpus
    from k3load.analysis.run.rundata import UnreadableRecords
    from k3load.analysis.run.timeline import MetricIndex
    from k3load.rundir import write_atomic

    if problem := run_dir_problem(args.run_dir):
        print(f"k3load capacity: {problem}", file=sys.stderr)
        return HARNESS_ERROR_EXIT
    try:
        judgment = judge(args.run_dir)
        if why := nothing_judged(judgment):
            raise NothingJudged(why)
    except (UnreadableRecords, NothingJudged) as exc:
        print(f"k3load capacity: {exc}", file=sys.stderr)
        return HARNESS_ERROR_EXIT
    data = judgment.data
    inputs = planner_inputs(data.run, data.plan, data.compat, telemetry_gpus(data))
    given = {"target_users": tuple(args.target_users), "target_sessions_per_s": tuple(args.target_sessions_per_s),
             "headroom": args.headroom, "gpus_per_replica": args.gpus_per_replica,
             "gpu_hour_cost": args.gpu_hour_cost}
    inputs = replace(inputs, **{k: v for k, v in given.items() if v not in (None, ())})
    plan = plan_capacity(data, MetricIndex(data.metrics), judgment.pillars, judgment.stage_table, judgment.limits,
                         inputs)
    from k3load.analysis.outputs.report_capacity import summary_lines

    plain = plan.to_dict()  # as capacity.json carries it
    print("\n".join(summary_lines(plain)))
    if args.out is not None:
        try:
            write_atomic(args.out, json.dumps(plain, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        except OSError as exc:
            print(f"k3load capacity: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return HARNESS_ERROR_EXIT
        print(f"  written: {args.out}")
    return 0
