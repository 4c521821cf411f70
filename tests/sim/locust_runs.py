"""Running `locust -f locustfiles/agent.py` from a test: the command line, a plan file, the run in its own
process group (killed whole at the end, so no worker outlives its test), and the checks every whole run
shares (the verdict's exit codes, one record per request the server served). Shared by the sim tests that
start real Locust runs; kept out of any test module so importing it collects no tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from k3load.evidence import lines
from tests.probes import Target, scrape, total

ROOT = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, stages: list[dict]) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"name": "test", "stages": stages}))
    return path


SHORT_PLAN = [
    {"name": "prefix-control", "kind": "prefix_control", "duration_s": 3, "users": 1, "mix": {"shared_prefix": 1},
     "iterations_per_user": 1},
    {"name": "load", "kind": "load", "duration_s": 4, "users": 4, "mix": {"agent": 3, "shared_prefix": 1}},
    {"name": "long-input", "kind": "long_input", "duration_s": 3, "users": 1, "mix": {"long_input": 1}},
    {"name": "ramp", "kind": "concurrency", "duration_s": 2, "steps": [2, 6], "mix": {"agent": 1, "cold": 1}},
    {"name": "soak", "kind": "soak", "duration_s": 4, "users": 6,
     "mix": {"agent": 2, "shared_prefix": 1, "cold": 1, "long_input": 1}},
]


def locust_cmd(host: str, out: Path, plan: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
            "--host", host, "--k3-out", str(out), "--k3-plan", str(plan), "--stop-timeout", "10",
            "--csv", str(out / "locust"), "--only-summary", "--k3-recipe", "recipes/local-dev.yaml", *extra]


def run_locust(host: str, out: Path, plan: Path, *extra: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    """The run in its own process group, killed whole at the end: no worker outlives its test."""
    cmd = locust_cmd(host, out, plan, *extra)
    with _locust_group(cmd, subprocess.PIPE) as proc:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@contextlib.contextmanager
def _locust_group(cmd: list[str], stdout: Any, stderr: Any = subprocess.PIPE, cwd: Path = ROOT
                  ) -> Iterator[subprocess.Popen]:
    """Popen in a new session; at exit SIGKILL to the whole group (workers of --processes included)."""
    import signal

    proc = subprocess.Popen(cmd, cwd=cwd, stdout=stdout, stderr=stderr, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _processes(count: int) -> list[str]:
    """--processes on a free master port, never Locust's default 5557: no other run's workers join."""
    port = str(_free_port())
    return ["--processes", str(count), "--master-bind-port", port, "--master-port", port]


VERDICT_CODES = (0, 3, 4, 5)  # go, limited, rebuild, scale_up: the run itself completed (1, 2: harness errors)


def _assert_each_served_request_recorded_once(attempts: list, sim) -> None:
    """No loss, no duplicate: one record per request the server saw. A timeout drill's 1 ms deadline may
    expire before its request reaches the server, so those may be recorded without being served."""
    assert len({a.attempt_id for a in attempts}) == len(attempts)
    early = sum(1 for a in attempts if a.drill and a.status == "timeout")
    assert _served(sim) <= len(attempts) <= _served(sim) + early


def _served(sim) -> int:
    """Requests the sim finished (every reason, aborts included): the server's own count of attempts."""
    with httpx.Client(timeout=10) as client:
        return int(total(scrape(Target("sim", sim.base_url, "tiny"), client), "vllm:request_success_total"))


def _lines(path: Path) -> int:
    """Whole lines flushed so far (a compressed log's reach the file at least every half second)."""
    return sum(line.endswith("\n") for line in lines(path)) if path.exists() else 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
