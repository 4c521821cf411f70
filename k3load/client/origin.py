"""Where the target's credentials may travel: origins, redirects, loopback, and the plain-HTTP warning.

    same_origin("http://h:8000/metrics", "http://h:8000/health")     # True: same scheme, host and port
    redirect_kind("https://h/metrics", "http://h/metrics")           # DOWNGRADE: refused outright
    origin("http://user:pw@[::1]:9/x?q")                             # "http://[::1]:9" (never the userinfo)
    plain_http_warning("http://10.0.0.5:8000", has_secrets=True)     # one line, or None

Why one module: the API key and a gateway's headers go to the target's own origin (scheme, host and port)
and nowhere else — not to a dcgm-exporter or a Prometheus, and not to wherever a redirect points. Every
client of the harness follows the same rule, as curl, requests and httpx do on a redirect: a hop to
another origin goes without them, an https -> http hop is refused (it would send the request, and
whatever the next hop asks for, in clear text), and a hop to anything but http(s) is refused. The
clients that never follow a redirect name where it pointed (`redirect_note`) instead of a bare "HTTP 302".
"""

from __future__ import annotations

import ipaddress
import urllib.parse

SAME_ORIGIN = "same_origin"  # followed with the credentials
OTHER_ORIGIN = "other_origin"  # followed without them
DOWNGRADE = "downgrade"  # https -> http: refused
BAD_SCHEME = "bad_scheme"  # not http(s) (file:, ftp:, javascript:, garbage): refused

_DEFAULT_PORTS = {"http": 80, "https": 443}
_LOOPBACK_NAMES = ("localhost",)


def port(parts: urllib.parse.SplitResult) -> int | None:
    """The port, the scheme's default when none is given; None when it is not a number in range."""
    try:
        return parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None


def _split(url: str) -> urllib.parse.SplitResult | None:
    try:
        return urllib.parse.urlsplit(url)
    except ValueError:  # "http://[::1" and the like: not a URL anything may be sent to
        return None


def same_origin(url: str, other: str | None) -> bool:
    """Same scheme, host and port: where the target's API key may travel (its own /metrics, /health), and
    nowhere else (a gateway's other replicas, a dcgm-exporter, Prometheus, a redirect's other host). A URL
    that does not parse is never the same origin."""
    if not other:
        return False
    a, b = _split(url), _split(other)
    if a is None or b is None or not a.hostname or port(a) is None:
        return False
    return (a.scheme.lower(), a.hostname, port(a)) == (b.scheme.lower(), b.hostname, port(b))


def origin(url: str) -> str:
    """`scheme://host:port` of `url`, without user:password, path or query (what an event or an error may
    name); the scheme alone (`file:`) when there is no host; `(unparsable URL)` when it does not parse."""
    parts = _split(url)
    if parts is None:
        return "(unparsable URL)"
    host = parts.hostname or ""
    if not host:
        return f"{parts.scheme}:" if parts.scheme else "(no host)"
    host = f"[{host}]" if ":" in host else host
    number = port(parts)
    return f"{parts.scheme}://{host}" + (f":{number}" if number is not None else "")


def key_origin(url: str | None) -> str:
    """`scheme://host:port` (lower case, the scheme's default port made explicit) of a URL keyed traffic may
    go to; "" for anything it cannot (no URL, no host, a bad port, not http(s)), which is no one's origin:
    callers compare two only when the first is not "" (k3load.loadgen.held_secrets binds the key to one)."""
    parts = _split((url or "").strip())
    if parts is None or parts.scheme.lower() not in _DEFAULT_PORTS or not parts.hostname:
        return ""
    number, host = port(parts._replace(scheme=parts.scheme.lower())), parts.hostname.lower()
    return f"{parts.scheme.lower()}://{f'[{host}]' if ':' in host else host}:{number}" if number else ""


def redirect_kind(from_url: str, to_url: str) -> str:
    """What a redirect from `from_url` to `to_url` (absolute) may do: SAME_ORIGIN (follow, credentials
    kept), OTHER_ORIGIN (follow without them), DOWNGRADE or BAD_SCHEME (refuse)."""
    source, target = _split(from_url), _split(to_url)
    scheme = target.scheme.lower() if target is not None else ""
    if target is None or scheme not in _DEFAULT_PORTS or not target.hostname:
        return BAD_SCHEME
    if source is not None and source.scheme.lower() == "https" and scheme == "http":
        return DOWNGRADE
    return SAME_ORIGIN if same_origin(from_url, to_url) else OTHER_ORIGIN


def redirect_note(status: int | None, location: str | None, base_url: str | None = None) -> str:
    """For a client that never follows: '' unless `status` is 3xx, else "redirect to ORIGIN not followed"
    (a relative Location is read against `base_url`, or said as the same origin)."""
    if status is None or not 300 <= status < 400:
        return ""
    if not location:
        return "redirect without a Location, not followed"
    try:
        target = urllib.parse.urljoin(base_url, location) if base_url else location
    except ValueError:
        target = location
    parts = _split(target)
    where = "a path on the same origin" if parts is not None and not parts.scheme and not parts.netloc \
        else origin(target)
    return f"redirect to {where} not followed"


def is_loopback(host: str | None) -> bool:
    """127.0.0.0/8, ::1 (also as ::ffff:127.x.y.z) or the name localhost."""
    if not host:
        return False
    host = host.strip("[]").lower().rstrip(".")
    if host in _LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def plain_http_warning(url: str, has_secrets: bool) -> str | None:
    """One line when the API key or a gateway header would go over plain http:// to a host that is not
    loopback (anyone on the path can read them), else None. Says the host, never a secret."""
    parts = _split(url)
    if not has_secrets or parts is None or parts.scheme.lower() != "http" or is_loopback(parts.hostname):
        return None
    return (f"k3load: warning: the API key / gateway headers go over plain HTTP to {origin(url)}, which is not "
            "loopback: anyone on the path can read them; use https://")
