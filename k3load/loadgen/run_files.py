"""What a run directory holds from its start, before the first request: plan.yaml, run.json, the reference run's
record, the stored requests (samples/ and samples.sha256), and which files already there the run itself uses.

Why apart from the session: these are written once, from what the run was started with (its options, the server's
model, the scenarios), and read by the analysis and `k3load verify`; the session decides when, this module what.
"""

from __future__ import annotations

import platform
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import k3load
from k3load.analysis.pillars.agent.agreement import REFERENCE_FILE
from k3load.clock import now
from k3load.loadgen.inputs import node_files
from k3load.loadgen.open_run import OpenRun
from k3load.loadgen.options import locust_late_outputs, public_options, run_access
from k3load.rundir import write_atomic, write_json_atomic
from k3load.sampler.fetch import redact_url
from k3load.workload.scenario import Scenario
from k3load.workload.stored_requests import write_stored_requests


def new_run_id(opts: Any, tests: int) -> str:
    """--k3-run-id (with -N from the web UI's second test on), else the start time and a random suffix."""
    generated = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    return (opts.k3_run_id + (f"-{tests}" if tests > 1 else "")) if opts.k3_run_id else generated


def files_in_use(opts: Any, run_dir: Path) -> set[Path]:
    """Files this run already uses that may sit in `run_dir`, left there when an earlier run is moved
    out: Locust's outputs (it opened them before test_start) and the k3 input files."""
    per_node = [path for files in node_files(opts).values() for path in files.paths()]  # each NODE=PATH's
    inputs = [*per_node, opts.k3_custom_build, opts.k3_server_log, *(opts.k3_host_inventory or [])]
    return ({run_dir / rel for rel in locust_late_outputs(opts, run_dir)}
            | {Path(p).resolve() for p in inputs if p})


def run_info(run: OpenRun, model: str, max_model_len: int | None, scenarios: list[str],
             previous_run_moved_to: Path | None) -> dict[str, Any]:
    """run.json: who ran what against which server, with the options' secrets withheld."""
    opts = run.target.options
    return {"run_id": run.run_id, "started_ts": now(), "host": redact_url(run.target.host), "model": model,
            "max_model_len": max_model_len, "plan": run.plan.name,
            "k3load_version": k3load.__version__, "python": sys.version.split()[0],
            "platform": platform.platform(), "options": public_options(opts),
            "tls": run_access(opts)[1].describe(), "scenarios": sorted(scenarios),
            "unsigned_files": locust_late_outputs(opts, run.run_dir),
            "previous_run_moved_to": str_or_none(previous_run_moved_to)}


def write_start_files(run: OpenRun, plan_source: str, info: dict[str, Any], reference: dict[str, Any] | None,
                      playable: list[Scenario], model: str, long_context: Callable[[Scenario], str | None]) -> None:
    """plan.yaml (the plan as run), run.json, the reference's record (read before the run directory opened: the
    reference may be an earlier run there), and the exact bytes of every request the scenarios may send."""
    write_atomic(run.run_dir / "plan.yaml", plan_source)
    write_json_atomic(run.run_dir / "run.json", info)
    if reference is not None:
        write_json_atomic(run.run_dir / REFERENCE_FILE, reference)
    sums = write_stored_requests(playable, run.run_dir / "samples", model, long_context)
    write_atomic(run.run_dir / "samples.sha256",
                 "".join(f"{sha}  samples/{rel}\n" for rel, sha in sorted(sums.items())))


def str_or_none(path: Path | None) -> str | None:
    return str(path) if path is not None else None
