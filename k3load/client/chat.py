"""ChatClient: one chat-completion request in, one StreamResult out, with or without Locust.

Why it never raises for server misbehaviour: a load test must count every way a server fails (HTTP
status, in-band error, cut stream, bad bytes, stall, dead socket) as data, so each ends as a
StreamResult with a STATUS_* and a one-line `error`; only programming errors propagate. Retries are
the runner's job, so nothing here retries.

Timing: every `*_ts` is epoch seconds from one perf_counter clock anchored once to time.time(), so
intervals between them are monotonic and exact while the values still join with other wall-clock
timelines. One timestamp per socket read: every token-bearing chunk decoded from a read gets the
time of that read (`chunk_ts`); `first_token_ts` is the first of them, `first_answer_ts` the first
that added content or a tool-call part (after any reasoning: what a user of an agent waits for);
`first_byte_ts` is when the status line and headers were in; `first_event_ts` the read that held the
stream's first SSE event (vLLM's role chunk: prefill done). `tool_chunk_idx` marks the chunks that
carried a tool-call part, so a call held back and sent whole after a silence is told from one streamed
piece by piece.

The answer ends at `data: [DONE]`, as OpenAI's SDK reads it: the client stops reading there and
`end_ts` is that read's time. The message's own end (the chunked body's last chunk) usually comes with
it or a moment later, and is waited for at most END_WAIT_S so the connection can go back to the pool; a
body still open then (a proxy holding the connection) is left and its connection closed, never reused,
never drained. What came after [DONE] meanwhile is counted (`after_done_bytes`), never kept, and
`after_done_open` says the body was still open. Before, such an answer was read until the proxy let go:
20 s of end-to-end time the server never spent, and the user stalled for it.

Deadline: `deadline_s` bounds the whole request, stream included. Cooperative transports (always
geventhttpclient; httpx under gevent's monkey-patching) run inside a `gevent.Timeout`, which is a
BaseException and is caught here by identity. httpx in a plain process bounds each phase before the
headers by the remaining time and has a watchdog thread shut the socket down at the deadline, so a
read stalled mid-stream still ends on time.

Limits: a whole body is kept up to `max_body_bytes` (default 8 MiB), a streamed answer's text up to
as many characters, and one SSE line up to `max_line_bytes` (default 1 MiB); past a cap the attempt
is `malformed` with an error that says so ("body over N bytes (M bytes, sha256 ...)", "line over N
bytes (M bytes, sha256 ...)" or "streamed text over N characters ..."), and the rest is read, counted
and dropped, so a runaway server costs neither memory nor a record. Bytes that are not UTF-8 are kept
escaped (k3load/client/body.py) and make the attempt `malformed`, its text still kept. An HTTP
error's `Retry-After` is read into `retry_after_s` (the runner's backoff honours it).

The API key goes only into the Authorization header, gateway headers (`secrets=Secrets(...)`, see
k3load/client/access.py) into their own; the key and every header value are replaced by "[redacted]"
in every error text, body, answer text and tool call kept (a server may echo them anywhere), and
`repr` never shows them. `tls=Tls(ca_bundle=...)` or `Tls(insecure=True)` sets the trust for https.
A client is one connection pool: build it once per user (or share it), never per request. Without
gevent patching, a geventhttpclient-based client belongs to the thread that made it; use
transport="httpx" to share one across threads.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

import gevent

from k3load.client.access import Secrets, Tls, is_header_name
from k3load.client.body import MAX_BODY_BYTES
from k3load.client.exchange import Exchange, Limits
from k3load.client.result import StreamResult
from k3load.client.sse import MAX_LINE_BYTES
from k3load.client.transport import TRANSPORTS, Transport
from k3load.clock import Clock, wall_clock


def wants_stream(body: bytes) -> bool:
    """The body's own top-level `"stream"` field (a full parse: a byte search can be fooled)."""
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False  # not a JSON object: the server will answer 400 as a whole body


def chat_url(base_url: str) -> tuple[str, str]:
    """(origin, path) of the chat endpoint: `http://h:8000` and `http://h:8000/v1` both work, as does a
    gateway prefix (`https://gw/llm/v1`). Credentials in the URL are refused: use api_key."""
    parts = urlsplit(base_url.strip().rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("base_url must be an http(s):// URL with a host")
    if parts.username or parts.password:
        raise ValueError("base_url must not carry credentials: pass api_key")
    prefix = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}", prefix + ("/chat/completions" if prefix.endswith("/v1")
                                                         else "/v1/chat/completions")


class ChatClient:
    """POSTs canonical JSON bodies to `<base_url>/v1/chat/completions` over one connection pool."""

    def __init__(self, base_url: str, api_key: str | None = None, transport: str = "geventhttpclient",
                 connect_timeout_s: float = 10.0, max_connections: int = 1024, *,
                 secrets: Secrets | None = None, tls: Tls | None = None,
                 ssl_context: ssl.SSLContext | None = None, clock: Clock | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, not {transport!r}")
        if max_body_bytes < 1 or max_line_bytes < 1:
            raise ValueError("max_body_bytes and max_line_bytes must be positive")
        self._limits = Limits(max_body_bytes, max_line_bytes)
        origin, self._path = chat_url(base_url)
        self.base_url = base_url.rstrip("/")
        if secrets is not None and api_key:
            raise ValueError("give api_key or secrets, not both")
        self._secrets = secrets if secrets is not None else Secrets(api_key or None)
        self._headers = {"Content-Type": "application/json", **self._secrets.request_headers()}
        self._taken = frozenset(name.lower() for name in self._headers)  # a request's own may not replace these
        self._transport: Transport = TRANSPORTS[transport](origin, connect_timeout_s, max_connections,
                                                           ssl_context, tls)
        self._clock = clock or wall_clock()

    @property
    def transport(self) -> str:
        return self._transport.name

    def send(self, body: bytes, deadline_s: float, *, stream: bool | None = None,
             headers: Mapping[str, str] | None = None) -> StreamResult:
        """One attempt, ended by completion, failure or `deadline_s` seconds after the call.

        `stream` overrides reading the body's `"stream"` field (saves a parse of a big body). `headers` are
        this request's own (its `X-Request-Id`, a session id for an affinity router): names and values are
        checked (no line breaks, no header of the key's or the gateway's), never secrets."""
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, not {deadline_s!r}")
        sent = self._headers if not headers else {**self._headers, **self._own(headers)}
        exchange = Exchange(self._transport.name, self._clock, deadline_s, self._secrets,
                             wants_stream(body) if stream is None else stream, self._limits)
        if not self._transport.cooperative:
            exchange.run(self._transport, self._path, body, sent, watchdog=True)
            return exchange.finish()
        timer = gevent.Timeout(deadline_s)
        timer.start()
        try:
            exchange.run(self._transport, self._path, body, sent, watchdog=False)
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            exchange.deadline_passed()
        finally:
            timer.close()
        return exchange.finish()

    def _own(self, headers: Mapping[str, str]) -> dict[str, str]:
        """A request's own headers, refused where they would replace the client's (Content-Type, the key,
        a gateway header) or split the head (a line break)."""
        for name, value in headers.items():
            if name.lower() in self._taken:
                raise ValueError(f"header {name!r} is the client's own (content type, API key or gateway header)")
            if not is_header_name(name) or any(c in value for c in "\r\n\0"):
                raise ValueError(f"header {name!r}: not a header name, or a value with a line break")
        return dict(headers)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        key = "set" if self._secrets.api_key else "none"
        names = [name for name, _ in self._secrets.headers]
        extra = f", headers={names}" if names else ""
        return f"ChatClient({self.base_url!r}, transport={self.transport!r}, api_key={key}{extra})"
