"""Whole response bodies and headers as the client keeps them: capped, hashed past the cap, bytes
that are not UTF-8 kept escaped, and `Retry-After` read as seconds.

Why: a server (or a proxy in front of it) can send anything. A 50 MB non-streamed reply read whole
and kept in the record made records.jsonl 201 MB and the harness 542 MB; so a body is kept up to a
cap and, past it, only counted and hashed (sha256 over the whole body, computed as it streams), so
the record still says exactly what came. Bytes that are not UTF-8 are never replaced by U+FFFD (that
loses them): they are decoded with `surrogateescape` and so written to the record as `\\udcXX`
escapes, from which `text.encode("utf-8", "surrogateescape")` gives the original bytes back.
"""

from __future__ import annotations

import email.utils
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

MAX_BODY_BYTES: Final = 8 << 20  # default cap on a whole body kept (a chat completion is a few KiB)


@dataclass
class Body:
    """What was read of one body: `data` is all of it, or only its start when `sha256` is set."""

    data: bytes
    size: int  # bytes received in all
    sha256: str | None = None  # set only when the body went over the cap (hash of the whole body)

    @property
    def over_cap(self) -> bool:
        return self.sha256 is not None


def read_capped(reads: Iterator[bytes], cap: int, keep_when_over: int) -> Body:
    """Read a body to its end (so the connection stays usable), holding at most `cap` bytes.

    Past the cap the reads are hashed and counted, and only the first `keep_when_over` bytes are
    kept (for `error_body`)."""
    parts: list[bytes] = []
    size = 0
    digest = None
    for data in reads:
        size += len(data)
        if digest is not None:
            digest.update(data)
            continue
        parts.append(data)
        if size > cap:
            digest = hashlib.sha256()
            for part in parts:
                digest.update(part)
            parts = [_head(parts, keep_when_over)]
    return Body(b"".join(parts), size, digest.hexdigest() if digest is not None else None)


def _head(parts: list[bytes], keep: int) -> bytes:
    """The first `keep` bytes of `parts`, without joining them all (that would copy the whole cap)."""
    head = bytearray()
    for part in parts:
        if len(head) >= keep:
            break
        head += part[: keep - len(head)]
    return bytes(head)


def over_cap_error(body: Body, cap: int) -> str:
    """The one-line error of a body over the cap: its size and the hash of all of it."""
    return f"body over {cap} bytes ({body.size} bytes, sha256 {body.sha256})"


def decode_utf8(data: bytes) -> tuple[str, bool]:
    """(text, valid): invalid UTF-8 bytes are kept as lone surrogates, never replaced."""
    try:
        return data.decode(), True
    except UnicodeDecodeError:
        return data.decode("utf-8", "surrogateescape"), False


INVALID_UTF8_NOTE: Final = "not valid UTF-8 (bad bytes kept as \\udcXX escapes)"


def parse_retry_after(value: str | None, now_ts: float) -> float | None:
    """Seconds to wait from a `Retry-After` header (RFC 9110 10.2.3): delay-seconds, or an HTTP-date
    (seconds from `now_ts`, epoch, never below 0). None when absent or unreadable (a wrong header is
    the server's problem, not a reason to wait)."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None  # an HTTP-date is always GMT; a date without a zone is not one
        return max(when.timestamp() - now_ts, 0.0)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
