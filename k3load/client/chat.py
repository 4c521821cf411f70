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

import dataclasses
import json
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import gevent

from k3load.client import result as res
from k3load.client.access import Secrets, Tls, is_header_name
from k3load.client.assemble import TOOL_PART, Assembler, AssemblyError, error_message
from k3load.client.body import (
    INVALID_UTF8_NOTE,
    MAX_BODY_BYTES,
    decode_utf8,
    over_cap_error,
    parse_retry_after,
    read_capped,
)
from k3load.client.origin import redirect_note
from k3load.client.result import StreamResult
from k3load.client.sse import DONE, MAX_LINE_BYTES, SSEDecoder, SSEError
from k3load.client.transport import TRANSPORTS, BodyCut, ResponseStream, Transport, TransportError, TransportTimeout
from k3load.clock import Clock, wall_clock

ERROR_LINE_CHARS = 300  # `error` is one line, at most this long
ERROR_BODY_CHARS = 4000  # `error_body` keeps the start of the server's body
# After [DONE], the longest wait for the message's end (the terminating chunk a server writes right after
# it, often in its own segment): long enough for a busy server or worker, short enough that a body held
# open costs the user only this (its connection is then closed; end_ts is [DONE]'s time either way).
END_WAIT_S = 0.1
_ERROR_BODY_READ_BYTES = 64 * 1024  # an error body is read to its end but only this much kept


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


def one_line(text: str, secrets: Secrets | None, limit: int = ERROR_LINE_CHARS) -> str:
    """Redact first (a cut must never leave half a key), then fold whitespace, then cut."""
    if secrets:
        text = secrets.redact(text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
        self._limits = _Limits(max_body_bytes, max_line_bytes)
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
        exchange = _Exchange(self._transport.name, self._clock, deadline_s, self._secrets,
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


@dataclass(frozen=True)
class _Limits:
    """How much of a response the client keeps (see the module docstring)."""

    body_bytes: int
    line_bytes: int


class _Exchange:
    """The state of one attempt; the first failure recorded decides its status."""

    def __init__(self, transport: str, clock: Clock, deadline_s: float, secrets: Secrets,
                 streaming: bool, limits: _Limits) -> None:
        self.limits = limits
        self.clock = clock
        now = clock()
        self.deadline = now + deadline_s
        self.deadline_s = deadline_s
        self.secrets = secrets
        self.streaming = streaming
        self.result = StreamResult(status="", transport=transport, send_ts=now, end_ts=now)
        self.asm = Assembler()
        self.resp: ResponseStream | None = None
        self.expired = False  # set by the watchdog thread
        self.done_ts: float | None = None  # the time of the read that held [DONE]: the answer's end

    def fail(self, status: str, error: str) -> None:
        if not self.result.status:
            self.result.status = status
            self.result.error = one_line(error, self.secrets)

    def deadline_passed(self) -> None:
        if self.done_ts is not None:
            return  # the answer had ended at [DONE]; only the wait for the message's end was cut
        got = len(self.result.chunk_ts)
        self.fail(res.STATUS_TIMEOUT, f"deadline of {self.deadline_s:g} s passed ({got} token chunks received)")

    def run(self, transport: Transport, path: str, body: bytes, headers: dict[str, str], watchdog: bool) -> None:
        timer: threading.Timer | None = None
        try:
            self.resp = resp = transport.open(path, body, headers, max(self.deadline - self.clock(), 1e-3))
            # when the head reached this machine; the kernel's stamp is read against the wall clock, so it
            # is held inside the run clock's own order (never before the request was sent)
            self.result.first_byte_ts = max(self.clock() - resp.rx_lag, self.result.send_ts)
            self.result.http_status = resp.status
            if watchdog:
                timer = threading.Timer(max(self.deadline - self.clock(), 0.0), self._expire)
                timer.daemon = True
                timer.start()
            if not 200 <= resp.status < 300:
                self._http_error(resp)
            elif self.streaming:
                self._stream(resp)
            else:
                self._whole(resp)
        except TransportTimeout:
            self.deadline_passed()
        except TransportError as exc:
            self._broken(exc)
        finally:
            if timer is not None:
                timer.cancel()
            if self.resp is not None:
                self.resp.close()

    def _expire(self) -> None:
        self.expired = True
        if self.resp is not None:
            self.resp.abort()

    def _broken(self, exc: TransportError) -> None:
        if self.expired or self.clock() >= self.deadline:
            self.deadline_passed()
        elif isinstance(exc, BodyCut):
            self.fail(res.STATUS_TRUNCATED, f"{exc} ({len(self.result.chunk_ts)} token chunks received)")
        else:
            self.fail(res.STATUS_TRANSPORT_ERROR, str(exc))

    def _stream(self, resp: ResponseStream) -> None:
        """THE hot loop: one clock read per socket read, events decoded from it, chunks applied.

        Per token-bearing chunk it adds one test of what the chunk added (a tool-call part or not) and
        one of whether the first answer token is still to come (while the answer is only reasoning, one
        read of the assembler's `answered` too); per read, one test of whether the first event is still
        to come (bench/client_cost.py: no change beyond its noise) and one of whether the stream ended or
        failed (bench/peers.py --baseline: CPU per chunk 0.93-1.02x the tree before, within its noise)."""
        clock, result, asm = self.clock, self.result, self.asm
        decoder, add, chunk_ts = SSEDecoder(self.limits.line_bytes), asm.add, result.chunk_ts
        tool_idx, tool_part, no_event, no_answer = result.tool_chunk_idx, TOOL_PART, True, True
        received, check_at, text_cap = 0, self.limits.body_bytes, self.limits.body_bytes
        floor = result.first_byte_ts or result.send_ts  # stamps never go back in time (see below)
        reads = resp.reads()
        result.stream_reads, result.stream_bytes = 0, 0
        for count, data in enumerate(reads, start=1):
            # When the bytes reached this machine (k3load.client.transport). The transport bounds each read
            # by the one before, on the wall clock; µs of jitter between that clock and the run's could
            # still put a read a hair before the one before it (or the head): held at the last stamp.
            t = clock() - resp.rx_lag
            if t < floor:
                t = floor
            floor = t
            received += len(data)
            result.stream_reads, result.stream_bytes = count, received  # kept as they come: a deadline may cut
            if received > check_at:  # the text is at most the bytes received: summed rarely, so linear
                check_at = received + text_cap
                if asm.text_chars() > text_cap:
                    self.fail(res.STATUS_MALFORMED, f"streamed text over {text_cap} characters after {received} "
                              "body bytes (the rest read and dropped)")
                    break
            try:
                events = decoder.feed(data)
                if no_event and events:
                    result.first_event_ts, no_event = t, False
                for event in events:
                    if event is DONE:  # always the last event of its read: the decoder stops there
                        self.done_ts = t
                    elif got := add(event):  # type: ignore[arg-type]
                        if got & tool_part:
                            tool_idx.append(len(chunk_ts))
                        if no_answer and asm.answered:
                            result.first_answer_ts, no_answer = t, False
                        chunk_ts.append(t)
            except (SSEError, AssemblyError) as exc:
                self._malformed(exc)
            if asm.error is not None:
                self.fail(res.STATUS_STREAM_ERROR, "error event mid-stream: " + error_message(asm.error))
            if decoder.done or result.status:
                break
        if result.status and not decoder.done:
            self._drain(resp, reads, decoder)
        if decoder.done:
            self._after_done(resp, decoder)
        elif not result.status:
            self._stream_end(decoder)

    def _drain(self, resp: ResponseStream, reads: Iterator[bytes], decoder: SSEDecoder) -> None:
        """Failed before [DONE]: the rest is read and dropped, so the connection stays usable. After an
        error event (vLLM sends [DONE] next) the SSE is still sound: decoded on, so its [DONE] ends it."""
        sound = self.asm.error is not None
        for data in reads:
            if sound:
                try:
                    decoder.feed(data)
                except SSEError:
                    sound = False
                if decoder.done:
                    self.done_ts = max(self.clock() - resp.rx_lag, self.result.first_byte_ts or self.result.send_ts)
                    return

    def _after_done(self, resp: ResponseStream, decoder: SSEDecoder) -> None:
        """The answer ended at [DONE]. Its message's end is waited for briefly (END_WAIT_S, within the
        deadline) so the connection can be kept; a body still open is left to close(), which drops its
        connection. Bytes after [DONE] are counted, never kept."""
        result = self.result
        if decoder.invalid_utf8:
            self.fail(res.STATUS_MALFORMED, f"{decoder.invalid_utf8} SSE events {INVALID_UTF8_NOTE}")
        result.after_done_bytes, result.after_done_open = decoder.after_done, True  # if the deadline cuts the wait
        late = resp.wait_end(min(END_WAIT_S, max(self.deadline - self.clock(), 0.0)))
        result.after_done_bytes, result.after_done_open = decoder.after_done + late, not resp.ended

    def _malformed(self, exc: Exception) -> None:
        content_type = self.resp.headers.get("content-type") if self.resp is not None else None
        self.fail(res.STATUS_MALFORMED, f"{exc} (content-type {content_type!r})")

    def _stream_end(self, decoder: SSEDecoder) -> None:
        t, result = self.clock(), self.result
        try:
            for event in decoder.finish():  # an event whose blank line never came
                if result.first_event_ts is None:
                    result.first_event_ts = t
                if event is not DONE and (got := self.asm.add(event)):  # type: ignore[arg-type]
                    if got & TOOL_PART:
                        result.tool_chunk_idx.append(len(result.chunk_ts))
                    if result.first_answer_ts is None and self.asm.answered:
                        result.first_answer_ts = t
                    result.chunk_ts.append(t)
        except (SSEError, AssemblyError) as exc:
            self._malformed(exc)
        if decoder.done:  # `data: [DONE]` as the body's last line: the message ended with it
            result.after_done_bytes, result.after_done_open = 0, False
        if self.asm.error is not None:
            self.fail(res.STATUS_STREAM_ERROR, "error event mid-stream: " + error_message(self.asm.error))
        if decoder.invalid_utf8:
            self.fail(res.STATUS_MALFORMED, f"{decoder.invalid_utf8} SSE events {INVALID_UTF8_NOTE}")
        if not decoder.done:
            cut = f", cut mid-line after {decoder.pending_bytes} bytes" if decoder.pending_bytes else ""
            self.fail(res.STATUS_TRUNCATED, f"stream ended without [DONE] after {decoder.events} events{cut}")

    def _whole(self, resp: ResponseStream) -> None:
        body = read_capped(resp.reads(), self.limits.body_bytes, _ERROR_BODY_READ_BYTES)
        data = body.data
        if body.over_cap:
            self.result.error_body = self._body_text(data)
            self.fail(res.STATUS_MALFORMED, over_cap_error(body, self.limits.body_bytes))
            return
        text, valid_utf8 = decode_utf8(data)
        try:
            self.asm.add_completion(json.loads(text))
        except (ValueError, RecursionError, AssemblyError) as exc:
            self.result.error_body = self._body_text(data)
            kind = "not a chat completion" if isinstance(exc, AssemblyError) else "not JSON"
            self.fail(res.STATUS_MALFORMED, f"response body is {kind}: {exc}")
            return
        if self.asm.error is not None:
            self.result.error_body = self._body_text(data)
            self.fail(res.STATUS_STREAM_ERROR, "error object in a 2xx body: " + error_message(self.asm.error))
        if not valid_utf8:
            self.fail(res.STATUS_MALFORMED, f"response body is {INVALID_UTF8_NOTE}")

    def _http_error(self, resp: ResponseStream) -> None:
        self.fail(res.STATUS_HTTP_ERROR, f"HTTP {resp.status}")  # decided before the body: a cut body stays this
        # An HTTP-date is the server's wall clock: read against ours, not the run's anchored clock (k3load.clock),
        # which a stepped wall clock leaves behind (seen: 20 s read as 53 s after a 28 s step).
        wait = self.result.retry_after_s = parse_retry_after(resp.headers.get("retry-after"), time.time())
        data = _capped(resp.reads(), _ERROR_BODY_READ_BYTES)
        text = self._body_text(data)
        self.result.error_body = text
        after = f" (Retry-After {wait:g} s)" if wait is not None else ""
        note = redirect_note(resp.status, resp.headers.get("location"))  # a 3xx: never followed, named
        detail = f"{note}; {_error_detail(data, text)}" if note else _error_detail(data, text)
        self.result.error = one_line(f"HTTP {resp.status}: {detail}{after}", self.secrets)

    def _body_text(self, data: bytes) -> str:
        text = data.decode("utf-8", "backslashreplace")  # bytes that are not UTF-8 kept, as \xNN
        return self.secrets.redact(text)[:ERROR_BODY_CHARS]

    def finish(self) -> StreamResult:
        result = self.result
        self.asm.fill(result)
        result.end_ts = self.clock() if self.done_ts is None else self.done_ts
        if result.chunk_ts:
            result.first_token_ts = result.chunk_ts[0]
        if not result.status:
            result.status = res.STATUS_OK
        if self.secrets:
            _redact_answer(result, self.secrets)
        return result


def _redact_answer(result: StreamResult, secrets: Secrets) -> None:
    """A server that echoes the request's headers in its answer (a debugging proxy, a test double) must
    not put them in a record: the text and the tool calls are kept with every secret replaced."""
    result.content, result.reasoning = secrets.redact(result.content), secrets.redact(result.reasoning)
    result.tool_calls = [dataclasses.replace(call, name=secrets.redact(call.name) if call.name else call.name,
                                             arguments=secrets.redact(call.arguments), id=secrets.redact(call.id)
                                             if call.id else call.id) for call in result.tool_calls]


def _error_detail(data: bytes, text: str) -> str:
    """vLLM/OpenAI `{"error": {...}}`, `{"error": "..."}` or `{"message": ...}`; else (a gateway's
    text/plain or HTML page) the body's first line."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        body = None
    if type(body) is dict:
        error = body.get("error")
        if type(error) is dict:
            return error_message(error)
        if type(error) is str:
            return error
        if "message" in body:
            return error_message(body)
    return text.strip().splitlines()[0] if text.strip() else "(empty body)"


def _capped(reads: Iterator[bytes], limit: int) -> bytes:
    """Read to the end (keeps the connection) but keep only the first `limit` bytes."""
    kept = bytearray()
    for data in reads:
        if len(kept) < limit:
            kept += data[: limit - len(kept)]
    return bytes(kept)
