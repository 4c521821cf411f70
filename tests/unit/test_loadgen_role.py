"""The process role as a type: told from Locust's runner, its questions named once, written as the plain word."""

from __future__ import annotations

import json

from locust.runners import LocalRunner, MasterRunner, WorkerRunner

from k3load.loadgen.role import ProcessRole


def _bare(runner: type) -> object:
    """An instance of the runner's class, never started (and nothing for its __del__ to stop)."""
    return object.__new__(type(runner.__name__, (runner,), {"__del__": lambda self: None}))


def test_the_role_is_told_from_the_runner() -> None:
    assert ProcessRole.of(_bare(MasterRunner)) is ProcessRole.MASTER
    assert ProcessRole.of(_bare(WorkerRunner)) is ProcessRole.WORKER
    assert ProcessRole.of(_bare(LocalRunner)) is ProcessRole.LOCAL
    assert ProcessRole.of(None) is ProcessRole.LOCAL  # an Environment built in-process without a runner


def test_only_a_worker_owns_no_run() -> None:
    assert [r for r in ProcessRole if r.owns_run] == [ProcessRole.LOCAL, ProcessRole.MASTER]
    assert [r for r in ProcessRole if r.is_worker] == [ProcessRole.WORKER]
    assert [r for r in ProcessRole if r.is_master] == [ProcessRole.MASTER]


def test_the_role_is_written_as_before() -> None:
    """run_start's `role` and the console's process name read as the word they always did."""
    assert json.dumps({"role": ProcessRole.MASTER}) == '{"role": "master"}'
    assert f"{ProcessRole.WORKER} 12" == "worker 12" and ProcessRole.LOCAL == "local"
