"""Misbehaviour of what stands in front of an engine: gateways, load balancers, exporters.

Why apart from faults.py: those faults rewrite what the model and its parser produce; these are on
the wire and in the infrastructure (an nginx error page, a rate limiter's Retry-After, a TCP reset,
a flapping load-balancer health check, a /metrics the gateway does not forward, a scrape that
stalls), so that the harness's verdict rules meet servers that fail the way real fleets do while the
engine behind them is fine.

Every decision here is deterministic: resets are drawn from the request's seeded generator (only
when their rate is set, so profiles without them replay exactly as before), the health flap follows
wall time since the server started, and the metrics stall follows how many chat requests arrived.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from http import HTTPStatus

from aiohttp import web

from k3load.sim.config import FaultProfile
from k3load.sim.protocol import error_body

_NGINX_PAGE = ("<html>\r\n<head><title>{line}</title></head>\r\n<body>\r\n<center><h1>{line}</h1></center>\r\n"
               "<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")


def status_line(status: int) -> str:
    """`502 Bad Gateway`; a status without a standard phrase keeps just its number."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


def injected_error(f: FaultProfile) -> web.Response:
    """The injected HTTP error in the configured style, with `Retry-After` when asked for."""
    status = f.http_error_status
    headers = {"Retry-After": str(f.http_error_retry_after_s)} if f.http_error_retry_after_s > 0 else {}
    if f.http_error_style == "html":  # nginx's own page: text/html without a charset, Server: nginx
        page = _NGINX_PAGE.format(line=status_line(status))
        return web.Response(status=status, body=page.encode(),
                            headers={**headers, "Content-Type": "text/html", "Server": "nginx"})
    if f.http_error_style == "gateway":
        return web.Response(status=status, text=f"upstream error {status}\n", content_type="text/plain",
                            headers=headers)
    kind = "TooManyRequests" if status == 429 else "InternalServerError"
    return web.json_response(error_body(status, "k3load sim: injected server error", kind), status=status,
                             headers=headers)


def reset(request: web.BaseRequest) -> None:
    """Abort the connection with a TCP RST, not a FIN: SO_LINGER {on, 0 s} makes the close discard
    unsent data and reset, as a crashing proxy or a conntrack drop does. A client sees a reset error
    (ECONNRESET), never a clean end of stream."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def hold_open(request: web.BaseRequest, hold_s: float) -> bool:
    """A proxy that passed the answer's `data: [DONE]` on but holds the chunked body open (its last chunk
    sent late, as a gateway that waits on its upstream's close, its own accounting or an idle timer
    does): wait `hold_s` wall seconds, or until the client leaves. True: the client is still there.
    OpenAI's SDK stops reading at [DONE]; a client that reads to the body's end waits the whole hold."""
    end = time.monotonic() + hold_s
    while (left := end - time.monotonic()) > 0:
        transport = request.transport
        if transport is None or transport.is_closing():
            return False
        await asyncio.sleep(min(left, 0.05))
    return request.transport is not None and not request.transport.is_closing()


class FrontDoor:
    """Per-server state of the gateway faults: start time (health flap) and chat requests seen
    (metrics stall window). `clock` is a parameter so unit tests can drive the flap."""

    def __init__(self, profile: FaultProfile, clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile
        self.clock = clock
        self.started_s = clock()
        self.chat_requests = 0

    def saw_chat(self) -> None:
        """Count a POST /v1/chat/completions on arrival (before validation: every request counts)."""
        self.chat_requests += 1

    def health_status(self) -> int:
        """200 in even periods since start, 503 in odd ones (the engine itself stays fine)."""
        period = self.profile.health_flap_period_s
        if period <= 0:
            return 200
        return 503 if int((self.clock() - self.started_s) / period) % 2 else 200

    def metrics_stall_s(self) -> float:
        """Wall seconds this scrape waits: the stall is on while after <= chat requests received
        < after + count (count 0: until the server stops), decided when the scrape arrives."""
        f = self.profile
        if f.metrics_stall_ms <= 0 or self.chat_requests < f.metrics_stall_after_requests:
            return 0.0
        if f.metrics_stall_requests and self.chat_requests >= f.metrics_stall_after_requests + f.metrics_stall_requests:
            return 0.0
        return f.metrics_stall_ms / 1000.0

    def metrics_refusal(self) -> web.Response | None:
        """The main port's /metrics as a gateway that only forwards /v1 answers it (None: served)."""
        status = self.profile.metrics_http_status
        if status == 200:
            return None
        text = "404 page not found\n" if status == 404 else f"{status_line(status)}\n"  # Go net/http's wording
        return web.Response(status=status, text=text, content_type="text/plain")

    async def stall(self) -> None:
        """Hold a /metrics response while the window is open; the chat API keeps serving meanwhile."""
        delay = self.metrics_stall_s()
        if delay:
            await asyncio.sleep(delay)
