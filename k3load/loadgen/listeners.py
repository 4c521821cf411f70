"""`register(events)`: wires the session into Locust's events (the only seam into Locust).

    init                      -> master/local: every input checked (a bad one: one line, exit 2, no load);
                                 every role: the key and headers held out of Locust's options
                                 (k3load.loadgen.held_secrets); a web UI or worker port open beyond loopback
                                 said; a HarnessSession on every process; message handlers; SIGTERM as Ctrl-C;
                                 under a web UI the k3load tab and GET /k3load/state (k3load.loadgen.webui)
    init_command_line_parser  -> the --k3-* options
    test_start                -> a worker without the master's secrets refuses (`k3_refused`: the master stops
                                 the run, exit 2); inputs loaded everywhere; the master/local runner opens the
                                 run dir (a new one per test the web UI starts); no plan shape: the first stage
                                 manual-1; a worker's CPU reporter starts (k3load.loadgen.cpu)
    test_stop                 -> a worker's users have stopped: `k3_done` with its count of records sent
                                 (k3load.loadgen.worker); under the web UI the master/local runner judges the
                                 run (in the background)
    quitting                  -> the master waits until every worker's records arrived (bounded; spools read
                                 where a worker fell short: k3load.loadgen.delivery); validation summary
                                 written and printed; the run directory's lock released. A run stopped by a
                                 write that failed (a full disk) or whose directory was moved away while it
                                 ran is judged nowhere: exit 2 (k3load.loadgen.hold)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gevent

from k3load.analysis.analyze import Judgment, NothingJudged, analyze
from k3load.analysis.cli import summary_line
from k3load.client.origin import plain_http_warning
from k3load.events import Event, Message
from k3load.evidence import records_file
from k3load.loadgen import delivery, held_secrets, locust_trim, sigterm, ui_guard, webui
from k3load.loadgen.inputs import HARNESS_ERROR_EXIT, STARTUP_ERRORS, HarnessError, bug_at_start, check_inputs
from k3load.loadgen.open_run import OpenRun
from k3load.loadgen.options import add_options
from k3load.loadgen.role import ProcessRole
from k3load.loadgen.session import HarnessSession
from k3load.private_files import restrict_umask
from k3load.rundir import write_json_atomic
from k3load.rundir_lock import in_use
from k3load.summary import format_summary, summarise

log = logging.getLogger("k3load")
DEFAULT_STOP_TIMEOUT_S = 30.0
PLANS_DIR = Path(__file__).resolve().parents[2] / "plans"


def _on_init(environment: Any, **_kwargs: Any) -> None:
    restrict_umask()  # what Locust opens from here on (--csv, --html, --json-file) is this user's alone
    session = HarnessSession(environment)
    if session.role.owns_run:
        _check_inputs(environment.parsed_options, session)
    if environment.parsed_options is not None:  # the key and headers leave the options Locust relays and shows
        held = held_secrets.hold(environment.parsed_options, environment.host)
        if session.role.owns_run:
            for warning in ui_guard.exposure_warnings(environment.parsed_options, environment.web_ui is not None,
                                                      session.role.is_master):
                log.warning("k3load: %s", warning)
            if plain := plain_http_warning(environment.host or "", bool(held)):
                log.warning("%s", plain)
    environment.k3_session = session
    if getattr(environment.parsed_options, "k3_manual", False):
        environment.shape_class = None  # the web UI's user count (or -u) drives the users: stages manual-N
    if not environment.stop_timeout:
        environment.stop_timeout = DEFAULT_STOP_TIMEOUT_S  # let in-flight turns end and be recorded
    sigterm.register(environment)  # a headless shape run: SIGTERM stops it as Ctrl-C does (verdict written)
    if getattr(environment, "web_ui", None) is not None and session.role.owns_run:
        webui.register(environment)  # the k3load tab, its live page and GET /k3load/state
    runner = environment.runner
    if runner is None:
        return
    if session.role.owns_run:
        locust_trim.keep_trimmed(environment)  # Locust's per-second counts and chart history, to a window
    if session.role.is_master:
        delivery.register(runner, session)  # k3_join, k3_record, k3_done, k3_cpu
        runner.register_message(Message.REFUSED, lambda msg, **_kw: _worker_refused(environment, msg.data))
    elif session.role.is_worker:
        runner.register_message(Message.RUN, lambda msg, **_kw: session.join_run(msg.data))
        runner.register_message(Message.STAGE, lambda msg, **_kw: _stage_from_master(session, msg.data))


def _stage_from_master(session: HarnessSession, data: dict[str, Any]) -> None:
    """Worker: the master entered a stage; its worker count then is how a replay stage's rows are split."""
    session.master_workers = data.get("workers")
    session.set_stage_by_name(data["name"], data.get("stage"))


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
        if busy := in_use(Path(opts.k3_out).resolve()):  # a live run's directory: refused before any load
            raise HarnessError(busy)
    except STARTUP_ERRORS as exc:
        session.fail(str(exc))
        if session.role is ProcessRole.LOCAL:
            raise SystemExit(HARNESS_ERROR_EXIT) from None


def _on_test_start(environment: Any, **_kwargs: Any) -> None:
    session = environment.k3_session
    if session.role.is_worker:
        _check_worker_secrets(environment, session)
    if session.fatal:
        return
    try:
        session.ensure_started()
    except STARTUP_ERRORS as exc:
        session.fail(str(exc))
        return
    except Exception as exc:  # a bug: its traceback whole, and no verdict on a run that never started
        bug_at_start(session, exc)
        return
    if session.link is not None:
        session.link.cpu.start(environment.parsed_options.k3_sample_interval)
    if session.role.owns_run and session.manual.active and not session.manual.stages:
        opts = environment.parsed_options
        session.enter_manual_stage(opts.num_users or 0, opts.spawn_rate or 1.0)


def _check_worker_secrets(environment: Any, session: HarnessSession) -> None:
    """A worker sends nothing for a run whose secrets it does not hold itself (k3load.loadgen.held_secrets):
    one line here, and the master stops the run."""
    token = getattr(environment.parsed_options, "k3_secrets_check", "") or ""
    why = held_secrets.worker_problem(token, held_secrets.held(environment.parsed_options), environment.host)
    if why is None:
        return
    session.fail(f"worker refuses the run: {why}")  # told to the master (k3load.loadgen.worker.tell_master)


def _printable(value: Any, limit: int) -> str:
    """What a worker sent, safe for the master's one console line: the worker port is reachable by whoever can
    connect to it (workers are not authenticated), so escapes and control characters are said as repr, and
    the length is bounded."""
    text = str(value)[:limit]
    return text if text.isprintable() else repr(text)


def _worker_refused(environment: Any, data: dict[str, Any]) -> None:
    """Master: a worker refused the run or met a harness error; the run stops (exit 2, no verdict), the worker
    and its reason said once."""
    session = environment.k3_session
    data = data if isinstance(data, dict) else {}
    session.fail(f"worker {_printable(data.get('host'), 100)}:{_printable(data.get('pid'), 20)} cannot take part: "
                 f"{_printable(data.get('why'), 2000)}")
    runner = environment.runner
    if environment.shape_class is None or getattr(environment.parsed_options, "headless", False):
        gevent.spawn(runner.quit if getattr(environment.parsed_options, "headless", False) else runner.stop)


def _on_test_stop(environment: Any, **_kwargs: Any) -> None:
    """A worker says how many records it sent. Under the web UI the master/local runner judges the run now, in a
    greenlet (the analysis itself in a native thread), so the UI keeps answering and the next test
    started from it is a new run."""
    session = getattr(environment, "k3_session", None)
    if session is None:
        return
    if session.link is not None:
        session.link.seal()
        return
    run = session.run
    if run is None or session.finished or session.fatal or not judges_at_stop(environment):
        return
    session.finished = True  # no new test joins this run; records still in flight are written
    session.finisher = gevent.spawn(finish_run, environment, session, run, True)


def judges_at_stop(environment: Any) -> bool:
    """The web UI runs one test after another in one process: each is judged when it stops."""
    return environment.web_ui is not None and not getattr(environment.parsed_options, "headless", False)


def _on_quitting(environment: Any, **_kwargs: Any) -> None:
    session: HarnessSession | None = getattr(environment, "k3_session", None)
    if session is not None and session.fatal and session.role.owns_run:
        _quit_fatal(environment, session)  # the error was said once when it happened (HarnessSession.fail)
        return
    if session is not None and session.fatal:  # a worker's harness error, told to its master: not a clean exit
        environment.process_exit_code = HARNESS_ERROR_EXIT
    if session is not None and session.link is not None:
        session.link.cpu.stop()  # a worker quitting without test_stop (never started): no reading follows
    run = session.run if session is not None and session.role.owns_run else None
    if session is None or run is None:
        return
    if session.finisher is not None:
        session.finisher.join()  # the web UI's last test, judged at its stop
    judgment = session.judgment if session.finished else finish_run(environment, session, run)
    if judgment is None or session.fatal:  # a write failed at the end, the directory moved away: no verdict
        _quit_fatal(environment, session)
        return
    session.hold.release()
    accept = judgment.verdict == "limited" and environment.parsed_options.k3_accept_limited
    environment.process_exit_code = 0 if accept else judgment.exit_code


def _quit_fatal(environment: Any, session: HarnessSession) -> None:
    """No verdict: files closed (what a failed write left stays readable), records that could not be kept
    counted, the directory's lock released, exit 2."""
    session.close()
    if lost := session.records_lost():
        log.warning("k3load: %d answers not kept: they ended after the evidence could no longer be written, or "
                    "waited for the write that failed (Locust's table counts them)", lost)
    session.hold.release()
    environment.process_exit_code = HARNESS_ERROR_EXIT


def finish_run(environment: Any, session: HarnessSession, run: OpenRun, in_thread: bool = False) -> Judgment | None:
    """Master/local: the run's last records in, `run_end`, files closed, then the validation summary
    and the judgment (verdict.json, reports, alerts, manifest). `in_thread`: the CPU-bound part runs in
    gevent's native thread pool, so this greenlet waits while the hub (the web UI) keeps serving.
    None, the run fatal (exit 2), when its directory is no longer the one it opened (checked before the
    first write of the end and again after the judgment: k3load.rundir_lock) or a write failed."""
    session.finished = True
    run_dir = run.run_dir
    problems = delivery.collect(run, session.workers, session.write_record_line, environment.runner,
                                (environment.stop_timeout or 0) + delivery.WAIT_MARGIN_S) \
        if session.role.is_master else []
    if _moved_away(session):
        session.close()
        return None
    session.end_manual_stages()
    run.events.event(Event.RUN_END, attempts=session.attempts_written)
    session.close()  # a write that fails here stops the run too (k3load.loadgen.hold)
    if session.fatal:
        return None
    try:
        if in_thread:
            summary, judgment = gevent.get_hub().threadpool.apply(_summarise_and_judge, (run_dir, problems))
        else:
            summary, judgment = _summarise_and_judge(run_dir, problems)
    except OSError as exc:  # verdict.json, the reports: a full disk at the very end
        if session.hold.guard is None:
            raise
        session.hold.guard.failed(run_dir, exc)
        return None
    except NothingJudged as exc:  # every pillar not_run: a harness error, never a verdict (exit 2)
        session.fail(str(exc))
        return None
    if _moved_away(session):  # moved while it was judged: what it wrote went there by path
        return None
    print(format_summary(summary, run_dir), flush=True)
    print(summary_line(judgment, run_dir), flush=True)
    session.judgment = judgment
    return judgment


def _moved_away(session: HarnessSession) -> bool:
    """The run directory is no longer this run's (k3load.rundir_lock): said once, the run fatal."""
    moved = session.hold.moved(session.open_logs())
    if moved is not None:
        session.fail(f"{moved}: this run is not judged (`k3load analyze` on its files judges them)")
    return moved is not None


def _summarise_and_judge(run_dir: Path, problems: list[str]) -> tuple[dict[str, Any], Judgment]:
    summary = summarise(records_file(run_dir))
    if problems:
        summary["problems"] = problems
    write_json_atomic(run_dir / "validation_summary.json", summary)
    return summary, analyze(run_dir)


def register(events: Any) -> None:
    events.init_command_line_parser.add_listener(add_options)
    events.init.add_listener(_on_init)
    events.test_start.add_listener(_on_test_start)
    events.test_stop.add_listener(_on_test_stop)
    events.quitting.add_listener(_on_quitting)
