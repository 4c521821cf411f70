"""Credentials never follow a redirect to another origin (issue 36, items 4 and 6): the sampler's GETs (urllib).

Two real servers on loopback, on their own ports: A answers every request with a redirect to B (or to a path of
its own), B records the headers of every request it gets. B never sees the bearer key or the gateway header's
value; redirects within A's origin keep them; an https -> http hop is refused; a redirect not followed, a loop
and any hostile Location end as a reason, never an exception nor credentials sent elsewhere.
"""

from __future__ import annotations

import http.client
import io
import random
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from k3load.client.access import Tls, gevent_patched
from k3load.client.origin import same_origin
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
from tests.sim.redirect_servers import GATEWAY, KEY, METRICS, SECRETS, Server, _redirector, b, servers

__all__ = ["b", "servers"]  # the servers' fixtures


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
