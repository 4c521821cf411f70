"""How the harness reaches a protected target: its API key, a gateway's headers, and TLS trust.

    secrets = Secrets(api_key="sk-...", headers=(("X-Gateway-Token", "gw-..."),))
    secrets.request_headers()        # {"Authorization": "Bearer sk-...", "X-Gateway-Token": "gw-..."}
    secrets.redact(text)             # every key and header value replaced by [redacted]
    Tls(ca_bundle="ca.pem").context(cooperative=True)   # one verifying SSLContext per process and settings

Why one object for the key and the headers: both go on every request to the target's own API (chat,
/v1/models, /tokenize, /version, and /health and /metrics on the same scheme, host and port) and never
to another host, and both must never reach a file of the run directory, whatever a server echoes back
(a 401 page repeating the Authorization header). Header names are not secret; their values are (a
gateway header usually carries a token). A value is redacted in every form a server can echo it
(k3load.client.secret_forms: JSON escapes, percent-encoding, base64 as in a Basic credential).

Where headers come from: `--header 'Name: value'` (repeatable), `--header @FILE` (as curl: one header a
line, blank lines and `#` comments skipped) or the environment (K3_HEADER: one header a line, or @FILE),
so that no value need show on a command line (`ps`, /proc/PID/cmdline). `header_lines` expands them.

Why TLS settings here: the same trust (a private CA added to the system's, or no verification at all)
must hold for both streaming transports, the sampler's urllib GETs and the precheck's httpx GETs;
building a context costs 23-33 ms of CPU, so one is built per process, kind and settings.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from k3load.client.secret_forms import REDACTED as REDACTED  # re-exported: where callers look for it
from k3load.client.secret_forms import Redactor, redactor
from k3load.errors import InputError


class AccessError(InputError):
    """A header, `@FILE` of headers or API key the user gave that cannot be sent: the message names the header,
    the file and the line, never a value (it is a secret)."""


HEADER_ENV = "K3_HEADER"
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP header name (RFC 9110 token)


def is_header_name(name: str) -> bool:
    """An HTTP header name (RFC 9110 token): the one check the client, the options and the secrets share."""
    return bool(_TOKEN.fullmatch(name))  # fullmatch: `$` alone lets a trailing newline through
# Each attempt's own header (k3load.workload.conversation): a new value on every request, so never part of a
# cached request head (k3load.client.transport)
PER_REQUEST_HEADER = "X-Request-Id"
# A header value as geventhttpclient takes one (RFC 9110 field-value: visible characters, spaces and tabs)
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")


def is_header_value(value: str) -> bool:
    return bool(_FIELD_VALUE.fullmatch(value))


# Set by the harness itself: HTTP's framing, and each attempt's own X-Request-Id (k3load.workload.conversation)
RESERVED_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection",
                              "x-request-id"})


def parse_header(text: str) -> tuple[str, str]:
    """`"Name: value"` -> (name, value). Errors name the header, never its value (it is a secret)."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not name:
        raise AccessError("must be 'Name: value'")
    if not is_header_name(name):  # not named: a value written without its name would show here
        raise AccessError("the text before ':' is not an HTTP header name (spaces or characters a name cannot have)")
    if name.lower() in RESERVED_HEADERS:
        raise AccessError(f"{name} is set by the harness itself")
    if not value or not value.isascii() or not value.isprintable():
        raise AccessError(f"the value of {name} is empty or has characters a header cannot carry")
    return name, value


def header_lines(items: Iterable[str]) -> list[str]:
    """The `Name: value` headers of `--header` items: each item one header, several (one a line), or
    `@FILE` (a file of them, as curl reads one); blank lines and lines starting with `#` are skipped.
    Errors name the file and the line, or the header, never a value."""
    out = []
    for item in items:
        origin, text = None, item
        if item.startswith("@"):
            origin = item[1:]
            try:
                text = Path(origin).read_text(encoding="utf-8")
            except FileNotFoundError:
                raise AccessError(f"@{origin}: no such file") from None
            except (OSError, UnicodeDecodeError) as exc:
                raise AccessError(f"@{origin}: cannot be read ({getattr(exc, 'strerror', None) or 'not UTF-8'})") \
                    from None
        lines = text.splitlines() or [text]
        for number, line in enumerate(lines, 1):
            if (origin is not None or len(lines) > 1) and (not line.strip() or line.lstrip().startswith("#")):
                continue
            try:
                parse_header(line)
            except ValueError as exc:
                where = f"@{origin} line {number}" if origin is not None else f"line {number}" if len(lines) > 1 \
                    else None
                raise AccessError(f"{where}: {exc}" if where else str(exc)) from None
            out.append(line.strip())
    return out


def env_headers(environ: Mapping[str, str] | None = None) -> list[str]:
    """K3_HEADER as `--header` items: one header a line, or @FILE ([] when unset or empty)."""
    value = (os.environ if environ is None else environ).get(HEADER_ENV, "")
    return [value] if value.strip() else []


@dataclass(frozen=True)
class Secrets:
    """The key and the gateway headers: sent to the target, redacted from everything written."""

    api_key: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        key = self.api_key
        if key and (not key.isascii() or not key.isprintable()):
            raise AccessError("api_key has characters an HTTP header cannot carry")  # never echo it
        if key and any(name.lower() == "authorization" for name, _ in self.headers):
            raise AccessError("an Authorization header and an API key: give one")

    @classmethod
    def parse(cls, api_key: str | None, headers: Iterable[str] = ()) -> Secrets:
        """From the key and `--header` items (each one header, several one a line, or @FILE)."""
        return cls(api_key or None, tuple(parse_header(h) for h in header_lines(headers)))

    def request_headers(self) -> dict[str, str]:
        """What every request to the target carries (Authorization first)."""
        out = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        out.update(self.headers)
        return out

    @functools.cached_property
    def values(self) -> tuple[str, ...]:
        """Each secret as configured (the key, each header's value); every form of them is redacted."""
        return tuple(dict.fromkeys(v for v in [self.api_key or "", *(value for _, value in self.headers)] if v))

    @functools.cached_property
    def redactor(self) -> Redactor:
        """Compiled once per set of values (k3load.client.secret_forms.redactor caches it across objects)."""
        return redactor(self.values)

    def redact(self, text: str) -> str:
        return self.redactor.redact(text)

    def redact_bytes(self, data: bytes) -> bytes:
        return self.redactor.redact_bytes(data)

    def __bool__(self) -> bool:
        return bool(self.values)

    def __repr__(self) -> str:
        return f"Secrets(api_key={'set' if self.api_key else 'none'}, headers={[n for n, _ in self.headers]})"


@dataclass(frozen=True)
class Tls:
    """TLS trust for every HTTPS request of a run: `ca_bundle` (a PEM file of CA certificates, added to
    the system's) or `insecure` (no certificate or host name check at all)."""

    ca_bundle: str | None = None
    insecure: bool = False

    def context(self, cooperative: bool) -> ssl.SSLContext:
        """The shared context for this process and kind (gevent's SSLContext wraps gevent sockets)."""
        return _context(cooperative, self.ca_bundle, self.insecure)

    def describe(self) -> dict[str, object]:
        """For run.json: what was trusted (the bundle's path is not a secret)."""
        return {"verify": not self.insecure, "ca_bundle": self.ca_bundle}


def access_problem(api_key: str | None, headers: Iterable[str], ca_bundle: str | None, insecure: bool,
                   prefix: str = "--k3-") -> str | None:
    """The first unusable access option, named as the command spells it (`prefix`: "--k3-" in Locust,
    "--" in the `k3load` subcommands); None when the key, headers and trust can be used. Never shows a
    header's value nor the key."""
    if ca_bundle:
        path = Path(ca_bundle)
        if not path.exists():
            return f"{prefix}ca-bundle {ca_bundle}: no such file"
        if not path.is_file():
            return f"{prefix}ca-bundle {ca_bundle}: not a file"
        if why := check_ca_bundle(ca_bundle):
            return f"{prefix}ca-bundle {ca_bundle}: {why}"
        if insecure:
            return f"{prefix}ca-bundle and {prefix}insecure: give one (verify with the bundle, or not at all)"
    try:
        Secrets.parse(api_key, headers)
    except ValueError as exc:
        return f"{prefix}header: {exc}"
    return None


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """`--header`, `--ca-bundle`, `--insecure` for the `k3load` subcommands that reach the target, with
    the meaning of Locust's `--k3-header`, `--k3-ca-bundle`, `--k3-insecure`."""
    parser.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'/@FILE",
                        help="extra header on every request to the target (repeatable), e.g. a gateway's token; "
                        "@FILE reads one header a line (# comments), and $K3_HEADER is used when no --header is "
                        "given (one header a line, or @FILE), so no value need show in ps; values are secrets: "
                        "never written")
    parser.add_argument("--ca-bundle", metavar="PEM", help="CA certificates trusted for an https target, on top of "
                        "the system's (a private CA)")
    parser.add_argument("--insecure", action="store_true", help="no TLS certificate verification at all")


def access_headers(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> list[str]:
    """The subcommand's `--header` items, else $K3_HEADER's (as Locust reads K3_HEADER for --k3-header)."""
    return list(args.header) or env_headers(environ)


def check_ca_bundle(path: str) -> str | None:
    """None when `path` loads as PEM CA certificates, else why not (for a harness error line)."""
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        return f"not a PEM CA file ({exc.__class__.__name__}: {getattr(exc, 'reason', None) or exc})"
    return None


@functools.cache
def _context(cooperative: bool, ca_bundle: str | None, insecure: bool) -> ssl.SSLContext:
    """Falls back to certifi's CA bundle where the system store is empty (slim containers)."""
    if cooperative:
        import gevent.ssl

        ctx = gevent.ssl.create_default_context()
    else:
        ctx = ssl.create_default_context()
    if not ctx.cert_store_stats().get("x509_ca"):
        import certifi

        ctx.load_verify_locations(cafile=certifi.where())
    if ca_bundle:
        ctx.load_verify_locations(cafile=ca_bundle)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def gevent_patched() -> bool:
    """Inside Locust (gevent's patch) sockets and ssl are gevent's: a TLS context must be too."""
    import gevent.monkey

    return gevent.monkey.is_module_patched("socket")


def tls_hint(text: str) -> str:
    """What to do about a TLS failure, appended to its one line ("" for any other failure)."""
    low = text.lower()
    if "certificate_verify_failed" in low or "certificate verify failed" in low:
        return " (TLS: the server's certificate is not trusted: give --k3-ca-bundle PATH with the CA that signed " \
               "it, or --k3-insecure)"
    if "wrong_version_number" in low or "wrong version number" in low:
        return " (TLS: the server does not speak TLS there: is the URL http:// ?)"
    return ""
