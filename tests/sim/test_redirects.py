"""Credentials never follow a redirect to another origin (issue 36, items 4 and 6).

Two real servers on loopback, on their own ports: A answers every request with a redirect to B (or to a
path of its own), B records the headers of every request it gets. Whatever the harness asks A for — the
sampler's /metrics, /health, dcgm and Prometheus GETs, chat over both transports, /tokenize, the precheck's
/version, /v1/models and /metrics — B never sees the bearer key or the gateway header's value. Redirects
within A's origin keep them; an https -> http hop is refused; the sampler says each redirect once.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import random
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from k3load.client import result as res
from k3load.client.access import Secrets, Tls, gevent_patched
from k3load.client.chat import ChatClient
from k3load.client.origin import (
    BAD_SCHEME,
    DOWNGRADE,
    OTHER_ORIGIN,
    SAME_ORIGIN,
    is_loopback,
    origin,
    plain_http_warning,
    redirect_kind,
    redirect_note,
    same_origin,
)
from k3load.client.transport import TRANSPORTS
from k3load.events import Event
from k3load.precheck import PrecheckError, run_precheck
from k3load.precheck import cli as precheck_cli
from k3load.sampler import Sampler
from k3load.sampler import cli as sample_cli
from k3load.sampler.fetch import (
    CREDENTIALS_DROPPED,
    FOLLOWED,
    NOT_FOLLOWED,
    REFUSED_DOWNGRADE,
    REFUSED_SCHEME,
    Fetched,
    RedirectRefused,
    _Redirects,
    fetch,
)
from k3load.workload.reuse_design import TokenizerUnavailable, http_tokenizer
from tests.sim.test_event_catalogue import undeclared

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-k3-REDIRECT-9b1e"
GATEWAY = "gw-REDIRECT-5c3a"
SECRETS = Secrets.parse(KEY, [f"X-Gateway-Token: {GATEWAY}"])
METRICS = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
           "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
           "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0\n")
DCGM = '# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",Hostname="n1"} 1000\n'
MATRIX = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}})
Route = Callable[[str, str], tuple[int, dict[str, str], bytes]]  # (method, path) -> (status, headers, body)
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})


# -- the servers ----------------------------------------------------------------------------------------
class Handler(BaseHTTPRequestHandler):
    """Records every request; answers by the server's `route(method, path) -> (status, headers, body)`."""

    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.seen.append((self.command, self.path, dict(self.headers.items())))
        status, headers, body = self.server.route(self.command, self.path)
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


class Server(ThreadingHTTPServer):
    """On a free loopback port, in a thread (a greenlet under the tests' gevent patch)."""

    daemon_threads = True

    def __init__(self, route: Route, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.route, self.tls, self.seen = route, tls, []
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:
            request = self.tls.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def credentials_seen(self) -> list[str]:
        """Every request that carried the key or the gateway value in any header, as 'METHOD PATH'."""
        return [f"{method} {path}" for method, path, headers in self.seen
                if any(KEY in v or GATEWAY in v for v in headers.values())
                or any(name.lower() in ("authorization", "x-gateway-token") for name in headers)]

    def paths(self) -> list[str]:
        return [path.split("?", 1)[0] for _method, path, _headers in self.seen]

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def _recorder(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """B: what each endpoint would answer, so a followed redirect reads as a success."""
    path = path.split("?", 1)[0]
    if path.startswith("/api/v1/query_range"):
        return 200, {"Content-Type": "application/json"}, MATRIX.encode()
    if path.startswith("/dcgm"):
        return 200, {"Content-Type": "text/plain"}, DCGM.encode()
    if method == "POST":
        return 200, {"Content-Type": "application/json"}, b'{"tokens": [1, 2]}'
    return 200, {"Content-Type": "text/plain"}, (METRICS if path.endswith("metrics") else "ok").encode()


def _redirector(to: str, status: int = 302) -> Route:
    """A: every request sent on to `to` + its path and query."""
    return lambda _method, path: (status, {"Location": to + path}, b"moved")


@pytest.fixture
def b() -> Iterator[Server]:
    server = Server(_recorder)
    yield server
    server.close()


@pytest.fixture
def servers() -> Iterator[Callable[..., Server]]:
    made: list[Server] = []

    def make(route: Route, tls: ssl.SSLContext | None = None) -> Server:
        made.append(Server(route, tls))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture(scope="module")
def tls_server_context(tmp_path_factory: pytest.TempPathFactory) -> ssl.SSLContext:
    """A self-signed certificate for 127.0.0.1 (the client trusts nothing: Tls(insecure=True))."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", "key.pem", "-out", "cert.pem"], check=True, capture_output=True, cwd=d)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    return ctx


def _keyed_fetch(url: str, context: ssl.SSLContext | None = None) -> Fetched:
    return fetch(url, 5.0, KEY, headers=dict(SECRETS.headers), context=context)


# -- the sampler's GETs (urllib) ------------------------------------------------------------------------
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_metrics_redirect_to_another_port_is_followed_without_the_key_or_gateway_header(
        b: Server, servers: Callable[..., Server], status: int) -> None:
    a = servers(_redirector(b.url, status))
    got = _keyed_fetch(a.url + "/metrics")
    assert got.ok and got.body == METRICS, got
    assert b.paths() == ["/metrics"] and b.credentials_seen() == []
    assert "Accept" in b.seen[0][2] and b.seen[0][2]["User-Agent"] == "k3load-sampler"  # the harmless ones go on
    assert [(h.to_origin, h.http_status, h.action) for h in got.redirects] == [(b.url, status, CREDENTIALS_DROPPED)]
    assert a.credentials_seen() == ["GET /metrics"]  # the target itself did get them


def test_a_same_origin_redirect_keeps_the_credentials_and_is_not_said(servers: Callable[..., Server]) -> None:
    def route(_method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        if path == "/metrics":
            return 302, {"Location": "/engine/metrics"}, b""
        if path == "/engine/metrics":
            return 307, {"Location": f"{a.url}/v2/metrics"}, b""  # absolute, same scheme, host and port
        return 200, {}, METRICS.encode()

    a = servers(route)
    got = _keyed_fetch(a.url + "/metrics")
    assert got.ok and got.redirects == ()
    assert a.credentials_seen() == ["GET /metrics", "GET /engine/metrics", "GET /v2/metrics"]


def test_credentials_dropped_once_stay_dropped_back_on_the_first_origin(b: Server,
                                                                        servers: Callable[..., Server]) -> None:
    """A -> C (another origin) -> A: curl does not add them back, neither does the sampler."""
    a = servers(lambda _m, path: (302, {"Location": f"{c.url}/x"}, b"") if path == "/metrics"
                else (200, {}, METRICS.encode()))
    c = servers(lambda _m, _p: (302, {"Location": f"{a.url}/back"}, b""))
    got = _keyed_fetch(a.url + "/metrics")
    assert got.ok and a.paths() == ["/metrics", "/back"] and a.credentials_seen() == ["GET /metrics"]
    assert c.credentials_seen() == []
    assert [h.action for h in got.redirects] == [CREDENTIALS_DROPPED, FOLLOWED]


def test_an_https_to_http_redirect_is_refused_and_named(b: Server, servers: Callable[..., Server],
                                                        tls_server_context: ssl.SSLContext) -> None:
    a = servers(_redirector(b.url), tls=tls_server_context)
    context = Tls(insecure=True).context(gevent_patched())
    got = _keyed_fetch(a.url + "/metrics", context)
    assert not got.ok and got.status == 302 and b.seen == []
    assert got.error == f"redirect to {b.url} refused: https to http downgrade"
    assert [(h.to_origin, h.action) for h in got.redirects] == [(b.url, REFUSED_DOWNGRADE)]
    assert a.credentials_seen() == ["GET /metrics"]  # over TLS, to the target itself


@pytest.mark.parametrize(("location", "action", "words"), [
    ("file:///etc/passwd", NOT_FOLLOWED, "HTTP 302: redirect to file: not followed"),  # urllib's own refusal
    ("ftp://127.0.0.1:9/x", REFUSED_SCHEME, "redirect to ftp://127.0.0.1:9 refused: not an http(s) URL"),
    ("", NOT_FOLLOWED, "HTTP 302: redirect not followed"),
    (None, NOT_FOLLOWED, "HTTP 302: redirect not followed"),
])
def test_a_redirect_that_is_not_followed_names_where_it_pointed(servers: Callable[..., Server], location: str | None,
                                                                action: str, words: str) -> None:
    a = servers(lambda _m, _p: (302, {} if location is None else {"Location": location}, b"moved"))
    got = _keyed_fetch(a.url + "/metrics")
    assert not got.ok and got.status == 302 and got.error == words, got
    assert [h.action for h in got.redirects] == [action]


def test_a_redirect_loop_ends_as_a_reason(servers: Callable[..., Server]) -> None:
    a = servers(lambda _m, _p: (302, {"Location": "/metrics"}, b""))
    got = _keyed_fetch(a.url + "/metrics")
    assert not got.ok and got.error == f"HTTP 302: redirect to {a.url} not followed" and len(a.seen) > 1


def test_a_redirect_with_credentials_in_its_location_names_only_the_origin(b: Server,
                                                                          servers: Callable[..., Server]) -> None:
    a = servers(lambda _m, path: (302, {"Location": b.url.replace("//", "//user:pw@") + path}, b""))
    got = _keyed_fetch(a.url + "/metrics")
    assert [h.to_origin for h in got.redirects] == [b.url] and b.credentials_seen() == []


# Location values a server may send (Latin-1, no line breaks): relative, scheme-relative, other schemes,
# broken IPv6 brackets, bad ports, spaces, percent signs, userinfo, fragments, non-ASCII bytes.
PIECES = ["/", "//", "http:", "https:", "ftp:", "file:", "javascript:", "127.0.0.1", "127.0.0.2", "[::1]", "[::1",
          "localhost", ":80", ":443", ":99999", ":x", "@", "user:pw@", "?", "#", "%", "%zz", " ", "\t", "\\", "..",
          "metrics", "é", "\x7f", "a" * 40, "[", "]", ";", "&"]


def _locations(n: int, seed: int = 36) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6))) for _ in range(n)]


class _Opened(Exception):
    """What the fake opener raises with the request urllib would send next."""

    def __init__(self, request: urllib.request.Request) -> None:
        super().__init__(request.full_url)
        self.request = request


class _FakeOpener:
    def open(self, request: urllib.request.Request, timeout: float | None = None) -> Any:
        raise _Opened(request)


CAUGHT = (RedirectRefused, urllib.error.URLError, OSError, ValueError, http.client.HTTPException)  # as fetch's _get


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_any_location_is_followed_by_the_rule_or_refused_never_with_credentials_elsewhere(status: int) -> None:
    """The urllib handler itself on 400 generated Location values per status (no sockets): each hop it would make
    carries the key and the gateway header only to the same scheme, host and port; anything it cannot
    follow ends as an exception fetch() turns into a reason."""
    source = "https://127.0.0.1:8443/metrics"
    outcomes = {"same": 0, "other": 0, "refused": 0}
    for location in [*_locations(400, seed=status), "http://127.0.0.1:8443/m", "//127.0.0.1:8443/m", "/m", "?x"]:
        handler = _Redirects()
        handler.parent = _FakeOpener()
        request = urllib.request.Request(source, headers=SECRETS.request_headers())
        request.timeout = 1.0  # type: ignore[attr-defined]  # set by the opener on a real request
        headers = http.client.HTTPMessage()
        headers["Location"] = location
        try:
            handler.http_error_302(request, io.BytesIO(b""), status, "Found", headers)
        except _Opened as opened:
            sent = {name.lower(): value for name, value in opened.request.header_items()}
            if same_origin(source, opened.request.full_url):
                assert sent["authorization"] == f"Bearer {KEY}", location
                outcomes["same"] += 1
            else:
                assert "authorization" not in sent and "x-gateway-token" not in sent, (location, sent)
                assert opened.request.full_url.startswith("https://"), location  # never downgraded
                outcomes["other"] += 1
        except CAUGHT:
            outcomes["refused"] += 1
        else:  # None: no Location urllib can use; the default error handler turns the 3xx into an HTTPError
            outcomes["refused"] += 1
    assert all(outcomes.values()), outcomes  # every branch exercised


def test_fetch_never_raises_on_a_hostile_location(servers: Callable[..., Server]) -> None:
    """Through real sockets: Location values that point nowhere a DNS lookup would be needed."""
    hostile = ["http://[::1", "http://127.0.0.1:99999/", "http://127.0.0.1:x/", "https://[::1]:0/", "//", "///",
               "http://", "h\u00e9llo", "%00", "javascript:alert(1)", "data:text/plain,hi", "http://user@",
               "http://127.0.0.1:1/metrics"]
    for location in hostile:
        a = servers(lambda _m, _p, loc=location: (302, {"Location": loc}, b""))
        got = _keyed_fetch(a.url + "/metrics")
        assert isinstance(got, Fetched) and not got.ok and got.error, (location, got)
        assert KEY not in repr(got) and GATEWAY not in repr(got)


# -- the sampler: every source, and the event said once --------------------------------------------------
def _wait(until: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert until(), "timed out"


def test_the_sampler_never_sends_credentials_off_origin_and_says_each_redirect_once(
        tmp_path: Path, b: Server, servers: Callable[..., Server]) -> None:
    """/metrics and /health of the target, a dcgm-exporter and Prometheus, all redirected to B."""
    a = servers(_redirector(b.url))
    sampler = Sampler(tmp_path, a.url + "/metrics", gpu_metrics_urls=[a.url + "/dcgm/metrics"], interval_s=0.05,
                      api_key=KEY, headers=dict(SECRETS.headers), prometheus_url=a.url, clock=time.time)
    with sampler:
        _wait(lambda: b.paths().count("/metrics") >= 4 and b.paths().count("/health") >= 4
              and b.paths().count("/dcgm/metrics") >= 2)
    assert "/api/v1/query_range" in b.paths()  # Prometheus is read 5 s behind: at the latest by the final read
    assert b.credentials_seen() == []
    assert {"GET /metrics", "GET /health"} == set(a.credentials_seen())  # the target's own origin only
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert undeclared(lines) == []
    said = [json.loads(line) for line in lines if json.loads(line)["event"] == Event.REDIRECT]
    got = sorted((e["source"], e["to_origin"], e["http_status"], e["action"]) for e in said)
    assert got == sorted([(a.url + "/metrics", b.url, 302, CREDENTIALS_DROPPED),
                          (a.url + "/health", b.url, 302, CREDENTIALS_DROPPED),
                          (a.url + "/dcgm/metrics", b.url, 302, FOLLOWED),
                          (a.url + "/api/v1/query_range", b.url, 302, FOLLOWED)])
    assert KEY not in (tmp_path / "events.jsonl").read_text()


# -- chat, /tokenize, the precheck (httpx and geventhttpclient: never followed) ---------------------------
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_chat_never_follows_a_redirect_and_its_record_names_it(b: Server, servers: Callable[..., Server],
                                                               transport: str, stream: bool) -> None:
    a = servers(_redirector(b.url, 307))
    body = json.dumps({**json.loads(CHAT), "stream": stream}).encode()
    with ChatClient(a.url, transport=transport, secrets=SECRETS) as client:
        got = client.send(body, 10.0)
    assert got.status == res.STATUS_HTTP_ERROR and got.http_status == 307
    assert got.error.startswith(f"HTTP 307: redirect to {b.url} not followed"), got.error
    assert b.seen == [] and a.credentials_seen() == ["POST /v1/chat/completions"]


def test_tokenize_never_follows_a_redirect_even_from_a_client_that_would(b: Server,
                                                                        servers: Callable[..., Server]) -> None:
    a = servers(_redirector(b.url, 307))
    for follow in (False, True):
        tokenize = http_tokenizer(lambda f=follow: httpx.Client(headers=SECRETS.request_headers(), follow_redirects=f),
                                  a.url, "m")
        with pytest.raises(TokenizerUnavailable, match=f"HTTP 307: redirect to {b.url} not followed"):
            tokenize({"messages": [{"role": "user", "content": "hi"}]})
    assert b.seen == []


def test_the_precheck_follows_no_redirect(tmp_path: Path, b: Server, servers: Callable[..., Server]) -> None:
    a = servers(_redirector(b.url))
    run_precheck(tmp_path / "run", ROOT / "recipes" / "local-dev.yaml", a.url, use_local_nvml=False, secrets=SECRETS)
    assert b.seen == []
    fetched = json.loads((tmp_path / "run" / "evidence" / "server" / "fetch.json").read_text())
    assert {e["status"] for e in fetched["endpoints"].values()} == {302}


# -- the helpers -------------------------------------------------------------------------------------------
def test_origins_and_redirect_kinds() -> None:
    assert same_origin("http://h/metrics", "http://h:80/health") and same_origin("HTTPS://H:443/a", "https://h/b")
    assert not same_origin("http://h/m", "https://h/m") and not same_origin("http://h/m", "http://h:81/m")
    assert not same_origin("http://[::1/m", "http://[::1/m") and not same_origin("http://h:x/", "http://h:x/")
    assert not same_origin("http://h/m", None) and not same_origin("file:///a", "file:///a")
    assert origin("http://user:pw@[::1]:9/x?q#f") == "http://[::1]:9" and origin("https://h/x") == "https://h:443"
    assert origin("file:///etc/passwd") == "file:" and origin("http://[::1") == "(unparsable URL)"
    assert redirect_kind("http://h/a", "http://h/b") == SAME_ORIGIN
    assert redirect_kind("http://h/a", "https://h/b") == OTHER_ORIGIN  # an upgrade: followed, without them
    assert redirect_kind("https://h/a", "http://h/b") == DOWNGRADE
    assert redirect_kind("https://h/a", "http://other/b") == DOWNGRADE
    assert {redirect_kind("http://h/a", u) for u in ("ftp://h/", "file:///x", "javascript:x", "http:///x",
                                                     "http://[::1")} == {BAD_SCHEME}


def test_redirect_notes_for_the_clients_that_never_follow() -> None:
    assert redirect_note(200, "http://x/") == "" and redirect_note(None, None) == ""
    assert redirect_note(302, "http://u:p@10.0.0.9:8000/v1") == "redirect to http://10.0.0.9:8000 not followed"
    assert redirect_note(307, "/v1/chat") == "redirect to a path on the same origin not followed"
    assert redirect_note(307, "/v1/chat", "http://h:1/x") == "redirect to http://h:1 not followed"
    assert redirect_note(301, None) == "redirect without a Location, not followed"
    assert redirect_note(302, "http://[::1") == "redirect to (unparsable URL) not followed"


@pytest.mark.parametrize(("url", "secrets", "warned"), [
    ("http://10.0.0.5:8000", True, True), ("http://vllm.example:8000/v1", True, True),
    ("http://[2001:db8::1]:80", True, True), ("http://127.0.0.2:8000", True, False),
    ("http://localhost:8000", True, False), ("http://LOCALHOST.:8000", True, False), ("http://[::1]:8000", True, False),
    ("http://[::ffff:127.0.0.1]:8000", True, False), ("https://10.0.0.5", True, False),
    ("http://10.0.0.5:8000", False, False), ("http://[::1", True, False),
])
def test_plain_http_warning_only_for_secrets_to_a_host_off_loopback(url: str, secrets: bool, warned: bool) -> None:
    line = plain_http_warning(url, secrets)
    assert (line is not None) == warned, line
    if line is not None:
        assert "\n" not in line and origin(url) in line and "https://" in line
    assert is_loopback("127.255.0.1") and not is_loopback("128.0.0.1") and not is_loopback(None)


# -- the plain-HTTP warning of the standalone commands -----------------------------------------------------
class _IdleSampler:
    """Stands in for the Sampler: the warning is said before it starts, from the URLs it was given."""

    def __init__(self, out: Path, metrics_url: list[str], **kwargs: Any) -> None:
        self.metrics_url, self.health_url = metrics_url[0], kwargs.get("health_url")

    def start(self) -> _IdleSampler:
        return self

    def stop(self) -> dict[str, Any]:
        return {}


def _parsed(add_arguments: Callable[[Any], None], argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("url", "key", "warned"), [("http://10.0.0.5:8000", KEY, True),
                                                    ("http://127.0.0.1:8000", KEY, False),
                                                    ("http://10.0.0.5:8000", None, False)])
def test_sample_and_precheck_warn_once_about_a_key_over_plain_http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str], url: str,
                                                                   key: str | None, warned: bool) -> None:
    if key:
        monkeypatch.setenv("K3_API_KEY", key)
    else:
        monkeypatch.delenv("K3_API_KEY", raising=False)
    monkeypatch.setattr(sample_cli, "Sampler", _IdleSampler)
    sample_cli.run(_parsed(sample_cli.add_arguments, ["--metrics-url", f"{url}/metrics", "--duration", "0.01",
                                                      "--out", str(tmp_path / "s")]))

    def gathered(*_args: Any, **_kwargs: Any) -> dict[str, Any]:
        raise PrecheckError("not gathered here")

    monkeypatch.setattr(precheck_cli, "run_precheck", gathered)
    precheck_cli.run(_parsed(precheck_cli.add_arguments, ["--recipe", str(ROOT / "recipes" / "local-dev.yaml"),
                                                          "--base-url", url, "--out", str(tmp_path / "p")]))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "plain HTTP" in line]
    assert warnings == ([plain_http_warning(url, True)] * 2 if warned else []), warnings
    assert all(KEY not in line for line in warnings)


def test_a_run_whose_models_answer_redirects_stops_naming_it_and_sends_nothing_elsewhere(
        b: Server, servers: Callable[..., Server], tmp_path: Path) -> None:
    """The Locust run's first request (/v1/models, k3load.loadgen.session) never follows: one line, exit 2."""
    from tests.sim.locust_runs import SHORT_PLAN, _plan, run_locust

    a = servers(_redirector(b.url + "/v1/models"))
    run = run_locust(a.url, tmp_path / "run", _plan(tmp_path, SHORT_PLAN[:1]), "--k3-api-key", KEY, timeout_s=60)
    said = run.stdout + run.stderr
    assert run.returncode == 2 and f"redirect to {origin(b.url)} not followed" in said, said[-2000:]
    assert not b.seen and "Traceback" not in said and KEY not in said
