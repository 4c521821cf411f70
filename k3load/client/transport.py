"""Streaming HTTP transports behind one small interface: POST, status + headers, raw reads, close.

Why two: geventhttpclient is the default (measured about 2x cheaper per chunk than httpx under
gevent and much tighter on first-token timing; see /work/shared/notes/client-performance.md and
bench/client_cost.py); httpx is the reference and works with plain threads. Both hand back the
bytes each socket read returned, so the SSE decoder stamps one timestamp per read and splits lines
itself (geventhttpclient's `readline()` defaults to b"\\r\\n" and finds nothing on SSE; its
`read(n)` waits until n bytes are buffered; httpx's line iterators cost more per line).

Kernel receive times (geventhttpclient over plain TCP on Linux): each read also says how long its
bytes waited in the kernel (`rx_lag`, from SO_TIMESTAMPNS), so a token is stamped when it reached
this machine, not when a busy worker got round to it. At 256 streams one engine step lands 256 reads
at once, and the last of them was stamped about 9 ms late (bench/peers.py): the server's latency
must not include the client's queue. The kernel stamps the newest segment a read took, so a read
is never stamped before its last bytes arrived, nor before the previous read of that socket (or the
request was sent). The response head's first read is stamped too (`_StampedHead`): a worker busy with
other streams reads the head late, and by then the first tokens have often arrived with it; read
unstamped, they were timed when the worker got to them (16 streams of 16-token answers: p99 1.2-2.3 ms
late, bench/peers.py). The head's stamp is kept only when that one read held the whole head.

Rules kept here: a redirect is never followed (the key and the gateway headers would go with it; the
chat client names where it pointed, k3load.client.origin.redirect_note); one pool per transport, built
once; one TLS context per process and kind (building one costs 23-33 ms of CPU); every response read to
its end or closed (a response left half-read keeps its pool slot in geventhttpclient), and one whose
reader stopped early (an SSE stream at [DONE]) waits briefly for its message's end (`wait_end`): a
connection goes back to the pool only once its message ended, else it is closed. Failures are
raised as TransportError and its subclasses, with messages that name what happened and never the
request headers.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Protocol

import gevent.monkey
import gevent.socket
import httpx
from gevent.exceptions import ConcurrentObjectUseError
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPParseError, HTTPSocketPoolResponse

from k3load.client.access import Tls

_GEVENT_BLOCK = 64 * 1024  # bytes per recv: one read takes whatever the kernel holds, up to this
_PLAIN_SOCKET = gevent.socket.socket  # what geventhttpclient connects plain http with (its `_wait` is used)
_HEADS_KEPT = 256  # request heads cached per transport (by path, headers, body length); cleared when full
# Linux's SO_TIMESTAMPNS / SCM_TIMESTAMPNS (the same number; Python's socket module names neither): a
# struct timespec of CLOCK_REALTIME with each read. Elsewhere reads are stamped when they return.
_SO_TIMESTAMPNS = 35 if sys.platform.startswith("linux") else None
_ANCILLARY_BYTES = socket.CMSG_SPACE(16)
_TIMESPEC = struct.Struct("qq").unpack


class TransportError(Exception):
    """The request could not be made or the connection broke (connect refused, reset, TLS, DNS)."""


class TransportTimeout(TransportError):
    """A read, write or pool wait ran past the time the caller allowed."""


class BodyCut(TransportError):
    """The response body ended before the HTTP message did (EOF, reset, cut chunked encoding)."""


class ResponseStream(Protocol):
    """One response: status and headers are known when `Transport.open` returns."""

    status: int
    headers: Mapping[str, str]  # names in lower case
    rx_lag: float  # seconds the last read's bytes had waited in the kernel when it returned (0: not known)

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


def _describe(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}" if exc.__class__.__name__ not in text else text


# -- geventhttpclient ------------------------------------------------------------------------------
class _PoolResponse(HTTPSocketPoolResponse):
    """geventhttpclient's response, but an interim answer's end (1xx, RFC 9110 15.2: a gateway may send
    100 or 103 unasked) keeps the socket. Why: geventhttpclient 2.6 releases the socket at the end of
    every message, the interim one included, so the final answer's body was cut after its first read
    (and the socket went back to the pool while the answer was still arriving)."""

    def _on_message_complete(self) -> None:
        if self.get_code() < 200:
            self.message_complete = True  # the parser starts the final answer on this socket
            return
        super()._on_message_complete()


class _StampedHead(_PoolResponse):
    """geventhttpclient's response, its head's first read taken with the kernel's receive time. Why:
    the first tokens often arrive with the head (or while a busy worker has not read it yet); that read
    is the only one geventhttpclient makes itself, through plain `recv`. `arrived` is kept only when the
    read held the whole head of a final response (no 1xx before it): otherwise geventhttpclient read on,
    unstamped, and bytes of those reads may have arrived later."""

    arrived: float | None = None  # wall time the head's bytes reached this machine (None: not known)
    read_wall = 0.0  # wall time that read returned

    def _read_headers(self, pre_buffered: bytes = b"") -> None:
        sock = self._sock
        if sock is not None and not pre_buffered:
            try:
                data, ancillary, _flags, _addr = sock.recvmsg(self.block_size, _ANCILLARY_BYTES)
            except BaseException:
                self.release()  # as geventhttpclient's own head reading does on any failure
                raise
            self.read_wall = time.time()
            if ancillary and b"\r\n\r\n" in data and not data.startswith((b"HTTP/1.1 1", b"HTTP/1.0 1")):
                sec, nsec = _TIMESPEC(ancillary[0][2])
                self.arrived = sec + nsec * 1e-9
            pre_buffered = data  # b"" (closed): geventhttpclient reads again and says so, as before
        super()._read_headers(pre_buffered)


class _GeventResponse:
    """Reads the socket itself: recv -> feed the llhttp parser -> hand over the parsed body bytes.

    Uses private attributes of geventhttpclient 2.6 (`_sock`, `_body_buffer`; the client's
    `_build_request` and `_connection_pool` in GeventTransport.open) and of gevent 26's socket
    (`_wait`, `_read_event`), both pinned in pyproject: its public `read(n)` blocks until n bytes are
    buffered and `readline` splits lines for us."""

    rx_lag = 0.0  # seconds the bytes of the last read waited in the kernel (0: not known)

    def __init__(self, resp: HTTPSocketPoolResponse, stamped: bool = False, sent: float = 0.0) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.headers = {name.lower(): value for name, value in resp.items()}
        self._stamped = stamped  # the socket gives kernel receive times
        self._sent = sent  # wall time the request was sent: nothing of the answer arrived before it
        # the head's kernel receive time (None: not known), which the body bytes read with it share
        self._head_arrived = resp.arrived if isinstance(resp, _StampedHead) else None
        # no body read is stamped before the head's read returned (the caller's first_byte_ts comes first)
        self._head_wall = resp.read_wall if isinstance(resp, _StampedHead) else time.time()
        if self._head_arrived is not None:
            self.rx_lag = self._lag(time.time(), self._head_arrived)

    def _lag(self, now: float, arrived: float) -> float:
        """How long bytes that arrived at `arrived` had waited at `now`, never reaching back before the
        request was sent (a clock step cannot move them earlier)."""
        return min(max(now - arrived, 0.0), max(now - self._sent, 0.0))

    def reads(self) -> Iterator[bytes]:
        """Once per read of the hot loop: recv, feed, hand over; written out inline (no helper calls)."""
        resp = self._resp
        buf, feed = resp._body_buffer, resp.feed
        drained = False  # the last recv took less than a block: the kernel held nothing more then
        stamped, wall, since = self._stamped, time.time, self._head_wall
        if buf and self._head_arrived is not None:  # body bytes that came with the head: its arrival
            data = bytes(buf)
            del buf[:]
            self.rx_lag = self._lag(wall(), self._head_arrived)
            yield data
        while True:
            if buf:
                data = bytes(buf)
                del buf[:]
                yield data
            if resp.message_complete:
                return
            sock = resp._sock
            if sock is None:
                raise BodyCut("connection released before the end of the body")
            try:
                if drained and type(sock) is _PLAIN_SOCKET:
                    # wait until readable, then recv: gevent's recv would first try one that can only fail
                    # with EAGAIN (a syscall and a raised OSError per read of a paced stream). Not for TLS:
                    # its object may hold decrypted bytes the kernel no longer shows as readable.
                    sock._wait(sock._read_event)
                if stamped:
                    data, ancillary, _flags, _addr = sock.recvmsg(_GEVENT_BLOCK, _ANCILLARY_BYTES)
                    now = wall()
                    if ancillary:  # bounded by the previous read: a clock step cannot move a token earlier
                        sec, nsec = _TIMESPEC(ancillary[0][2])
                        self.rx_lag = min(max(now - sec - nsec * 1e-9, 0.0), max(now - since, 0.0))
                    else:
                        self.rx_lag = 0.0
                    since = now
                else:
                    data = sock.recv(_GEVENT_BLOCK)
            except (OSError, ConcurrentObjectUseError) as exc:
                raise BodyCut(f"connection broke mid-body: {_describe(exc)}") from None
            drained = len(data) < _GEVENT_BLOCK
            try:
                feed(data)  # b"" tells the parser EOF: completes a read-until-close body, or raises
            except HTTPParseError as exc:
                raise BodyCut(f"body cut: {_describe(exc)}" if not data else f"bad HTTP framing: {exc}") from None
            if not data and not resp.message_complete:
                raise BodyCut("connection closed before the end of the body")

    @property
    def ended(self) -> bool:
        return bool(self._resp.message_complete)

    def wait_end(self, wait_s: float) -> int:
        """Reads with a socket timeout (no second gevent timer beside the caller's deadline), then one
        last look that does not wait: a busy worker may wake for the time limit before it reads an end
        that had already arrived, and that connection is still kept."""
        resp = self._resp
        count = self._take()
        limit = time.monotonic() + wait_s
        while not resp.message_complete and (left := limit - time.monotonic()) > 0:
            if not self._read_within(left):
                break
            count += self._take()
        if not resp.message_complete and self._read_within(0.0):
            count += self._take()
        return count

    def _take(self) -> int:
        """Body bytes the parser holds, dropped: their count."""
        buf = self._resp._body_buffer
        count = len(buf)
        del buf[:]
        return count

    def _read_within(self, timeout_s: float) -> bool:
        """One read of at most `timeout_s` fed to the parser; False when nothing came, the connection
        ended or broke, or the bytes are not HTTP."""
        resp = self._resp
        sock = resp._sock
        if sock is None:
            return False
        before = sock.gettimeout()
        sock.settimeout(timeout_s)
        try:
            data = sock.recv(_GEVENT_BLOCK)
        except (OSError, ConcurrentObjectUseError):  # timed out (TimeoutError), nothing there, broken
            return False
        finally:
            sock.settimeout(before)  # before feeding: a message that ends there gives the socket back
        try:
            resp.feed(data)
        except HTTPParseError:
            return False
        return bool(data)

    def abort(self) -> None:
        sock = self._resp._sock
        if sock is not None:
            _shutdown(sock)

    def close(self) -> None:
        self._resp.release()  # returns the socket when complete, else closes it and frees the slot


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class GeventTransport:
    """geventhttpclient: gevent sockets, so cooperative with or without monkey-patching."""

    name = "geventhttpclient"
    cooperative = True

    def __init__(self, base_url: str, connect_timeout_s: float, max_connections: int,
                 ssl_context: ssl.SSLContext | None = None, tls: Tls | None = None) -> None:
        options: dict[str, object] = {}
        if base_url.startswith("https:"):
            ctx = ssl_context or shared_ssl_context(True, tls)
            options = {"ssl_context_factory": lambda *_a, **_k: ctx, "insecure": not ctx.check_hostname}
        # network_timeout=None: no socket timeout, so no gevent timer armed and cancelled around every
        # read; the caller's gevent.Timeout is the limit (this transport is always cooperative)
        self._client = HTTPClient.from_url(base_url, concurrency=max_connections, block_size=_GEVENT_BLOCK,
                                           connection_timeout=connect_timeout_s, network_timeout=None, **options)
        # request heads already built: geventhttpclient's _build_request validates and merges headers on
        # every call (20 us, bench/peers.py); the same path, headers and body length give the same bytes
        self._heads: dict[tuple[str, tuple[tuple[str, str], ...], int], bytes] = {}

    def open(self, path: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> _GeventResponse:
        """Like `HTTPClient.request` (which never retries a POST either), but a gevent.Timeout or
        GreenletExit while the body is being sent gives the socket back instead of leaking its pool
        slot. `timeout_s` is not used: the caller's gevent.Timeout bounds the call."""
        client, pool = self._client, self._client._connection_pool
        key = (path, tuple(headers.items()), len(body))
        head = self._heads.get(key)
        if head is None:  # the head depends on nothing else: built once per path, headers and body length
            head = client._build_request("POST", path, body=body, headers=dict(headers)).encode("latin-1")
            if len(self._heads) >= _HEADS_KEPT:
                self._heads.clear()
            self._heads[key] = head
        try:
            sock = pool.get_socket()
        except TimeoutError as exc:
            raise TransportError(f"connect timed out: {_describe(exc)}") from None
        except (OSError, RuntimeError) as exc:
            raise TransportError(_describe(exc)) from None
        stamped = _SO_TIMESTAMPNS is not None and type(sock) is _PLAIN_SOCKET
        if stamped:
            try:  # once per request, before sending: every segment of the answer is stamped on arrival
                sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            except OSError:
                stamped = False
        sent = time.time() if stamped else 0.0
        try:
            sock.sendall(head + body)
        except OSError as exc:  # a server may answer early (401, 413) and close: read that answer
            if exc.errno not in (errno.ECONNRESET, errno.EPIPE):
                pool.release_socket(sock)
                raise TransportError(f"sending the request: {_describe(exc)}") from None
        except BaseException:
            pool.release_socket(sock)
            raise
        try:  # from here the response object releases the socket itself, whatever happens
            kind = _StampedHead if stamped else _PoolResponse
            return _GeventResponse(kind(sock, pool, block_size=_GEVENT_BLOCK, method="POST",
                                        headers_type=client.headers_type), stamped, sent)
        except (OSError, HTTPParseError) as exc:
            raise TransportError(f"reading the response head: {_describe(exc)}") from None

    def close(self) -> None:
        self._client.close()


# -- httpx -----------------------------------------------------------------------------------------
class _HttpxResponse:
    rx_lag = 0.0  # httpx hides its socket's reads: stamped when they return

    def __init__(self, resp: httpx.Response, cooperative: bool) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.headers = dict(resp.headers.items())  # httpx gives lower-case names
        self._cooperative = cooperative
        self._raw: Iterator[bytes] | None = None  # httpx's iterator, kept for wait_end
        self.ended = False

    def reads(self) -> Iterator[bytes]:
        # a for loop, not `yield from`: a reader that stops early closes this generator, and wait_end
        # must still find httpx's iterator open
        self._raw = raw = self._resp.iter_raw()
        try:
            for data in raw:  # noqa: UP028
                yield data
        except httpx.TimeoutException as exc:
            raise TransportTimeout(_describe(exc)) from None
        except httpx.RemoteProtocolError as exc:
            raise BodyCut(f"body cut: {exc}") from None
        except httpx.TransportError as exc:
            raise BodyCut(f"connection broke mid-body: {_describe(exc)}") from None
        self.ended = True

    def wait_end(self, wait_s: float) -> int:
        """httpx reads on with the timeout fixed when the response began, so the wait is bounded from
        outside: a gevent.Timeout under gevent, else a timer thread that shuts the socket down (httpx
        then closes that connection rather than pooling it)."""
        raw = self._raw
        if self.ended or raw is None:
            return 0
        count = 0
        timer: gevent.Timeout | None = None
        watchdog: threading.Timer | None = None
        if self._cooperative:
            timer = gevent.Timeout(wait_s)
            timer.start()
        else:
            watchdog = threading.Timer(wait_s, self.abort)
            watchdog.daemon = True
            watchdog.start()
        try:
            for data in raw:
                count += len(data)
            self.ended = True
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
        except (httpx.HTTPError, httpx.StreamError):
            pass  # broken, shut down at the limit, or closed: not ended, so its connection is not kept
        finally:
            if timer is not None:
                timer.close()
            if watchdog is not None:
                watchdog.cancel()
        return count

    def abort(self) -> None:
        if self._resp.is_closed:  # read to its end: its connection may already serve another request
            return
        stream = self._resp.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            _shutdown(sock)

    def close(self) -> None:
        self._resp.close()


class HttpxTransport:
    """httpx: the reference transport; cooperative only when gevent has patched the socket module."""

    name = "httpx"

    def __init__(self, base_url: str, connect_timeout_s: float, max_connections: int,
                 ssl_context: ssl.SSLContext | None = None, tls: Tls | None = None) -> None:
        self.cooperative = gevent.monkey.is_module_patched("socket")
        self._connect_timeout_s = connect_timeout_s
        httpx_log = logging.getLogger("httpx")
        if httpx_log.level == logging.NOTSET:
            httpx_log.setLevel(logging.WARNING)  # httpx logs every request at INFO
        # httpx builds a context for every Client even for http:// URLs (23-33 ms each): always share one
        verify = ssl_context or shared_ssl_context(self.cooperative, tls)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.Client(base_url=base_url, limits=limits, verify=verify, follow_redirects=False,
                                    timeout=httpx.Timeout(None, connect=connect_timeout_s))

    def open(self, path: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> _HttpxResponse:
        """Without gevent, each phase before the headers is bounded by `timeout_s` (the caller's
        remaining time): reads, writes and the pool wait; the connect by the smaller of that and
        connect_timeout_s. Under gevent the caller's gevent.Timeout is the limit, so reads get no
        timeout of their own (which would arm and cancel a gevent timer around every socket read)."""
        timeout = httpx.Timeout(None if self.cooperative else timeout_s,
                                connect=min(self._connect_timeout_s, timeout_s))
        request = self._client.build_request("POST", path, content=body, headers=headers, timeout=timeout)
        try:
            return _HttpxResponse(self._client.send(request, stream=True, follow_redirects=False), self.cooperative)
        except httpx.ConnectTimeout as exc:
            raise TransportError(f"connect timed out: {_describe(exc)}") from None
        except httpx.TimeoutException as exc:
            raise TransportTimeout(_describe(exc)) from None
        except httpx.TransportError as exc:
            raise TransportError(_describe(exc)) from None

    def close(self) -> None:
        self._client.close()


TRANSPORTS: dict[str, type[GeventTransport] | type[HttpxTransport]] = {
    GeventTransport.name: GeventTransport, HttpxTransport.name: HttpxTransport}
