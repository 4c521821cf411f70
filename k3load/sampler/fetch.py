"""One bounded HTTP GET for the sampler: a status, a body or a short reason, never an exception.

Why urllib and not httpx: the sampler polls twice a second or more for hours; httpx logs every request
at INFO (Locust configures INFO), and the sampler needs nothing but a GET with a timeout. urllib's
sockets are gevent-patched inside Locust like any other, so a slow server never blocks the load.
Why a reason string: `server_down` events and `"ok": false` lines say *why* (refused, timeout,
HTTP 503) so an operator can tell a crash from a hung engine from a gateway error.
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
from dataclasses import dataclass

from k3load.client.access import Secrets

MAX_BODY_BYTES = 64 * 2**20  # a vLLM /metrics body is ~60 KB; dcgm-exporter ~100 KB per node
ERROR_BODY_BYTES = 2048


@dataclass(frozen=True)
class Fetched:
    """What one GET gave: `ok` means HTTP 2xx and a body read in full; on an HTTP error, `body` holds the
    first bytes of the error page."""

    ok: bool
    status: int | None
    body: str
    error: str | None
    elapsed_ms: float


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
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            status = response.status
            raw = response.read(max_bytes + 1)
        if len(raw) > max_bytes:
            return _failed(status, f"body over {max_bytes} bytes", start)
        return Fetched(True, status, raw.decode("utf-8", errors="replace"), None, _ms(start))
    except urllib.error.HTTPError as exc:  # the start of the body kept: a Prometheus error says why in JSON
        return Fetched(False, exc.code, _error_body(exc), f"HTTP {exc.code}", _ms(start))
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:  # no status line, cut body
        return _failed(status, reason(exc, timeout_s), start)


def _redacted(got: Fetched, secrets: list[str]) -> Fetched:
    """Every value sent replaced in the body and the reason (a 401 page may repeat the header)."""
    redact = Secrets(None, tuple(("x", v) for v in secrets if v)).redact
    body, error = redact(got.body), redact(got.error) if got.error else got.error
    return got if (body, error) == (got.body, got.error) else Fetched(got.ok, got.status, body, error, got.elapsed_ms)


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


def same_origin(url: str, other: str | None) -> bool:
    """Same scheme, host and port: where the target's API key may travel (its own /metrics, /health), and
    nowhere else (a gateway's other replicas, a dcgm-exporter, Prometheus)."""
    if not other:
        return False
    a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(other)
    return (a.scheme, a.hostname, _port(a)) == (b.scheme, b.hostname, _port(b))


def _port(parts: urllib.parse.SplitResult) -> int | None:
    try:
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
