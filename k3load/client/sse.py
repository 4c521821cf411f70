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
"""

from __future__ import annotations

import json
import json.scanner
from typing import Any, Final

DONE: Final = "[DONE]"  # the event after the last chunk; `event is DONE` tells it apart from chunks
_KNOWN_FIELDS: Final = (b"event", b"id", b"retry")
_LINE_STARTS: Final = (b"data:", b":", b"event:", b"id:", b"retry:")
_EXCERPT_BYTES: Final = 120
_SCAN: Final = json.scanner.make_scanner(json.JSONDecoder())  # C scanner: (text, index) -> (value, end)

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


class SSEDecoder:
    """Feed it every read as it arrives; it returns the events completed by that read.

    One decoder per response. `feed` never loses bytes: an incomplete trailing line waits in
    `pending_bytes` for the next read, whatever byte it was cut at.
    """

    __slots__ = ("_data", "_line", "_tail", "done", "events")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []  # data lines of the event being built
        self._line = 0  # lines completed so far (for error positions)
        self.events = 0  # events dispatched so far
        self.done = False  # [DONE] seen

    @property
    def pending_bytes(self) -> int:
        """Bytes of an unfinished line held back (non-zero at EOF means the body ended mid-line)."""
        return len(self._tail)

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Decode one read. Raises SSEFormatError / SSEJSONError on malformed input."""
        if self._tail:
            data = self._tail + data
        lines = data.split(b"\n")
        self._tail = lines.pop()
        out: list[SSEEvent] = []
        pending = self._data
        for line in lines:
            self._line += 1
            if line.startswith(b"data:"):
                if line[-1] == 13:  # b"\r"
                    line = line[:-1]
                pending.append(line[6:] if len(line) > 5 and line[5] == 32 else line[5:])  # one b" " dropped
            elif not line or line == b"\r":
                if pending:
                    out.append(self._dispatch())
            elif line[0] != 58:  # b":" starts a comment
                self._other_field(line.rstrip(b"\r"))
        return out

    def finish(self) -> list[SSEEvent]:
        """At EOF: dispatch an event whose blank line never came. An unfinished line that starts
        like a field is left out (see `pending_bytes`): a body cut mid-line is a truncation, not a
        malformed stream. One that cannot be SSE (a JSON error body, an HTML page) raises."""
        tail = self._tail.rstrip(b"\r")
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
            if isinstance(event, _Invalid):
                raise SSEJSONError(f"invalid JSON ({event.reason})", self._line, payload)
            raise SSEJSONError("data is JSON but not an object", self._line, payload)
        return event


class _Invalid:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


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
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, deep nesting
        return _Invalid(str(exc))
