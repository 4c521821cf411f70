"""One bounded HTTP GET for the sampler: a status, a body or a short reason, never an exception.

Why urllib and not httpx: the sampler polls twice a second or more for hours; httpx logs every request
at INFO (Locust configures INFO), and the sampler needs nothing but a GET with a timeout. urllib's
sockets are gevent-patched inside Locust like any other, so a slow server never blocks the load.
Why a reason string: `server_down` events and `"ok": false` lines say *why* (refused, timeout,
HTTP 503) so an operator can tell a crash from a hung engine from a gateway error.
Redirects (k3load.client.origin): followed within the origin with every header; to another origin
without the key and the gateway headers (only Accept and User-Agent go on, as curl drops Authorization);
an https -> http hop or one to anything but http(s) is refused and named in the reason. Each hop to
another origin, each refusal and each 3xx not followed is in `Fetched.redirects`, for the sampler's
`redirect` event.
"""

from __future__ import annotations

import errno
import http.client
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from k3load.client.access import Secrets
from k3load.client.origin import BAD_SCHEME, DOWNGRADE, OTHER_ORIGIN, origin, redirect_kind
from k3load.client.origin import same_origin as same_origin  # re-exported: its callers import it from here

MAX_BODY_BYTES = 64 * 2**20  # a vLLM /metrics body is ~60 KB; dcgm-exporter ~100 KB per node
ERROR_BODY_BYTES = 2048
SAFE_HEADERS = frozenset({"accept", "user-agent"})  # all that goes on to another origin
# Redirect.action
CREDENTIALS_DROPPED = "credentials_dropped"  # followed to another origin without the key and gateway headers
FOLLOWED = "followed"  # followed to another origin; there were no credentials to drop
REFUSED_DOWNGRADE = "refused_downgrade"  # https -> http: not followed
REFUSED_SCHEME = "refused_scheme"  # not http(s): not followed
NOT_FOLLOWED = "not_followed"  # a 3xx urllib does not follow (no Location, a loop, 300, 304, ...)


@dataclass(frozen=True)
class Redirect:
    """One hop worth saying: to another origin, refused, or not followed. `to_origin` has no userinfo."""

    from_url: str
    to_origin: str
    http_status: int
    action: str


@dataclass(frozen=True)
class Fetched:
    """What one GET gave: `ok` means HTTP 2xx and a body read in full; on an HTTP error, `body` holds the
    first bytes of the error page. `redirects`: the hops worth saying (see the module docstring)."""

    ok: bool
    status: int | None
    body: str
    error: str | None
    elapsed_ms: float
    redirects: tuple[Redirect, ...] = ()


class RedirectRefused(Exception):
    """An https -> http hop, or one to anything but http(s): never followed."""

    def __init__(self, hop: Redirect, message: str) -> None:
        super().__init__(message)
        self.hop = hop


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirect handling with curl's rule for credentials, and the hops kept for the caller."""

    def __init__(self) -> None:
        self.hops: list[Redirect] = []

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        kind, where = redirect_kind(req.full_url, newurl), origin(newurl)
        if kind in (DOWNGRADE, BAD_SCHEME):
            fp.close()
            refused = REFUSED_DOWNGRADE if kind == DOWNGRADE else REFUSED_SCHEME
            why = "https to http downgrade" if kind == DOWNGRADE else "not an http(s) URL"
            raise RedirectRefused(Redirect(req.full_url, where, code, refused), f"redirect to {where} refused: {why}")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and kind == OTHER_ORIGIN:
            dropped = [name for name in new.headers if name.lower() not in SAFE_HEADERS]
            for name in dropped:
                new.remove_header(name)
            self.hops.append(Redirect(req.full_url, where, code, CREDENTIALS_DROPPED if dropped else FOLLOWED))
        return new


def fetch(url: str, timeout_s: float, api_key: str | None = None, max_bytes: int = MAX_BODY_BYTES, *,
          headers: Mapping[str, str] | None = None, context: ssl.SSLContext | None = None) -> Fetched:
    """GET `url`; the API key travels as a bearer header, `headers` (a gateway's) as given, and none of
    their values is part of what is returned, even when the server echoes them. `context`: the run's TLS
    trust (k3load.client.access.Tls), for https URLs."""
    sent = {"Accept": "text/plain, */*", "User-Agent": "k3load-sampler", **(headers or {})}
    if api_key:
        sent["Authorization"] = f"Bearer {api_key}"
    got = _get(urllib.request.Request(url, headers=sent, method="GET"), timeout_s, max_bytes, context)
    secrets = [v for name, v in sent.items() if name == "Authorization" or name in (headers or {})]
    return _redacted(got, [v.removeprefix("Bearer ") for v in secrets])


def _get(request: urllib.request.Request, timeout_s: float, max_bytes: int, context: ssl.SSLContext | None) -> Fetched:
    start = time.perf_counter()
    status: int | None = None
    redirects = _Redirects()
    handlers: list[urllib.request.BaseHandler] = [redirects]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    try:
        with urllib.request.build_opener(*handlers).open(request, timeout=timeout_s) as response:
            status = response.status
            raw = response.read(max_bytes + 1)
        if len(raw) > max_bytes:
            got = _failed(status, f"body over {max_bytes} bytes", start)
        else:
            got = Fetched(True, status, raw.decode("utf-8", errors="replace"), None, _ms(start))
    except RedirectRefused as exc:
        redirects.hops.append(exc.hop)
        got = _failed(exc.hop.http_status, str(exc), start)
    except urllib.error.HTTPError as exc:  # the start of the body kept: a Prometheus error says why in JSON
        got = Fetched(False, exc.code, _error_body(exc), _http_error(exc, redirects.hops), _ms(start))
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:  # no status line, cut body
        got = _failed(status, reason(exc, timeout_s), start)
    return replace(got, redirects=tuple(redirects.hops)) if redirects.hops else got


def _http_error(exc: urllib.error.HTTPError, hops: list[Redirect]) -> str:
    """'HTTP 503'; a 3xx urllib did not follow (no Location, a loop, a scheme urllib refuses itself) names
    where it pointed and is kept as a hop."""
    if not 300 <= exc.code < 400:
        return f"HTTP {exc.code}"
    location = exc.headers.get("Location") if exc.headers is not None else None
    try:
        where = origin(urllib.parse.urljoin(exc.url, location)) if location else None
    except ValueError:
        where = "(unparsable URL)"
    hops.append(Redirect(exc.url, where or "(no Location)", exc.code, NOT_FOLLOWED))
    return f"HTTP {exc.code}: redirect to {where} not followed" if where else f"HTTP {exc.code}: redirect not followed"


def _redacted(got: Fetched, secrets: list[str]) -> Fetched:
    """Every value sent replaced in the body and the reason (a 401 page may repeat the header)."""
    redact = Secrets(None, tuple(("x", v) for v in secrets if v)).redact
    body, error = redact(got.body), redact(got.error) if got.error else got.error
    return got if (body, error) == (got.body, got.error) else replace(got, body=body, error=error)


def reason(exc: BaseException, timeout_s: float) -> str:
    """A short, stable reason: 'connection refused', 'timeout after 2.0 s', 'DNS: ...'."""
    inner = exc.reason if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException) else exc
    if isinstance(inner, TimeoutError | socket.timeout):
        return f"timeout after {timeout_s:g} s"
    if isinstance(inner, ConnectionRefusedError) or getattr(inner, "errno", None) == errno.ECONNREFUSED:
        return "connection refused"
    if isinstance(inner, ConnectionResetError):
        return "connection reset"
    if isinstance(inner, socket.gaierror):
        return f"DNS: {inner.strerror or inner}"
    text = str(getattr(exc, "reason", exc)) or type(exc).__name__
    return f"{type(inner).__name__}: {text}"[:300]


def redact_url(url: str) -> str:
    """The URL without user:password, for what is written to disk."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def health_url_for(metrics_url: str) -> str:
    """vLLM serves /health next to /metrics: same scheme, host and port."""
    parts = urllib.parse.urlsplit(metrics_url)
    path = parts.path[: -len("/metrics")] if parts.path.endswith("/metrics") else ""
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + "/health", "", ""))


def _error_body(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(ERROR_BODY_BYTES).decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        return ""


def _failed(status: int | None, error: str, start: float) -> Fetched:
    return Fetched(False, status, "", error, _ms(start))


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)
