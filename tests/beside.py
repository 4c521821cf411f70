"""Sim modules that mostly wait, run by a second pytest beside the main session (`make test` only).

Why: CI has two cores and 45 minutes, and the suite left them idle 46% of its 46 minutes on this machine
(vmstat beside a clean-clone `make test`, Dec 7 2026): the sim tier waits on sims paced in model time,
on subprocesses starting and on stage clocks. The modules below were the most idle of it (58-90% of
both cores idle while each ran, 630 s together); run beside the rest of the sim tier, the cores do both.
The main session deselects them and, at its first sim test, starts `python -m pytest` on their files
with its own mark expression; it waits for that run at its end, shows its summary and fails when it
failed, so `make test` still exits non-zero on any failure. Only a whole-suite run with
`K3LOAD_BESIDE=1` (the Makefile's `test`) splits; `pytest tests/sim/...` or any `-k` run is as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = "K3LOAD_BESIDE"  # "1": split this run; "child": the run beside (never splits again)
OK = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)  # none selected by the marks is no failure
WAIT_S = 1800  # the run beside takes about 11 minutes; past this it is stopped and counted failed
# Measured idle share of both cores while each ran, in the last clean-clone run: 58-90%.
BESIDE = ("tests/sim/test_search_sim.py", "tests/sim/test_verdicts.py", "tests/sim/test_replicas_nginx.py",
          "tests/sim/test_locust_run_processes.py", "tests/sim/test_webui.py", "tests/sim/test_report_browser.py",
          "tests/sim/test_client_chat_sim.py", "tests/sim/test_cache_pairs.py", "tests/sim/test_secrets_tls.py",
          "tests/sim/test_drain_audit.py", "tests/sim/test_arrivals_sim.py", "tests/sim/test_traffic_bfcl.py",
          "tests/sim/test_reuse.py", "tests/sim/test_handover.py", "tests/sim/test_secrets.py",
          "tests/sim/test_signing.py", "tests/sim/test_sampler_sources.py", "tests/sim/test_demo.py",
          "tests/sim/test_client_done.py")


class Beside:
    """The run beside: which files, its process once started, its log."""

    def __init__(self, config: pytest.Config, files: list[str]) -> None:
        self.config, self.files = config, files
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(config.rootpath) / ".pytest-beside.log"

    def start(self) -> None:
        if self.proc is not None or not self.files:
            return
        marks = ["-m", self.config.option.markexpr] if self.config.option.markexpr else []
        args = [sys.executable, "-m", "pytest", *self.files, *marks, "-p", "no:cacheprovider", "--durations=15"]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(args, cwd=self.config.rootpath, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, ENV: "child"})

    def finish(self) -> int:
        """Wait for the run beside (start it now if the main session never reached the sim tier): its exit
        code, 1 when it had to be stopped."""
        self.start()
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=WAIT_S)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            self.proc.kill()
            self.proc.wait()
            return 1


_beside: list[Beside] = []


def _whole_suite(config: pytest.Config) -> bool:
    return os.environ.get(ENV) == "1" and not config.option.keyword and \
        config.args_source == pytest.Config.ArgsSource.TESTPATHS


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _whole_suite(config):
        return
    beside = [item for item in items if item.nodeid.split("::")[0] in BESIDE]
    if not beside:
        return
    items[:] = [item for item in items if item.nodeid.split("::")[0] not in BESIDE]
    config.hook.pytest_deselected(items=beside)
    _beside.append(Beside(config, sorted({item.nodeid.split("::")[0] for item in beside})))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _beside and item.nodeid.startswith("tests/sim/"):
        _beside[0].start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _beside:
        return
    beside = _beside.pop()
    code = beside.finish()
    text = beside.log.read_text(errors="replace")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", f"the run beside ({len(beside.files)} sim modules, {beside.log.name}): exit {code}")
        reporter.write(text[-12000:] if code not in OK else "\n".join(text.splitlines()[-40:]) + "\n")
    if code not in OK and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
