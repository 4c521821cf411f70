"""The rows of the reliability matrix (test_reliability_matrix.py) and how one is run: each row is a server or
an input that a new user meets, run through the real command, `locust -f locustfiles/agent.py --headless`.

The servers are real, on loopback: tests/sim/secrets_echo.py's echo server (it repeats the secrets in every
body it sends and refuses a request without the key), made hostile per row: lone surrogate escapes,
a 50 MB body, a 50 MB SSE line, broken SSE and tool JSON, 429 with Retry-After, a /health that says 503
while chat works, a harness killed with SIGKILL mid-run and judged afterwards; and the inputs that must
stop a run before any load (a YAML error, a bad recipe, a server that is not there). A row's run is
launched from a plain interpreter that reports the harness's peak memory (the kernel's figure, from wait4).
No tests here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3load.evidence import lines, records_file
from tests.sim.locust_runs import locust_cmd
from tests.sim.secrets_echo import GATEWAY_HEADER, KEY, EchoHandler, EchoServer, _completion, _sse
from tests.sim.test_reliability_client import SURROGATE_BODY, SURROGATE_CHUNKS

ROOT = Path(__file__).resolve().parents[2]
BIG = 50 * 1024 * 1024  # the 50 MB: over the 8 MiB body cap and the 1 MiB line cap
STAGE = {"name": "load", "kind": "load", "duration_s": 5, "users": 2, "mix": {"agent": 1}}
PLAIN_SCENARIO = {  # one non-streamed turn: the only way a shipped run asks for a whole JSON body
    "name": "plain_answer", "family": "agent", "description": "A non-streamed answer (reliability matrix).",
    "system_prompt": "You are terse.", "defaults": {"stream": False, "max_tokens": 16},
    "turns": [{"user": "Say hello.", "expect": {"kind": "any"}}]}


# -- what a hostile server sends ----------------------------------------------------------------------
Answer = tuple[int, str, bytes, dict[str, str]]  # status, content type, body, extra headers


def _sse_lines(*texts: str) -> bytes:
    return b"".join(b"data: " + t.encode() + b"\n\n" for t in texts)


@functools.cache
def _big_body() -> bytes:
    """A completion whose content alone is 50 MB: valid JSON, far over the body cap."""
    head = json.dumps(_completion("")).encode()
    return head.replace(b'"content": ""', b'"content": "' + b"x" * BIG + b'"')


@functools.cache
def _big_line() -> bytes:
    """A stream whose second event is one 50 MB line, then a proper end."""
    chunk = '{"id":"c1","choices":[{"index":0,"delta":{"content":"%s"}}]}'
    return (_sse_lines(chunk % "") + b"data: " + (chunk % ("y" * BIG)).encode() + b"\n\n"
            + _sse_lines(chunk % "end", "[DONE]"))


GARBLED = (  # held before issue 11; kept so that they keep holding
    _sse_lines('{"id":"c1","choices":[{"index":0,"delta":{"content":"half'),  # cut JSON, then the end
    _sse_lines('{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t1","type":"function",'
               '"function":{"name":"get_weather","arguments":"{\\"city\\": "}}]}}]}',
               '{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}', "[DONE]"),
)


def _surrogates(n: int, request: dict[str, Any]) -> Answer:
    if request.get("stream"):
        return 200, "text/event-stream", _sse_lines(*SURROGATE_CHUNKS, "[DONE]"), {}
    return 200, "application/json", SURROGATE_BODY.encode(), {}


def _echo(n: int, request: dict[str, Any], text: str) -> Answer:
    if n % 3 == 0:  # EchoHandler's error body, key included
        error = {"error": {"message": f"upstream: {text}", "code": 500}}
        return 500, "application/json", json.dumps(error).encode(), {}
    if request.get("stream"):
        return 200, "text/event-stream", _sse(f"echo {text}"), {}
    return 200, "application/json", json.dumps(_completion(f"echo {text}")).encode(), {}


def _retry_after(n: int, request: dict[str, Any], text: str) -> Answer:
    if n % 2 == 0:
        return 429, "application/json", b'{"error": {"message": "slow down", "code": 429}}', {"Retry-After": "1"}
    return _echo(1, request, text)


CHAT: dict[str, Callable[..., Answer]] = {
    "echo": _echo,
    "surrogates": lambda n, request, text: _surrogates(n, request),
    "body_50mb": lambda n, request, text: (200, "application/json", _big_body(), {}),
    "line_50mb": lambda n, request, text: (200, "text/event-stream", _big_line(), {}),
    "garbled": lambda n, request, text: (200, "text/event-stream", GARBLED[n % 2], {}),
    "retry_after": _retry_after,
}


class HostileHandler(EchoHandler):
    """EchoHandler (the key echoed, refused without it) with the row's chat answers and /health."""

    server: HostileServer

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/health" and self.server.health_status != 200:
            if self._keyed():
                self._send(self.server.health_status, b"unhealthy", "text/plain")
            return
        super().do_GET()

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            super().do_POST()
            return
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self._keyed():
            return
        with self.server.lock:
            self.server.chats += 1
            n = self.server.chats
        status, content_type, body, headers = CHAT[self.server.chat](n, request, self._echo())
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        with contextlib.suppress(OSError):  # a client that gave up on a 50 MB body hangs up: its choice
            self.wfile.write(body)
        self.server.answered.append(time.time())


class HostileServer(EchoServer):
    def __init__(self, chat: str, health_status: int = 200) -> None:
        self.chat, self.health_status, self.lock = chat, health_status, threading.Lock()
        self.answered: list[float] = []  # when each chat answer was sent (wall clock)
        super().__init__()
        self.RequestHandlerClass = HostileHandler


# -- the rows -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One case: the server's behaviour, what the harness is given, and what the run must end with."""

    chat: str | None = "echo"  # CHAT key; None: no server at all (a refused port)
    health_status: int = 200
    scenario: dict[str, Any] | None = None  # a scenario of the test's own instead of the shipped ones
    breaks: str | None = None  # "scenario_yaml" or "recipe": an input the harness must refuse
    kill_after_records: int = 0  # > 0: SIGKILL the harness once this many records are on disk
    exit_code: int | None = None  # None: the code of the verdict the run wrote
    statuses: frozenset[str] = frozenset()  # record statuses that must appear
    error_has: tuple[str, ...] = ()  # words one failed record's error must carry


ROWS: dict[str, Row] = {
    "surrogates": Row(chat="surrogates"),
    "body_50mb": Row(chat="body_50mb", scenario=PLAIN_SCENARIO, statuses=frozenset({"malformed"}),
                     error_has=("body over", "sha256")),
    "line_50mb": Row(chat="line_50mb", statuses=frozenset({"malformed"}), error_has=("line", "sha256")),
    "garbled_sse_and_tool_json": Row(chat="garbled", statuses=frozenset({"malformed", "invalid"})),
    "echoed_key": Row(chat="echo", statuses=frozenset({"http_error"})),
    "retry_after": Row(chat="retry_after", statuses=frozenset({"http_error"})),
    "health_503_while_serving": Row(chat="echo", health_status=503),
    "harness_killed": Row(chat="echo", kill_after_records=20),
    "scenario_yaml_error": Row(breaks="scenario_yaml", exit_code=2),
    "bad_recipe": Row(breaks="recipe", exit_code=2),
    "server_not_there": Row(chat=None, exit_code=2),
}


@dataclass
class Outcome:
    row: Row
    out: Path
    returncode: int
    console: str
    peak_rss_mib: float
    chats: int
    seen: list[tuple[Any, ...]]
    analyzed: str = ""  # `k3load analyze` output, for a run judged after the harness was killed
    killed_ts: float | None = None  # when the harness was SIGKILLed (wall clock)
    answered: list[float] = field(default_factory=list)  # when the server sent each chat answer


def _free_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing listens there


def _inputs(row: Row, d: Path) -> list[str]:
    """The row's broken or extra input files, as options."""
    if row.breaks == "scenario_yaml":
        (d / "scen").mkdir()
        (d / "scen" / "broken.yaml").write_text("name: broken\nfamily: agent\n  oops: [\n")
        return ["--k3-scenarios", str(d / "scen" / "*.yaml")]
    if row.breaks == "recipe":
        (d / "recipe.yaml").write_text("format: 1\nname: local-dev\n  production: false\n")
        return ["--k3-recipe", str(d / "recipe.yaml")]
    if row.scenario is not None:
        (d / "scen").mkdir()
        (d / "scen" / "plain.yaml").write_text(yaml.safe_dump(row.scenario, sort_keys=False))
        return ["--k3-scenarios", str(d / "scen" / "*.yaml")]
    return []


# A launcher in a plain interpreter: in pytest, Locust's plugin has gevent patch os and reap every child on
# SIGCHLD, so wait4 here would find none. The launcher waits for the command and writes its peak RSS (KiB).
LAUNCH = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, s, u = os.wait4(p.pid, 0); "
          "open(sys.argv[1], 'w').write(str(u.ru_maxrss)); sys.exit(os.waitstatus_to_exitcode(s))")


def _launch(cmd: list[str], d: Path, name: str, env: dict[str, str]) -> subprocess.Popen:
    with open(d / f"{name}.console", "w") as console:
        return subprocess.Popen([sys.executable, "-c", LAUNCH, str(d / f"{name}.rss"), *cmd], cwd=ROOT, env=env,
                                stdout=console, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, d: Path, name: str, timeout_s: float) -> tuple[int, float, str]:
    """Exit code, peak RSS in MiB (0 when the command was killed) and console of a launched command."""
    try:
        proc.wait(timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    rss = d / f"{name}.rss"
    peak = int(rss.read_text()) / 1024 if rss.exists() else 0.0
    return proc.returncode, peak, (d / f"{name}.console").read_text(errors="replace")


def _records_on_disk(out: Path) -> int:
    try:
        return sum(line.endswith("\n") for line in lines(records_file(out)))
    except (OSError, ValueError):
        return 0


def _run_row(name: str, row: Row, base: Path) -> Outcome:
    d = base / name
    d.mkdir()
    (d / "plan.yaml").write_text(yaml.safe_dump({"name": name, "stages": [
        {**STAGE, "duration_s": 60} if row.kill_after_records else STAGE]}))
    server = HostileServer(row.chat, row.health_status) if row.chat else None
    out = d / "run"
    cmd = [*locust_cmd(server.url if server else _free_url(), out, d / "plan.yaml"), "--k3-header", GATEWAY_HEADER,
           *_inputs(row, d)]
    env = {**os.environ, "K3_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
    killed_ts: float | None = None
    try:
        proc = _launch(cmd, d, "locust", env)
        if row.kill_after_records:
            deadline = time.monotonic() + 90
            while _records_on_disk(out) < row.kill_after_records and time.monotonic() < deadline:
                time.sleep(0.05)
            killed_ts = time.time()
            os.killpg(proc.pid, signal.SIGKILL)
        rc, peak, console = _finish(proc, d, "locust", 240)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    outcome = Outcome(row, out, rc, console, peak, server.chats if server else 0, list(server.seen) if server else [],
                      killed_ts=killed_ts,
                      answered=list(server.answered) if server else [])
    if row.kill_after_records:  # judged afterwards: the memory is the judging's, the code the verdict's
        outcome.returncode, outcome.peak_rss_mib, outcome.analyzed = _finish(
            _launch([sys.executable, "-m", "k3load", "analyze", str(out)], d, "analyze", env), d, "analyze", 180)
        outcome.console += outcome.analyzed
    return outcome
