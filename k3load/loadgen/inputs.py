"""The run's inputs checked before any load: option values, the precheck's input files, the scenario
files, the stage plan and the recipe.

    check_inputs(parsed_options, plans_dir)        # raises InputError: one line naming option or FILE:LINE
    scenarios, plan = load_inputs(parsed_options, plans_dir)

Why before any load: a bad input is the harness's error, not the deployment's. Found at `init` (before
Locust starts a user, opens the run directory or sends the server anything) it stops the run with exit
code 2 and one line that names the option, or the file, line and field; a run that went on would send
load, spend the server's time and end in a verdict that judged nothing (a recipe that cannot be read
used to leave the compat pillar unproven, and `--k3-accept-limited` then exited 0).
"""

from __future__ import annotations

import glob
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from k3load.client.access import access_problem
from k3load.errors import InputError
from k3load.precheck.formats import check_input_files, inventory_nodes
from k3load.precheck.node_files import NodeFiles, NodeFilesError, parse_node_files, unknown_nodes
from k3load.precheck.recipe import load_recipe
from k3load.workload.plan import Plan, load_plan, resolve
from k3load.workload.scenario import Scenario, load_scenarios, with_tool_turns
from k3load.yamlfile import one_line

HARNESS_ERROR_EXIT = 2  # as Locust's own unexpected-error code: no verdict was reached
# What a run's start may raise that is the user's to fix: said as one line, exit 2, no traceback (the Locust
# listeners and the shape catch exactly these; anything else is a bug in the harness and keeps its traceback).
#   InputError  a bad option or file: scenario, plan, trace, recipe, reference run, key, a header, the target at
#               --host, or --k3-out a live run's directory (k3load.rundir_lock.RunDirBusy)
#   OSError     a file or socket the user named failed: --k3-out cannot be created or written (a full disk, no
#               permission), an input file gone or unreadable since `init`. Kept whole rather than narrowed by
#               errno: the harness opens no path and no socket of its own choosing at start, so an OSError here
#               is the environment the user pointed it at, and a full disk must read as the same line as later.
STARTUP_ERRORS: tuple[type[Exception], ...] = (InputError, OSError)
INPUT_FILES = (("--k3-custom-build", "k3_custom_build"), ("--k3-host-inventory", "k3_host_inventory"))
# one file per node, NODE=PATH, or one bare path (k3load.precheck.node_files)
NODE_FILES = (("--k3-container-info", "k3_container_info"), ("--k3-startup-log", "k3_startup_log"))


class HarnessError(InputError):
    """An option or input the harness cannot use; the message names the option or the path."""


def harness_error_line(why: str) -> str:
    """The one line printed for a harness error (stderr, exit code 2, no verdict)."""
    return f"k3load: harness error: {one_line(why)}"


BUG_AT_START = "a bug in k3load at the run's start, not your input (its traceback is above): no verdict"


def bug_at_start(session: Any, exc: BaseException) -> None:
    """A bug raised while a run starts: its traceback printed whole, then the run failed as a harness error (exit
    2, no verdict). Why not let it propagate: raised in the shape's tick or test_start, Locust logs it and the run
    goes on to be judged with nothing in it, a verdict on no evidence."""
    traceback.print_exception(exc, file=sys.stderr)
    session.fail(f"{BUG_AT_START}: {type(exc).__name__}: {exc}")


def check_options(opts: Any) -> None:
    """Numbers in range, paths that exist: each message names the option and the value given."""
    if opts.k3_sample_interval <= 0:
        raise HarnessError(f"--k3-sample-interval must be > 0, got {opts.k3_sample_interval:g}")
    if opts.k3_scrape_timeout < 0:
        raise HarnessError(f"--k3-scrape-timeout must be >= 0 (0: from the interval), got {opts.k3_scrape_timeout:g}")
    if opts.k3_max_restarts < 0:
        raise HarnessError(f"--k3-max-restarts must be >= 0, got {opts.k3_max_restarts}")
    if getattr(opts, "k3_server_log", "") and getattr(opts, "k3_server_log_cmd", ""):
        raise HarnessError("--k3-server-log and --k3-server-log-cmd: give one, not both (a file the server writes "
                           "its log to, or a command that prints it)")
    out = Path(opts.k3_out)
    if out.exists() and not out.is_dir():
        raise HarnessError(f"--k3-out {out}: not a directory")
    _existing_file("--k3-recipe", opts.k3_recipe)
    _check_access(opts)
    for flag, attr in INPUT_FILES:
        value = getattr(opts, attr)
        for path in value if isinstance(value, list) else [value]:
            _existing_file(flag, path)
    for files in node_files(opts).values():
        for entry in files.entries:
            _existing_file(files.flag, str(entry.path), f"{entry.node}={entry.path}" if entry.node else None)


def node_files(opts: Any) -> dict[str, NodeFiles]:
    """--k3-container-info and --k3-startup-log read as NODE=PATH entries (a bare path: one unnamed node);
    a malformed one (an empty node, a node twice, a path missing) is a HarnessError naming the option."""
    try:
        return {attr: parse_node_files(getattr(opts, attr, "") or None, flag) for flag, attr in NODE_FILES}
    except NodeFilesError as exc:
        raise HarnessError(str(exc)) from None


def _check_access(opts: Any) -> None:
    """A CA bundle that exists and loads; headers that can go with the key (errors never show a value)."""
    problem = access_problem(getattr(opts, "k3_api_key", "") or None, getattr(opts, "k3_header", None) or [],
                             getattr(opts, "k3_ca_bundle", "") or None, bool(getattr(opts, "k3_insecure", False)))
    if problem:
        raise HarnessError(problem)
    session = (getattr(opts, "k3_session_header", "") or "").lower()
    gateway = {line.partition(":")[0].strip().lower() for text in getattr(opts, "k3_header", None) or []
               for line in str(text).splitlines()}
    if session and session in gateway:  # the client would refuse it on every request
        raise HarnessError(f"--k3-session-header {opts.k3_session_header}: also a --k3-header (a gateway header, "
                           "sent with its own value): name the header your router keys on")


def _existing_file(flag: str, value: str, shown: str | None = None) -> None:
    """`shown`: the entry as given when it is more than the path (NODE=PATH)."""
    if not value:
        return
    path = Path(value)
    if not path.exists():
        raise HarnessError(f"{flag} {shown or value}: no such file")
    if not path.is_file():
        raise HarnessError(f"{flag} {shown or value}: not a file")


def scenario_paths(pattern: str) -> list[Path]:
    """The files `--k3-scenarios` matches; none is an error naming the option and the pattern."""
    paths = [Path(p) for p in sorted(glob.glob(pattern, recursive=True))]
    if not paths:
        raise HarnessError(f"--k3-scenarios {pattern!r} matched no file")
    return paths


def plan_path(value: str, plans_dir: Path) -> Path:
    """`--k3-plan` as a file: a name under plans/ or a path; one that does not exist names the option."""
    path = resolve(value, plans_dir)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in plans_dir.glob("*.yaml")))
        where = "" if Path(value) == path else f" ({path}; plans: {known})"
        raise HarnessError(f"--k3-plan {value}: no such file{where}")
    return path


def as_played(scenario: Scenario, plan: Plan) -> Scenario:
    """The scenario as this plan plays it: its tool turns and sampling as the plan says (a logged
    scenario's body stays as logged: k3load.workload.logged), its history the scenario's own `history`,
    else the plan's (default scripted)."""
    played = scenario if scenario.is_logged else plan.sampled(with_tool_turns(scenario, plan.tool_turns))
    return replace(played, history=scenario.history or getattr(plan, "history", None) or "scripted")


def load_inputs(opts: Any, plans_dir: Path) -> tuple[dict[str, list[Scenario]], Plan]:
    """Scenarios by family and the plan; a plan family with no scenario names both options."""
    scenarios = load_scenarios(scenario_paths(opts.k3_scenarios))
    path = plan_path(opts.k3_plan, plans_dir)
    plan = load_plan(path)
    by_family: dict[str, list[Scenario]] = {}
    for scenario in scenarios:
        by_family.setdefault(scenario.family, []).append(as_played(scenario, plan))
    missing = sorted(plan.families() - set(by_family))
    if missing:
        raise HarnessError(f"{path}: stages[].mix: families {', '.join(missing)} have no scenario in "
                           f"--k3-scenarios {opts.k3_scenarios!r}")
    return by_family, plan


def check_inputs(opts: Any, plans_dir: Path) -> None:
    """Everything a run needs before its first request, in the order an operator would fix it."""
    check_options(opts)
    load_inputs(opts, plans_dir)
    load_recipe(Path(opts.k3_recipe))
    files = node_files(opts)
    check_input_files(container_info=files["k3_container_info"].paths(),
                      host_inventories=opts.k3_host_inventory or [],
                      custom_build=opts.k3_custom_build or None)  # each file as its format (docs/running.md)
    nodes = inventory_nodes(opts.k3_host_inventory or [])
    for given in files.values():  # NODE as the inventories name it, where they name nodes
        if problem := unknown_nodes(given, nodes):
            raise HarnessError(problem)
