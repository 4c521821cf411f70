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

import errno
import socket
import ssl
import struct
import sys
import time
from collections.abc import Iterator, Mapping

import gevent.monkey
import gevent.socket
from gevent.exceptions import ConcurrentObjectUseError
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPParseError, HTTPSocketPoolResponse

from k3load.client.access import PER_REQUEST_HEADER, Tls, is_header_value
from k3load.client.transport_base import (
    BodyCut,
    ResponseStream,
    Transport,
    TransportError,
    TransportTimeout,
    describe,
    shared_ssl_context,
    shutdown_socket,
)
from k3load.client.transport_httpx import HttpxTransport

# The interface and errors live in k3load.client.transport_base, httpx in k3load.client.transport_httpx;
# callers import them all from here.
__all__ = ["TRANSPORTS", "BodyCut", "GeventTransport", "HttpxTransport", "ResponseStream", "Transport",
           "TransportError", "TransportTimeout", "shared_ssl_context"]

_GEVENT_BLOCK = 64 * 1024  # bytes per recv: one read takes whatever the kernel holds, up to this
_PLAIN_SOCKET = gevent.socket.socket  # what geventhttpclient connects plain http with (its `_wait` is used)
_PER_REQUEST = PER_REQUEST_HEADER.lower()  # however a caller spells it: never in the cached head, never twice
_HEADS_KEPT = 256  # request heads cached per transport (by path, headers, body length); cleared when full
# Linux's SO_TIMESTAMPNS / SCM_TIMESTAMPNS (the same number; Python's socket module names neither): a
# struct timespec of CLOCK_REALTIME with each read. Elsewhere reads are stamped when they return.
_SO_TIMESTAMPNS = 35 if sys.platform.startswith("linux") else None
_ANCILLARY_BYTES = socket.CMSG_SPACE(16)
_TIMESPEC = struct.Struct("qq").unpack


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
                raise BodyCut(f"connection broke mid-body: {describe(exc)}") from None
            drained = len(data) < _GEVENT_BLOCK
            try:
                feed(data)  # b"" tells the parser EOF: completes a read-until-close body, or raises
            except HTTPParseError as exc:
                raise BodyCut(f"body cut: {describe(exc)}" if not data else f"bad HTTP framing: {exc}") from None
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
            shutdown_socket(sock)

    def close(self) -> None:
        self._resp.release()  # returns the socket when complete, else closes it and frees the slot


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
        # every call (20 us, bench/peers.py); the same path, headers and body length give the same bytes. The
        # request's own X-Request-Id (new every time) is kept out of the key and added to the cached head.
        self._heads: dict[tuple[str, tuple[tuple[str, str], ...], int], bytes] = {}

    def _head(self, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        """The request's head: built once per path, shared headers and body length (`_build_request`), with the
        request's own id as the last header line (checked as `_build_request` checks a value)."""
        own = next((v for k, v in headers.items() if k.lower() == _PER_REQUEST), None)
        shared = tuple((k, v) for k, v in headers.items() if k.lower() != _PER_REQUEST)
        key = (path, shared, len(body))
        head = self._heads.get(key)
        if head is None:  # the head depends on nothing else
            head = self._client._build_request("POST", path, body=body, headers=dict(shared)).encode("latin-1")
            if len(self._heads) >= _HEADS_KEPT:
                self._heads.clear()
            self._heads[key] = head
        if own is None:
            return head
        if not is_header_value(own):
            raise ValueError(f"invalid value for header field {PER_REQUEST_HEADER!r}")
        return head[:-2] + f"{PER_REQUEST_HEADER}: {own}\r\n\r\n".encode("latin-1")

    def open(self, path: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> _GeventResponse:
        """Like `HTTPClient.request` (which never retries a POST either), but a gevent.Timeout or
        GreenletExit while the body is being sent gives the socket back instead of leaking its pool
        slot. `timeout_s` is not used: the caller's gevent.Timeout bounds the call."""
        client, pool = self._client, self._client._connection_pool
        head = self._head(path, body, headers)
        try:
            sock = pool.get_socket()
        except TimeoutError as exc:
            raise TransportError(f"connect timed out: {describe(exc)}") from None
        except (OSError, RuntimeError) as exc:
            raise TransportError(describe(exc)) from None
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
                raise TransportError(f"sending the request: {describe(exc)}") from None
        except BaseException:
            pool.release_socket(sock)
            raise
        try:  # from here the response object releases the socket itself, whatever happens
            kind = _StampedHead if stamped else _PoolResponse
            return _GeventResponse(kind(sock, pool, block_size=_GEVENT_BLOCK, method="POST",
                                        headers_type=client.headers_type), stamped, sent)
        except (OSError, HTTPParseError) as exc:
            raise TransportError(f"reading the response head: {describe(exc)}") from None

    def close(self) -> None:
        self._client.close()


TRANSPORTS: dict[str, type[GeventTransport] | type[HttpxTransport]] = {
    GeventTransport.name: GeventTransport, HttpxTransport.name: HttpxTransport}
