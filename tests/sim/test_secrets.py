"""Secrets and reach (issue 11, point 3): the API key and gateway header values never reach a file of
the run directory nor the console, whatever the server echoes; they go on every request to the target
that needs them (/v1/models, /tokenize, /version, chat, and /health, /metrics on the same origin).

Here: the secrets' parsing and redaction, the options run.json keeps, the precheck against the echo server
(tests/sim/secrets_echo.py: it repeats the secrets in every body it sends), the restart and log commands'
output, headers from a file or the environment, and the `k3load` subcommands over plain HTTP. The same over
TLS (a private CA, --k3-ca-bundle, --k3-insecure) is in test_secrets_tls.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from k3load.client.access import REDACTED, Secrets, env_headers, header_lines, parse_header
from k3load.loadgen.inputs import HarnessError, check_options
from k3load.loadgen.observe import Restarter
from k3load.loadgen.options import header, public_options
from k3load.precheck import run_precheck
from k3load.precheck.evidence import redact_body
from k3load.private_files import exposed
from k3load.rundir import JsonlLog, redact_in_files
from k3load.sampler.logtail import LogTail
from tests.sim.secrets_echo import GATEWAY, GATEWAY_HEADER, KEY, LOCAL, ROOT, EchoServer, _k3load, _leaks


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.shutdown()
    server.server_close()


# -- units ------------------------------------------------------------------------------------------
def test_secrets_redact_values_and_their_json_form_and_never_show_in_errors_or_repr() -> None:
    secrets = Secrets.parse(KEY, [GATEWAY_HEADER, 'X-Quote: a"b'])
    assert secrets.request_headers() == {"Authorization": f"Bearer {KEY}", "X-Gateway-Token": GATEWAY,
                                         "X-Quote": 'a"b'}
    quoted = json.dumps('a"b')
    text = secrets.redact(f"Bearer {KEY} and {GATEWAY} and {quoted}")
    assert KEY not in text and GATEWAY not in text and 'a\\"b' not in text and text.count(REDACTED) == 3
    assert KEY not in repr(secrets) and "X-Gateway-Token" in repr(secrets)
    hidden = b'{"k": "' + "".join(f"\\u{ord(c):04x}" for c in KEY).encode() + b'"}'
    assert json.loads(redact_body(hidden, secrets)) == {"k": REDACTED}  # an escaped echo caught too
    for bad, words in ((f"X-Token {GATEWAY}", "Name: value"), (f"Bad Name: {GATEWAY}", "header name"),
                       (f"Host: {GATEWAY}", "harness itself"), (f"x-request-id: {GATEWAY}", "harness itself"),
                       (f"X-T: {GATEWAY}\r\nX-Evil: 1", "cannot carry")):
        with pytest.raises(ValueError) as err:
            parse_header(bad)
        assert words in str(err.value) and GATEWAY not in str(err.value)
    with pytest.raises(ValueError, match="give one"):
        Secrets.parse(KEY, [f"Authorization: Basic {GATEWAY}"])


def test_run_json_options_keep_header_names_and_command_programs_only_and_a_missing_ca_bundle_names_the_option(
        tmp_path: Path) -> None:
    opts = SimpleNamespace(k3_api_key=KEY, k3_header=[GATEWAY_HEADER, "X-Tenant: t-1\nX-Other: o-2"],
                           k3_ca_bundle="", k3_insecure=True,
                           k3_server_log_cmd=f"kubectl logs -f vllm-0 --token={GATEWAY}",
                           k3_restart_cmd=f"VLLM_API_KEY={KEY} systemctl restart vllm")
    shown = public_options(opts)
    assert shown["k3_header"] == ["X-Gateway-Token: ***", "X-Tenant: ***", "X-Other: ***"]
    assert shown["k3_api_key"] == "***" and "t-1" not in json.dumps(shown)
    assert shown["k3_server_log_cmd"] == "kubectl … (arguments withheld: they may hold tokens)"
    assert shown["k3_restart_cmd"] == "systemctl … (arguments withheld: they may hold tokens)"
    assert shown["k3_insecure"] is True and not _leaks(tmp_path, json.dumps(shown))
    base = dict(k3_sample_interval=1.0, k3_scrape_timeout=0.0, k3_max_restarts=3, k3_out=str(tmp_path / "out"),
                k3_recipe=str(LOCAL), k3_container_info="", k3_startup_log="", k3_custom_build="",
                k3_host_inventory=[], k3_api_key=KEY, k3_header=[], k3_insecure=False)
    for bundle, words in ((tmp_path / "nope.pem", "no such file"), (LOCAL, "not a PEM CA file")):
        with pytest.raises(HarnessError) as err:
            check_options(SimpleNamespace(**base, k3_ca_bundle=str(bundle)))
        assert str(err.value).startswith(f"--k3-ca-bundle {bundle}: {words}"), err.value


def test_the_precheck_sends_the_key_and_saves_the_echoing_bodies_redacted(echo: EchoServer, tmp_path: Path) -> None:
    """The bug of issue 11: /version's body, echoing the Authorization header, saved verbatim."""
    secrets = Secrets.parse(KEY, [GATEWAY_HEADER])
    compat = run_precheck(tmp_path / "run", LOCAL, echo.url, use_local_nvml=False, secrets=secrets)
    server = tmp_path / "run" / "evidence" / "server"
    version = json.loads((server / "version.json").read_text())
    assert version["version"] == "0.32.0" and REDACTED in version["echo"] and version["escaped"] == REDACTED
    assert REDACTED in (server / "models.json").read_text() and REDACTED in (server / "metrics.txt").read_text()
    assert not _leaks(tmp_path / "run", json.dumps(compat))
    assert {"/version", "/v1/models", "/metrics"} <= echo.paths_with(2, f"Bearer {KEY}") & echo.paths_with(3, GATEWAY)


def test_a_restart_commands_output_is_logged_redacted_and_outlives_the_harness_copy(tmp_path: Path) -> None:
    """The command prints the key it starts a server with; its log holds the line, redacted. The copier
    is a process of its own, so what the command prints after the Restarter is gone is logged too."""
    redact_in_files(Secrets.parse(KEY, [GATEWAY_HEADER]))
    restarter = Restarter(JsonlLog(tmp_path / "events.jsonl"), tmp_path,
                          f"echo serve --api-key {KEY} --header {GATEWAY}; sleep 0.5; echo later {KEY}", 1)
    restarter({"event": "server_down"})
    del restarter  # nothing of the harness side holds the output any more
    log = tmp_path / "restart-1.log"
    deadline = time.monotonic() + 20
    while "later" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.read_text() == f"serve --api-key {REDACTED} --header {REDACTED}\nlater {REDACTED}\n"
    assert not _leaks(tmp_path)


def test_a_log_command_that_cannot_run_is_named_by_its_program_only(tmp_path: Path) -> None:
    """`VLLM_API_KEY=... kubectl logs ...` has no shell to take the assignment: the OSError names the first
    word, the key; the event says the program and why."""
    events: list[dict[str, Any]] = []
    tail = LogTail(tmp_path / "server.log", lambda name, ts, **fields: events.append(fields), time.time,
                   cmd=f"VLLM_API_KEY={KEY} no-such-program-k3 logs --token={GATEWAY}")
    tail.start()
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.02)
    tail.stop()
    assert events[0]["error"] == ("FileNotFoundError: No such file or directory (no-such-program-k3 … (arguments "
                                  "withheld: they may hold tokens))"), events
    assert not _leaks(tmp_path, json.dumps(events))


def test_a_restarted_server_does_not_hold_the_harness_console_open(tmp_path: Path) -> None:
    """The restart command's server outlives the harness; neither it nor the log copier may keep the
    harness's stdout open (found by the real-server suite: the run's `communicate()` hung until its
    timeout while the restarted server lived)."""
    pidfile = tmp_path / "server.pid"
    code = (f"from pathlib import Path\n"
            f"from k3load.loadgen.observe import Restarter; from k3load.rundir import JsonlLog\n"
            f"d = Path({str(tmp_path)!r})\n"
            f"Restarter(JsonlLog(d / 'events.jsonl'), d, "
            f"'echo $$ > {pidfile}; echo up; exec sleep 30', 1)({{'event': 'server_down'}})\n"
            f"print('harness done')\n")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=25)
        assert "harness done" in out and time.monotonic() - started < 15, err
    finally:
        proc.kill()
        deadline = time.monotonic() + 5
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_headers_come_from_a_file_or_the_environment_and_errors_name_the_line_never_the_value(tmp_path: Path) -> None:
    """curl's `-H @FILE`: one header a line, blank lines and # comments skipped; K3_HEADER: one a line, or
    @FILE. A file's errors name the file and the line; no error repeats a value."""
    file = tmp_path / "headers"
    file.write_text(f"# the gateway's\n\n{GATEWAY_HEADER}\r\nX-Tenant: t-1\n")
    assert header_lines([f"@{file}"]) == [GATEWAY_HEADER, "X-Tenant: t-1"]
    assert Secrets.parse(KEY, [f"@{file}"]).request_headers()["X-Gateway-Token"] == GATEWAY
    assert header(f"@{file}") == f"{GATEWAY_HEADER}\nX-Tenant: t-1"  # --k3-header: what a worker is told
    assert env_headers({"K3_HEADER": f"{GATEWAY_HEADER}\nX-Tenant: t-1"}) == [f"{GATEWAY_HEADER}\nX-Tenant: t-1"]
    assert Secrets.parse(None, env_headers({"K3_HEADER": f"@{file}"})).headers[1] == ("X-Tenant", "t-1")
    assert env_headers({"K3_HEADER": " "}) == [] and env_headers({}) == []
    bad = tmp_path / "bad"
    for text, words in ((f"{GATEWAY_HEADER}\nX-Token {GATEWAY}\n", f"@{bad} line 2: must be 'Name: value'"),
                        (f"\nBearer {GATEWAY}: x\n", f"@{bad} line 2: the text before ':' is not an HTTP header"),
                        (f"X-Empty:\n{GATEWAY_HEADER}\n", f"@{bad} line 1: the value of X-Empty is empty")):
        bad.write_text(text)
        for call in (lambda: header_lines([f"@{bad}"]), lambda: header(f"@{bad}")):
            with pytest.raises((ValueError, argparse.ArgumentTypeError)) as err:
                call()
            assert str(err.value).startswith(words) and GATEWAY not in str(err.value), err.value
    for item, words in ((f"@{tmp_path / 'nope'}", f"@{tmp_path / 'nope'}: no such file"),
                        (f"Bearer {GATEWAY}: x", "the text before ':'"),
                        (f"{GATEWAY_HEADER}\nX {GATEWAY}", "line 2: must be 'Name: value'")):
        with pytest.raises(ValueError) as err:
            header_lines([item])
        assert str(err.value).startswith(words) and GATEWAY not in str(err.value), err.value


# -- the `k3load` subcommands that reach the target ---------------------------------------------------
def test_precheck_and_sample_take_the_gateway_header_from_a_file_or_K3_HEADER(echo: EchoServer,
                                                                               tmp_path: Path) -> None:
    """No value on the command line, where ps and /proc/PID/cmdline show it to every local user."""
    file = tmp_path / "headers"
    file.write_text(f"# gateway\n{GATEWAY_HEADER}\n")
    pre = _k3load("precheck", "--recipe", str(LOCAL), "--base-url", echo.url, "--no-nvml", "--header", f"@{file}",
                  "--out", str(tmp_path / "pre"))
    assert pre.returncode in (0, 2), pre.stderr
    assert {"/version", "/v1/models", "/metrics"} <= echo.paths_with(3, GATEWAY)
    echo.seen.clear()
    sample = _k3load("sample", "--metrics-url", f"{echo.url}/metrics", "--nvml", "off", "--interval", "0.2",
                     "--duration", "1", "--out", str(tmp_path / "sample"), env={"K3_HEADER": GATEWAY_HEADER})
    assert sample.returncode == 0 and "0 failed" in sample.stdout, sample.stderr
    assert {"/metrics", "/health"} <= echo.paths_with(3, GATEWAY) and {s[1] for s in echo.seen} == \
        echo.paths_with(3, GATEWAY)
    assert not _leaks(tmp_path / "pre", pre.stdout, pre.stderr) and not _leaks(tmp_path / "sample", sample.stdout,
                                                                                     sample.stderr)
    assert exposed(tmp_path / "pre") == [] and exposed(tmp_path / "sample") == []  # 0600 files, 0700 folders


@pytest.mark.parametrize(("command", "code"), [("precheck", 3), ("sample", 2)])
def test_the_subcommands_name_a_bad_access_option(tmp_path: Path, command: str, code: int) -> None:
    target = (["--recipe", str(LOCAL), "--base-url", "http://127.0.0.1:9", "--no-nvml"] if command == "precheck"
              else ["--metrics-url", "http://127.0.0.1:9/metrics"])
    bad_file = tmp_path / "headers"
    bad_file.write_text(f"{GATEWAY_HEADER}\n\nBad {GATEWAY}\n")
    for bad, line in ((["--ca-bundle", str(tmp_path / "nope.pem")], f"--ca-bundle {tmp_path / 'nope.pem'}: no such "
                       "file"), (["--header", f"X-Token {GATEWAY}"], "--header: must be 'Name: value'"),
                      (["--header", f"@{tmp_path / 'none'}"], f"--header: @{tmp_path / 'none'}: no such file"),
                      (["--header", f"@{bad_file}"], f"--header: @{bad_file} line 3: must be 'Name: value'")):
        done = _k3load(command, *target, *bad, "--out", str(tmp_path / command))
        assert done.returncode == code and done.stderr.strip() == f"k3load {command}: {line}", done.stderr
        assert not (tmp_path / command).exists() and GATEWAY not in done.stderr
    done = _k3load(command, *target, "--out", str(tmp_path / command), env={"K3_HEADER": f"X-Token {GATEWAY}"})
    assert done.returncode == code and done.stderr.strip() == f"k3load {command}: --header: must be 'Name: value'"
