"""Secrets and reach (issue 11, point 3): the API key and gateway header values never reach a file of
the run directory nor the console, whatever the server echoes; they go on every request to the target
that needs them (/v1/models, /tokenize, /version, chat, and /health, /metrics on the same origin); an
https target is reached with a private CA (--k3-ca-bundle) or without verification (--k3-insecure).

The servers are real, on loopback: an echo server that repeats the Authorization and X-Gateway-Token
headers in every body it sends (401 pages, /version, /tokenize, /metrics labels, chat answers and chat
error bodies), served over plain HTTP or over TLS with a CA made here by the `openssl` command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from k3load.client import result as res
from k3load.client.access import REDACTED, Secrets, Tls, env_headers, header_lines, parse_header
from k3load.client.chat import ChatClient
from k3load.client.transport import TRANSPORTS
from k3load.evidence import lines, records_file
from k3load.loadgen.inputs import HarnessError, check_options
from k3load.loadgen.observe import Restarter
from k3load.loadgen.options import header, public_options
from k3load.precheck import run_precheck
from k3load.precheck.evidence import redact_body
from k3load.private_files import exposed
from k3load.rundir import JsonlLog, redact_in_files
from k3load.sampler.fetch import fetch
from k3load.sampler.logtail import LogTail
from tests.secret_scan import encodings, leaks
from tests.sim.locust_runs import VERDICT_CODES, _plan, run_locust

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "recipes" / "local-dev.yaml"
KEY = "sk-k3-SECRET-4f9a2c"
GATEWAY = "gw-SECRET-77d1"
GATEWAY_HEADER = f"X-Gateway-Token: {GATEWAY}"
SECRETS = (KEY, GATEWAY)
ONE_STAGE = [{"name": "load", "kind": "load", "duration_s": 4, "users": 2, "mix": {"agent": 1}}]
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


# -- the echo server --------------------------------------------------------------------------------
class EchoHandler(BaseHTTPRequestHandler):
    """Every body repeats the request's secrets; the API refuses a request without the key (401)."""

    protocol_version = "HTTP/1.1"
    server: EchoServer

    def log_message(self, *args: Any) -> None:  # quiet: the test asserts on the console of the run only
        pass

    def _echo(self) -> str:
        """The secrets as received, and each in every form a server may echo it (JSON escapes, percent,
        base64 of user:key; tests/secret_scan.py's `encodings`)."""
        auth, gateway = self.headers.get("Authorization"), self.headers.get("X-Gateway-Token")
        forms = [form for value in ((auth or "").removeprefix("Bearer "), gateway or "") if value
                 for form in encodings(value).values()]
        return f"Authorization={auth!r} X-Gateway-Token={gateway!r} forms={' '.join(forms)}"

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _keyed(self) -> bool:
        path = self.path.split("?")[0]
        self.server.seen.append((self.command, path, self.headers.get("Authorization"),
                                 self.headers.get("X-Gateway-Token")))
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self._send(401, json.dumps({"error": {"message": f"bad key: {self._echo()}", "code": 401}}).encode())
        return False

    def do_GET(self) -> None:
        if not self._keyed():
            return
        path = self.path.split("?")[0]
        if path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "echo", "object": "model",
                                        "max_model_len": 4096, "owned_by": self._echo()}]}).encode())
        elif path == "/version":  # the key also hidden behind JSON escapes: \u0073k-...
            hidden = "".join(f"\\u{ord(c):04x}" for c in KEY)
            self._send(200, b'{"version": "0.32.0", "echo": ' + json.dumps(self._echo()).encode()
                       + b', "escaped": "' + hidden.encode() + b'"}')
        elif path == "/health":
            self._send(200, f"ok {self._echo()}".encode(), "text/plain")
        elif path == "/metrics":
            label = f"{self.headers.get('Authorization')} {self.headers.get('X-Gateway-Token')}"
            text = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
                    f"# TYPE echo_info gauge\necho_info{{echo=\"{label}\"}} 1\n")
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, f"no {path}: {self._echo()}".encode(), "text/plain")

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self._keyed():
            return
        if self.path == "/tokenize":
            self._send(200, json.dumps({"count": len(request.get("prompt", "")) // 4 + 1, "echo": self._echo()})
                       .encode())
            return
        self.server.chats += 1
        if self.server.chats % 3 == 0:
            self._send(500, json.dumps({"error": {"message": f"upstream: {self._echo()}", "type": "Internal",
                                                  "code": 500}}).encode())
        elif request.get("stream"):
            self._send(200, _sse(f"echo {self._echo()}"), "text/event-stream")
        else:
            self._send(200, json.dumps(_completion(f"echo {self._echo()}")).encode())


def _completion(text: str) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion", "model": "echo", "created": 0,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def _sse(text: str) -> bytes:
    base = {"id": "c1", "object": "chat.completion.chunk", "model": "echo", "created": 0}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {**base, "choices": [{"index": 0, "delta": {"content": text}}]},
              {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class EchoServer(ThreadingHTTPServer):
    """On a free loopback port; with `tls`, each connection's handshake runs in its own handler thread."""

    daemon_threads = True

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), EchoHandler)
        self.tls, self.seen, self.chats = tls, [], 0
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:
            request = self.tls.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that refuses our certificate hangs up mid-handshake: expected here

    def paths_with(self, header: int, value: str) -> set[str]:
        """Paths requested with this header value (2: Authorization, 3: X-Gateway-Token)."""
        return {s[1] for s in self.seen if s[header] == value}


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A CA and a server certificate for 127.0.0.1 signed by it (EC keys: quick to make)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
        "-subj", "/CN=k3load test CA", "-keyout", "ca.key", "-out", "ca.pem",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                               "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                               "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-out", "server.pem", "-extfile", "ext.cnf")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(d / "server.pem", d / "server.key")
    return SimpleNamespace(ca=str(d / "ca.pem"), server_ctx=server_ctx)


@pytest.fixture
def tls_echo(certs: SimpleNamespace) -> Iterator[EchoServer]:
    server = EchoServer(certs.server_ctx)
    yield server
    server.shutdown()
    server.server_close()


def _leaks(run_dir: Path, *texts: str) -> list[str]:
    """Where a secret can be read back, in any form (tests/secret_scan.py): files under the run directory
    (any bytes, compressed ones inflated), and the given console texts."""
    found = [f"{p.relative_to(run_dir)}: {s}" for p in sorted(run_dir.rglob("*")) if p.is_file()
             for s in SECRETS if leaks("".join(lines(p, errors="replace")), s)]
    return found + [f"console: {s}" for text in texts for s in SECRETS if leaks(text, s)]


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


# -- TLS at the client and the sampler --------------------------------------------------------------
@needs_openssl
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_chat_client_over_tls_with_the_test_ca_without_it_and_insecure(tls_echo: EchoServer, certs: SimpleNamespace,
                                                                       transport: str) -> None:
    secrets = Secrets.parse(KEY, [GATEWAY_HEADER])
    body = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    got = {}
    for name, tls in (("default", None), ("ca", Tls(ca_bundle=certs.ca)), ("insecure", Tls(insecure=True))):
        with ChatClient(tls_echo.url, transport=transport, secrets=secrets, tls=tls) as client:
            got[name] = client.send(body, 10.0)
    assert got["default"].status == res.STATUS_TRANSPORT_ERROR and "CERTIFICATE_VERIFY_FAILED" in got["default"].error
    for name in ("ca", "insecure"):
        r = got[name]
        assert r.status == res.STATUS_OK and r.content.startswith("echo ") and REDACTED in r.content, (name, r)
        assert KEY not in repr(vars(r)) and GATEWAY not in repr(vars(r))
    assert tls_echo.paths_with(3, GATEWAY) == {"/v1/chat/completions"}


@needs_openssl
def test_sampler_fetch_over_tls_and_its_redacted_bodies(tls_echo: EchoServer, certs: SimpleNamespace) -> None:
    url = tls_echo.url + "/health"
    refused = fetch(url, 5.0, KEY)
    assert not refused.ok and "CERTIFICATE_VERIFY_FAILED" in (refused.error or "")
    for tls in (Tls(ca_bundle=certs.ca), Tls(insecure=True)):
        got = fetch(url, 5.0, KEY, headers={"X-Gateway-Token": GATEWAY}, context=tls.context(cooperative=True))
        assert got.ok and got.body.startswith("ok ") and REDACTED in got.body and KEY not in got.body, got
        assert GATEWAY not in got.body
    unkeyed = fetch(tls_echo.url + "/version", 5.0, context=Tls(ca_bundle=certs.ca).context(cooperative=True))
    assert unkeyed.status == 401 and "None" in unkeyed.body  # nothing sent, nothing to redact


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
def _k3load(*args: str, timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "K3_API_KEY": KEY, **(env or {})}
    return subprocess.run([sys.executable, "-m", "k3load", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


@needs_openssl
def test_precheck_and_sample_commands_reach_a_tls_gateway_with_its_header_and_write_no_secret(
        tls_echo: EchoServer, certs: SimpleNamespace, tmp_path: Path) -> None:
    access = ["--header", GATEWAY_HEADER, "--ca-bundle", certs.ca]
    pre = _k3load("precheck", "--recipe", str(LOCAL), "--base-url", tls_echo.url, "--no-nvml", *access,
                  "--out", str(tmp_path / "pre"))
    assert pre.returncode in (0, 2), pre.stderr  # pass or inconclusive (no startup log): it ran
    reachable = next(r for r in json.loads((tmp_path / "pre" / "compat.json").read_text())["rules"]
                     if r["id"] == "server_reachable")
    assert reachable["status"] == "pass", reachable
    sample = _k3load("sample", "--metrics-url", f"{tls_echo.url}/metrics", "--nvml", "off", "--interval", "0.2",
                     "--duration", "1", *access, "--out", str(tmp_path / "sample"))
    assert sample.returncode == 0, sample.stderr
    assert "0 failed" in sample.stdout and "health transitions" in sample.stdout, sample.stdout
    keyed = tls_echo.paths_with(2, f"Bearer {KEY}") & tls_echo.paths_with(3, GATEWAY)
    assert {"/version", "/v1/models", "/metrics", "/health"} <= keyed, tls_echo.seen
    assert {s[1] for s in tls_echo.seen} == keyed  # nothing went without the key and the header
    assert not _leaks(tmp_path, pre.stdout, pre.stderr, sample.stdout, sample.stderr)


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


# -- whole runs (the run against the echoing server is a row of tests/sim/test_reliability_matrix.py) -----
@needs_openssl
def test_a_run_against_an_untrusted_tls_server_is_one_harness_error_line(tls_echo: EchoServer,
                                                                         tmp_path: Path) -> None:
    run = run_locust(tls_echo.url, tmp_path / "run", _plan(tmp_path, ONE_STAGE), "--k3-api-key", KEY, timeout_s=90)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "harness error" in line]
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
    assert "/v1/models" in lines[0] and "--k3-ca-bundle" in lines[0] and "--k3-insecure" in lines[0]
    assert not (tmp_path / "run" / "verdict.json").exists() and not _leaks(tmp_path, run.stdout, run.stderr)


@needs_openssl
@pytest.mark.slow
@pytest.mark.parametrize("trust", ["ca-bundle", "insecure"])
def test_a_run_against_a_tls_server_with_its_ca_or_insecure(tls_echo: EchoServer, certs: SimpleNamespace,
                                                            tmp_path: Path, trust: str) -> None:
    out = tmp_path / "run"
    extra = ["--k3-ca-bundle", certs.ca] if trust == "ca-bundle" else ["--k3-insecure"]
    run = run_locust(tls_echo.url, out, _plan(tmp_path, ONE_STAGE), "--k3-api-key", KEY, *extra, timeout_s=240)
    assert run.returncode in VERDICT_CODES, run.stderr[-3000:]
    records = [json.loads(line) for line in lines(records_file(out))]
    assert sum(r["status"] == "ok" for r in records) >= 2, [(r["status"], r["error"]) for r in records[:5]]
    info = json.loads((out / "run.json").read_text())
    off = "TLS certificate verification is OFF" in run.stderr
    assert info["tls"] == {"verify": trust != "insecure", "ca_bundle": certs.ca if trust == "ca-bundle" else None}
    assert off == (trust == "insecure") and not _leaks(out, run.stdout, run.stderr)
    compat = json.loads((out / "compat.json").read_text())
    reachable = next(r for r in compat["rules"] if r["id"] == "server_reachable")
    assert reachable["status"] == "pass", reachable
