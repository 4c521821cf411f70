"""Incremental Server-Sent-Events decoder for OpenAI-style streams: raw socket reads in, JSON chunks out.

Why our own: this is the hot loop of every streamed request. Library line iterators either wait for
a full block (first token read late) or cost a regex and a str decode per line. Here each read is
split on b"\\n" once, whole lines are handled as bytes (so a read that ends in the middle of a line
or of a UTF-8 character is simply kept for the next one), and `json.loads` takes the payload bytes.

Framing follows the SSE spec (html.spec.whatwg.org, "server-sent events"): `data:` lines accumulate
and a blank line dispatches the event; comment lines (`: ping`) and the `event:`/`id:`/`retry:`
fields are skipped; `\\r\\n` line ends are accepted. Stricter than the spec on purpose: an unknown
field or a line without a colon is *garbage* (the spec says ignore it, which would silently drop
what a broken proxy or server sent), and every payload but `[DONE]` must be a JSON object.
A lone `\\r` as a line end (allowed by the spec, sent by no OpenAI-compatible server) is not
supported: it shows up as a JSON error.

Linear in its input, whatever the line length: an unfinished line is kept as the list of reads that
hold it, and only each new read is searched for the line end, so a 50 MB line costs one join, not
one re-join per 64 KB read (which was quadratic: 14-21 s of CPU). A line longer than `max_line_bytes`
is never held whole: past the cap its bytes are only counted and hashed, and the line's end raises
SSELineTooLong with its length and sha256. Payloads that are not valid UTF-8 are decoded with
`surrogateescape` (each bad byte kept as a lone surrogate U+DC80..U+DCFF, so the original bytes can
be recovered) and counted in `invalid_utf8`, for the caller to report.

The stream ends at `[DONE]`, as OpenAI's SDK reads it: the read that completes that event returns it as
its last event, and whatever came after it in that read (and in any read fed later) is counted in
`after_done`, never decoded nor held. Why: a proxy may keep the body open, or send pings, after the
answer ended; the answer is the server's and what follows is not part of it.
"""

from __future__ import annotations

import hashlib
import json
import json.scanner
from typing import Any, Final

DONE: Final = "[DONE]"  # the event after the last chunk; `event is DONE` tells it apart from chunks
_KNOWN_FIELDS: Final = (b"event", b"id", b"retry")
_LINE_STARTS: Final = (b"data:", b":", b"event:", b"id:", b"retry:")
_EXCERPT_BYTES: Final = 120
# C scanner: (text, index) -> (value, end). typeshed types its context as a make_scanner (its own TODO: any
# decoder with the parse_* attributes does, as json.JSONDecoder itself passes one)
_SCAN: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
MAX_LINE_BYTES: Final = 1 << 20  # default cap on one SSE line (a vLLM chunk is well under 1 KiB)

SSEEvent = dict[str, Any] | str  # a decoded JSON chunk, or DONE


class SSEError(ValueError):
    """The bytes are not the SSE stream they must be. `line` is 1-based within the response body."""

    kind = "sse"

    def __init__(self, message: str, line: int, excerpt: bytes) -> None:
        shown = excerpt[:_EXCERPT_BYTES]
        more = "…" if len(excerpt) > _EXCERPT_BYTES else ""
        super().__init__(f"{message} at SSE line {line}: {shown!r}{more}")
        self.line = line
        self.excerpt = bytes(shown)


class SSEFormatError(SSEError):
    """A line that is neither a `data:` field, a known field, a comment nor blank."""

    kind = "format"


class SSEJSONError(SSEError):
    """A `data:` payload that is not `[DONE]` and not a JSON object."""

    kind = "json"


class SSELineTooLong(SSEError):
    """A line longer than the decoder's `max_line_bytes`: counted and hashed, never held whole."""

    kind = "line_too_long"


class _Overflow:
    """A line past the cap: its length and sha256 so far, and its first bytes for the message."""

    __slots__ = ("excerpt", "hash", "size")

    def __init__(self, parts: list[bytes]) -> None:
        self.hash = hashlib.sha256()
        self.size = 0
        self.excerpt = b"".join(parts)[:_EXCERPT_BYTES + 1]
        for part in parts:
            self.add(part)

    def add(self, data: bytes) -> None:
        self.hash.update(data)
        self.size += len(data)


class SSEDecoder:
    """Feed it every read as it arrives; it returns the events completed by that read.

    One decoder per response. `feed` never loses bytes: an incomplete trailing line waits in
    `pending_bytes` for the next read, whatever byte it was cut at (as the list of reads that hold
    it: joined once, when its end arrives).
    """

    __slots__ = ("_data", "_held", "_line", "_over", "_parts", "after_done", "done", "events", "invalid_utf8",
                 "max_line_bytes")

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be positive, not {max_line_bytes!r}")
        self.max_line_bytes = max_line_bytes
        self._parts: list[bytes] = []  # the reads holding an unfinished line, in order
        self._held = 0  # the unfinished line's length so far (held in _parts, or past the cap)
        self._over: _Overflow | None = None  # the unfinished line is past the cap: counted and hashed
        self._data: list[bytes] = []  # data lines of the event being built
        self._line = 0  # lines completed so far (for error positions)
        self.events = 0  # events dispatched so far
        self.done = False  # [DONE] seen: the stream ended there
        self.after_done = 0  # bytes fed after the [DONE] event's blank line (counted, never decoded)
        self.invalid_utf8 = 0  # payloads that were not valid UTF-8 (decoded with surrogateescape)

    @property
    def pending_bytes(self) -> int:
        """Bytes of an unfinished line held back (non-zero at EOF means the body ended mid-line)."""
        return self._held

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Decode one read. Raises SSEFormatError / SSEJSONError / SSELineTooLong on malformed input.

        A read that completes the `[DONE]` event returns it last; the rest of that read, and every read
        fed after it, is only counted (`after_done`)."""
        if self.done:
            self.after_done += len(data)
            return []
        if not self._held and not self._data and data.find(b"\n") == len(data) - 2 and data.endswith(b"\n\n") \
                and data.startswith(b"data: ") and data[-3] != 13 and len(data) <= self.max_line_bytes:
            # Nearly every read of a paced stream is one whole event: `data: {...}` and its blank line.
            # The same steps as the loop below (two lines counted, one payload dispatched), without the
            # split and the per-line tests (bench/peers.py).
            self._line += 2
            self._data.append(data[6:-2])
            return [self._dispatch()]
        if self._held:
            data = self._line_end(data)
            if not data:
                return []
        lines = data.split(b"\n")
        tail = lines.pop()
        # a read bigger than the cap may hold a whole over-long line: refused once the lines before it
        # are read (a [DONE] among them ends the stream first)
        too_long = self._first_too_long(lines) if len(data) > self.max_line_bytes and lines else len(lines)
        out: list[SSEEvent] = []
        pending = self._data
        start = self._line
        for line in lines[:too_long] if too_long < len(lines) else lines:
            self._line += 1
            if line.startswith(b"data:"):
                if line[-1] == 13:  # b"\r"
                    line = line[:-1]
                pending.append(line[6:] if len(line) > 5 and line[5] == 32 else line[5:])  # one b" " dropped
            elif not line or line == b"\r":
                if pending:
                    out.append(self._dispatch())
                    if self.done:  # the rest of this read is after the stream's end
                        self.after_done = len(data) - sum(len(x) + 1 for x in lines[:self._line - start])
                        return out
            elif line[0] != 58:  # b":" starts a comment
                self._other_field(line.rstrip(b"\r"))
        if too_long < len(lines):
            self._hold(lines[too_long])
            self._too_long()
        if tail:
            self._hold(tail)
        return out

    def _line_end(self, data: bytes) -> bytes:
        """With a line unfinished: b"" while it stays so (the read is held), else the line's reads
        joined once with this one. Only the new read is searched: linear in the input."""
        end = data.find(b"\n")
        if end < 0:
            self._hold(data)
            return b""
        if self._over is not None or self._held + end > self.max_line_bytes:
            self._hold(data[:end])
            self._too_long()
        self._parts.append(data)
        joined = b"".join(self._parts)
        self._parts, self._held = [], 0
        return joined

    def _hold(self, data: bytes) -> None:
        """Keep a piece of the unfinished line; past the cap, only count and hash it."""
        self._held += len(data)
        if self._over is not None:
            self._over.add(data)
            return
        self._parts.append(data)
        if self._held > self.max_line_bytes:
            self._over = _Overflow(self._parts)
            self._parts = []

    def _first_too_long(self, lines: list[bytes]) -> int:
        """Index of the first whole line longer than the cap (len(lines): none is)."""
        cap = self.max_line_bytes
        return next((i for i, line in enumerate(lines) if len(line) > cap), len(lines))

    def _too_long(self) -> None:
        over = self._over
        assert over is not None
        self._line += 1
        raise SSELineTooLong(f"line over {self.max_line_bytes} bytes ({over.size} bytes, sha256 "
                             f"{over.hash.hexdigest()})", self._line, over.excerpt)

    def finish(self) -> list[SSEEvent]:
        """At EOF: dispatch an event whose blank line never came. An unfinished line that starts
        like a field is left out (see `pending_bytes`): a body cut mid-line is a truncation, not a
        malformed stream. One that cannot be SSE (a JSON error body, an HTML page) raises."""
        if self._over is not None:
            self._too_long()
        tail = b"".join(self._parts).rstrip(b"\r")
        if tail and not any(tail.startswith(p) or p.startswith(tail) for p in _LINE_STARTS):
            raise SSEFormatError("not an SSE field (unterminated last line)", self._line + 1, tail)
        return [self._dispatch()] if self._data else []

    def _other_field(self, line: bytes) -> None:
        name, colon, _ = line.partition(b":")
        if not colon or name not in _KNOWN_FIELDS:
            raise SSEFormatError("not an SSE field", self._line, line)

    def _dispatch(self) -> SSEEvent:
        data = self._data
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        data.clear()
        self.events += 1
        if payload == b"[DONE]":
            self.done = True
            return DONE
        event = _parse(payload)
        if type(event) is not dict:
            if isinstance(event, _Escaped):
                self.invalid_utf8 += 1
                event = event.value
                if type(event) is dict:
                    return event
            if isinstance(event, _Invalid):
                raise SSEJSONError(f"invalid JSON ({event.reason})", self._line, payload)
            raise SSEJSONError("data is JSON but not an object", self._line, payload)
        return event


class _Invalid:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Escaped:
    """A payload that parsed only once its invalid UTF-8 bytes were kept as lone surrogates."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _parse(payload: bytes) -> Any:
    """JSON from bytes at a third of `json.loads(bytes)`'s cost: that one sniffs the encoding and
    runs two whitespace regexes per call (8.5 vs 2.5 µs on a 220-byte chunk). The C scanner
    (json.scanner, stdlib since 2.6) parses the decoded text; anything it does not take whole
    (leading or trailing whitespace, an error) goes through json.loads for the exact verdict."""
    try:
        text = payload.decode()
        event, end = _SCAN(text, 0)
        if end == len(text):
            return event
    except (StopIteration, ValueError, RecursionError):
        pass  # the slow path below says precisely what is wrong
    try:
        return json.loads(payload)
    except UnicodeDecodeError:
        pass  # not UTF-8: parse with the bad bytes kept as lone surrogates
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, deep nesting
        return _Invalid(str(exc))
    try:
        return _Escaped(json.loads(payload.decode("utf-8", "surrogateescape")))
    except (ValueError, RecursionError) as exc:
        return _Invalid(str(exc))
