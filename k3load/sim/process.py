"""Start `k3load sim` as a child process and learn its URL: used by tests, demos and the harness.

Why a process and not a thread: the sim is an asyncio server and the harness runs under gevent;
a separate process keeps both event loops honest and lets a test kill the server (as a crash).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

_URL = re.compile(r"listening on (http://\S+)")
_METRICS_URL = re.compile(r"metrics on (http://\S+/metrics)")


class SimProcess:
    """A running `k3load sim`; `stop()` (or the context manager) ends it and collects its log.

    `base_url` is the API's address; `metrics_url` the second listener's /metrics URL when started
    with `--metrics-port` (-1 picks a free port), else "". Its line comes before the API's line.
    """

    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 30.0) -> None:
        self.args = ["--port", "0", *args]
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.base_url = ""
        self.metrics_url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> SimProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "k3load", "sim", *self.args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            match = _URL.search(text)
            if match:
                self.base_url = match.group(1)
                metrics = _METRICS_URL.search(text)
                self.metrics_url = metrics.group(1) if metrics else ""
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"k3load sim did not start: {self.log_path.read_text(errors='replace')[-2000:]}")

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.returncode

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
