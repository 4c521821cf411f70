"""One chat-completion attempt on an open transport: the state it moves through and what its result records.

Why apart from `k3load.client.chat`: the client holds what lasts (the connection pool, the headers, the
limits); an `Exchange` is one request's life (open, read the head, stream or read the whole body, fail
once, finish) and is thrown away with it. The rules it keeps (the first failure decides the status, one
timestamp per socket read, the wait for the message's end after [DONE], secrets redacted from everything
kept) are the client's and are told in `k3load.client.chat`'s docstring.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from k3load.client import result as res
from k3load.client.access import Secrets
from k3load.client.assemble import TOOL_PART, Assembler, AssemblyError, error_message
from k3load.client.body import INVALID_UTF8_NOTE, decode_utf8, over_cap_error, parse_retry_after, read_capped
from k3load.client.origin import redirect_note
from k3load.client.result import StreamResult
from k3load.client.sse import DONE, SSEDecoder, SSEError
from k3load.client.transport import BodyCut, ResponseStream, Transport, TransportError, TransportTimeout
from k3load.clock import Clock

ERROR_LINE_CHARS = 300  # `error` is one line, at most this long
ERROR_BODY_CHARS = 4000  # `error_body` keeps the start of the server's body
# After [DONE], the longest wait for the message's end (the terminating chunk a server writes right after
# it, often in its own segment): long enough for a busy server or worker, short enough that a body held
# open costs the user only this (its connection is then closed; end_ts is [DONE]'s time either way).
END_WAIT_S = 0.1
_ERROR_BODY_READ_BYTES = 64 * 1024  # an error body is read to its end but only this much kept


def one_line(text: str, secrets: Secrets | None, limit: int = ERROR_LINE_CHARS) -> str:
    """Redact first (a cut must never leave half a key), then fold whitespace, then cut."""
    if secrets:
        text = secrets.redact(text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Limits:
    """How much of a response the client keeps (see the module docstring)."""

    body_bytes: int
    line_bytes: int


class Exchange:
    """The state of one attempt; the first failure recorded decides its status."""

    def __init__(self, transport: str, clock: Clock, deadline_s: float, secrets: Secrets,
                 streaming: bool, limits: Limits) -> None:
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
