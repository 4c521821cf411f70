"""The httpx transport: the reference implementation, and the one that works with plain threads.

Why kept beside geventhttpclient (`k3load.client.transport`, the default): it is the well-known client
the default is measured against (bench/client_cost.py), and it runs without gevent. Its reads are stamped
when they return (httpx hides its sockets, so no kernel receive times); under gevent it is cooperative
only when gevent has patched the socket module. The rules of `k3load.client.transport` hold here too: no
redirect followed, one pool per transport, every response read to its end or closed.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Iterator, Mapping

import gevent
import gevent.monkey
import httpx

from k3load.client.access import Tls
from k3load.client.transport_base import (
    BodyCut,
    TransportError,
    TransportTimeout,
    describe,
    shared_ssl_context,
    shutdown_socket,
)


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
            raise TransportTimeout(describe(exc)) from None
        except httpx.RemoteProtocolError as exc:
            raise BodyCut(f"body cut: {exc}") from None
        except httpx.TransportError as exc:
            raise BodyCut(f"connection broke mid-body: {describe(exc)}") from None
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
            shutdown_socket(sock)

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
            raise TransportError(f"connect timed out: {describe(exc)}") from None
        except httpx.TimeoutException as exc:
            raise TransportTimeout(describe(exc)) from None
        except httpx.TransportError as exc:
            raise TransportError(describe(exc)) from None

    def close(self) -> None:
        self._client.close()
