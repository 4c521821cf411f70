"""`register(events)`: wires the session into Locust's events (the only seam into Locust).

    init                      -> master/local: every input checked (a bad one: one line, exit 2, no load);
                                 a HarnessSession on every process; message handlers; SIGTERM as Ctrl-C
    init_command_line_parser  -> the --k3-* options
    test_start                -> inputs loaded everywhere; the master/local runner opens the run dir
    test_stop                 -> a worker's users have stopped: its spool sealed, `k3_done` to the master
    quitting                  -> the master waits for every worker to be done (bounded), reconciles the
                                 spools; validation summary written and printed
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gevent

from k3load.analysis.analyze import analyze
from k3load.analysis.cli import summary_line
from k3load.loadgen import sigterm
from k3load.loadgen.inputs import HARNESS_ERROR_EXIT, check_inputs
from k3load.loadgen.options import add_options
from k3load.loadgen.session import HarnessSession
from k3load.rundir import write_json_atomic
from k3load.summary import format_summary, summarise

log = logging.getLogger("k3load")
DEFAULT_STOP_TIMEOUT_S = 30.0
PLANS_DIR = Path(__file__).resolve().parents[2] / "plans"
WORKER_WAIT_MARGIN_S = 10.0  # on top of --stop-timeout: a worker's stop, last sends and spool seal


def _on_init(environment: Any, **_kwargs: Any) -> None:
    session = HarnessSession(environment)
    if session.role in ("local", "master"):
        _check_inputs(environment.parsed_options, session)
    environment.k3_session = session
    if not environment.stop_timeout:
        environment.stop_timeout = DEFAULT_STOP_TIMEOUT_S  # let in-flight turns end and be recorded
    sigterm.register(environment)  # a headless shape run: SIGTERM stops it as Ctrl-C does (verdict written)
    runner = environment.runner
    if runner is None:
        return
    if session.role == "master":
        runner.register_message("k3_record", lambda msg, **_kw: _on_record(session, msg))
        runner.register_message("k3_spool", lambda msg, **_kw: session.workers.spools.update(
            {msg.node_id: msg.data["spool"]}))
        runner.register_message("k3_done", lambda msg, **_kw: session.workers.done.add(msg.node_id))
    elif session.role == "worker":
        runner.register_message("k3_run", lambda msg, **_kw: session.join_run(msg.data))
        runner.register_message("k3_stage", lambda msg, **_kw: session.set_stage_by_name(msg.data["name"]))


def _check_inputs(opts: Any, session: HarnessSession) -> None:
    """Master or local runner, at `init`: before any user, run directory or request, every input is
    checked, and a bad one is said once as one line on stderr. A local runner exits 2 right here
    (Locust's event hook lets SystemExit through). A master cannot: its workers (--processes forks them
    first) only leave when it tells them to quit, so the run is marked fatal and its shape ends it at the
    first tick, before any user spawns; `quitting` then exits 2."""
    if opts is None or not hasattr(opts, "k3_plan"):
        return  # an Environment built in-process without our options: nothing to check
    try:
        check_inputs(opts, PLANS_DIR)
    except (ValueError, OSError) as exc:
        session.fail(str(exc))
        if session.role == "local":
            raise SystemExit(HARNESS_ERROR_EXIT) from None


def _on_record(session: HarnessSession, msg: Any) -> None:
    """Master: a worker's record; a worker that sends records is not done (its users run again)."""
    session.workers.done.discard(msg.node_id)
    session.write_record_line(json.loads(msg.data)["attempt_id"], msg.data)


def _on_test_start(environment: Any, **_kwargs: Any) -> None:
    session = environment.k3_session
    if session.fatal:
        return
    try:
        session.ensure_started()
    except (RuntimeError, ValueError, OSError) as exc:
        session.fail(str(exc))


def _on_test_stop(environment: Any, **_kwargs: Any) -> None:
    session = getattr(environment, "k3_session", None)
    if session is not None and session.role == "worker":
        session.seal_spool()


def _wait_for_workers(environment: Any, session: HarnessSession) -> list[str]:
    """Master: every worker's users stopped and its records in (its `k3_done` or its sealed spool), or
    the bound passed; each worker still not final is a problem of the run, never silently dropped."""
    workers = session.workers
    timeout_s = (environment.stop_timeout or 0) + WORKER_WAIT_MARGIN_S
    pending = workers.wait_final(session.run_dir / "spool", timeout_s, sleep=gevent.sleep)
    problems = [f"{workers.describe(w)} did not report its users stopped within {timeout_s:.0f} s: "
                "turns it finished later may be missing from records.jsonl" for w in pending]
    for problem in problems:
        log.error("k3load: %s", problem)
    if session.events is not None and workers.spools:
        session.events.event("worker_spools", workers=len(workers.spools), final=len(workers.spools) - len(pending),
                             not_final=[workers.describe(w) for w in pending], waited_s=timeout_s)
    return problems


def _on_quitting(environment: Any, **_kwargs: Any) -> None:
    session: HarnessSession = getattr(environment, "k3_session", None)
    if session is not None and session.fatal and session.role != "worker":
        session.close()  # the error was said once when it happened (HarnessSession.fail): no verdict
        environment.process_exit_code = HARNESS_ERROR_EXIT
        return
    if session is None or session.role == "worker" or session.run_dir is None:
        return
    problems = _wait_for_workers(environment, session) if session.role == "master" else []
    added = session.reconcile_spools()
    if added:
        log.warning("k3load: %d attempt(s) recovered from worker spools", added)
    if session.events is not None:
        session.events.event("run_end", attempts=session.attempts_written)
    session.close()
    summary = summarise(session.run_dir / "records.jsonl")
    if problems:
        summary["problems"] = problems
    write_json_atomic(session.run_dir / "validation_summary.json", summary)
    print(format_summary(summary, session.run_dir), flush=True)
    judgment = analyze(session.run_dir)
    print(summary_line(judgment, session.run_dir), flush=True)
    accept = judgment.verdict == "limited" and environment.parsed_options.k3_accept_limited
    environment.process_exit_code = 0 if accept else judgment.exit_code


def register(events: Any) -> None:
    events.init_command_line_parser.add_listener(add_options)
    events.init.add_listener(_on_init)
    events.test_start.add_listener(_on_test_start)
    events.test_stop.add_listener(_on_test_stop)
    events.quitting.add_listener(_on_quitting)
