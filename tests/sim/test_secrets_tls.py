"""Secrets and reach over TLS (issue 11, point 3): an https target is reached with a private CA
(--k3-ca-bundle) or without verification (--k3-insecure), and refused without either; the key and the gateway
header still go on every request and never reach a file or the console. The chat client (each transport),
the sampler's fetch, the `k3load` subcommands and whole Locust runs, against the echo server of
tests/sim/secrets_echo.py served over TLS with a CA made here by the `openssl` command (module-scoped: made
once for this file's tests). The plain-HTTP half is test_secrets.py.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3load.client import result as res
from k3load.client.access import REDACTED, Secrets, Tls
from k3load.client.chat import ChatClient
from k3load.client.transport import TRANSPORTS
from k3load.evidence import lines, records_file
from k3load.sampler.fetch import fetch
from tests.sim.locust_runs import VERDICT_CODES, _plan, run_locust
from tests.sim.secrets_echo import GATEWAY, GATEWAY_HEADER, KEY, LOCAL, EchoServer, _k3load, _leaks

ONE_STAGE = [{"name": "load", "kind": "load", "duration_s": 4, "users": 2, "mix": {"agent": 1}}]
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


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


# -- TLS at the client, the sampler and the `k3load` subcommands -------------------------------------
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
