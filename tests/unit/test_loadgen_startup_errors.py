"""A run's start turns the user's errors into one line and exit 2, and a bug into its whole traceback, then exit 2.

Why: the Locust listeners and the shape once caught (RuntimeError, ValueError, OSError) around start-up, so a
programming error (a bad unpacking, a wrong int(), an attribute typo) was printed as a one-line "harness error"
blaming the user's input, with no traceback to find it by. They now catch k3load.loadgen.inputs.STARTUP_ERRORS:
an InputError (every bad file or option, the target at --host), a run directory in use, an OSError of a path the
user named. Anything else is a bug: its traceback is printed whole and the run fails without a verdict (raised on,
Locust would log it and judge a run that never started). The end-to-end cases (the real command, one line, exit 2)
are in tests/sim/test_harness_errors.py.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from k3load.loadgen import listeners
from k3load.loadgen.inputs import BUG_AT_START
from k3load.loadgen.role import ProcessRole
from k3load.loadgen.shape import PlanShape
from k3load.loadgen.target import TargetUnusable
from k3load.rundir_lock import RunDirBusy
from k3load.workload.scenario import ScenarioError

SAID_AS_ONE_LINE = [
    ScenarioError("scenarios/broken.yaml:3:7: turns[0].content: must be a string"),
    TargetUnusable("the server at http://127.0.0.1:9 does not answer /v1/models (ConnectError): is it running?"),
    RunDirBusy("runs/r1 is in use by run r0 (pid 1 on host)"),
    OSError(errno.ENOSPC, "No space left on device", "runs/r1/run.json"),
]
BUGS = [TypeError("cannot unpack non-iterable NoneType object"), AttributeError("'Plan' object has no attribute"),
        KeyError("max_drain_s"), RuntimeError("a bug of ours"), ValueError("invalid literal for int()")]


def _session(raises: BaseException) -> tuple[SimpleNamespace, list[str]]:
    said: list[str] = []

    def start() -> None:
        raise raises

    session = SimpleNamespace(role=ProcessRole.LOCAL, fatal="", ensure_started=start, fail=said.append, link=None,
                              manual=SimpleNamespace(active=False, stages=[]), run=None, finished=False)
    return session, said


def _test_start(session: SimpleNamespace) -> None:
    listeners._on_test_start(SimpleNamespace(k3_session=session, parsed_options=SimpleNamespace()))


def _tick(session: SimpleNamespace) -> Any:
    shape = PlanShape()
    shape.runner = SimpleNamespace(environment=SimpleNamespace(k3_session=session))  # type: ignore[assignment]
    return shape.tick()


@pytest.mark.parametrize("start", [_test_start, _tick], ids=["test_start", "shape_tick"])
@pytest.mark.parametrize("error", SAID_AS_ONE_LINE, ids=lambda e: type(e).__name__)
def test_the_users_error_at_start_is_said_once_as_one_line(start: Callable[[SimpleNamespace], Any],
                                                           error: Exception) -> None:
    session, said = _session(error)
    assert start(session) is None  # no raise: the run ends cleanly, exit 2 at quitting
    assert said == [str(error)]


@pytest.mark.parametrize("start", [_test_start, _tick], ids=["test_start", "shape_tick"])
@pytest.mark.parametrize("bug", BUGS, ids=lambda e: type(e).__name__)
def test_a_bug_at_start_keeps_its_traceback_and_ends_the_run_without_a_verdict(
        start: Callable[[SimpleNamespace], Any], bug: Exception, capsys: pytest.CaptureFixture[str]) -> None:
    session, said = _session(bug)
    assert start(session) is None  # not raised into Locust, which would go on and judge an empty run
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and f"{type(bug).__name__}: " in err
    assert said == [f"{BUG_AT_START}: {type(bug).__name__}: {bug}"]  # a bug of ours, never the user's input
