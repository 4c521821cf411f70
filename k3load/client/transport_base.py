"""What every transport is: the interface the chat client reads (`Transport`, `ResponseStream`), the errors it
raises, and the helpers both implementations share (one TLS context per process, error text, socket shutdown).

Why its own module: the two implementations (`k3load.client.transport` for geventhttpclient, the default;
`k3load.client.transport_httpx`, the reference) depend on this and not on each other, and the registry of
transports in `k3load.client.transport` can import both without a cycle. Import these names from
`k3load.client.transport`, which re-exports them.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Iterator, Mapping
from typing import Protocol

from k3load.client.access import Tls


class TransportError(Exception):
    """The request could not be made or the connection broke (connect refused, reset, TLS, DNS)."""


class TransportTimeout(TransportError):
    """A read, write or pool wait ran past the time the caller allowed."""


class BodyCut(TransportError):
    """The response body ended before the HTTP message did (EOF, reset, cut chunked encoding)."""


class ResponseStream(Protocol):
    """One response: status and headers are known when `Transport.open` returns."""

    # Read-only to the reader (properties, so an implementation may hold them as plain attributes of a subtype)
    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Names in lower case."""
        ...

    @property
    def rx_lag(self) -> float:
        """Seconds the last read's bytes had waited in the kernel when it returned (0: not known)."""
        ...

    def reads(self) -> Iterator[bytes]:
        """Body bytes exactly as each socket read delivered them, until the message ends."""
        ...

    @property
    def ended(self) -> bool:
        """The message ended (its last chunk, or its length, was read): close() keeps the connection."""
        ...

    def wait_end(self, wait_s: float) -> int:
        """After the reader stopped before the end (an SSE stream at [DONE]): read on for at most `wait_s`
        until the message ends, keeping nothing; returns the body bytes read meanwhile. Never raises for
        the connection: one that breaks or stays open is simply not `ended`."""
        ...

    def abort(self) -> None:
        """Break a read blocked in another thread (the plain-threads deadline watchdog)."""
        ...

    def close(self) -> None:
        """Release the connection: back to the pool when the message was read to its end."""
        ...


class Transport(Protocol):
    name: str
    cooperative: bool  # blocking calls yield to gevent, so gevent.Timeout can end them

    def open(self, path: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> ResponseStream:
        """POST `body`; return once the status line and headers are in."""
        ...

    def close(self) -> None: ...


def shared_ssl_context(cooperative: bool, tls: Tls | None = None) -> ssl.SSLContext:
    """One TLS context per process, kind and trust settings (k3load.client.access.Tls): the system's
    CAs (certifi's where the store is empty), plus a private CA bundle, or no verification at all."""
    return (tls or Tls()).context(cooperative)


def describe(exc: BaseException) -> str:
    """The exception's class and text once each: what a TransportError says (never the request's headers)."""
    text = str(exc) or exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}" if exc.__class__.__name__ not in text else text


def shutdown_socket(sock: socket.socket) -> None:
    """Break a read blocked on `sock` from another thread (a deadline watchdog); a socket already gone is fine."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
