"""An agent's request log, line by line: each line's JSON, or the reason it cannot be used, named `file:line`.

    for line in read_log(Path("agent.jsonl.gz")):
        line.where, line.data, line.problem     # "agent.jsonl.gz:12", {...} or None, None or "not JSON: ..."

Why line by line and bounded: a production log is large and written by someone else. One line over
MAX_LINE_BYTES (a body cap: no chat request is that large, and reading it whole would hold it in
memory) is skipped unread to its end and named; a line that is not UTF-8, not JSON, or JSON nested
past what a strict reader takes (k3load.workload.strict_json) is named with its reason. Nothing here
raises for the content of a line; an unreadable file (missing, not gzip) is a `LogFileError` naming it.
Blank lines are skipped silently (a trailing newline is not a bad line).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from k3load.errors import InputError
from k3load.workload import strict_json

MAX_LINE_BYTES = 32 * 1024 * 1024  # the body cap: one logged request (with its answer) larger is refused
_CHUNK = 1024 * 1024


class LogFileError(InputError):
    """A log file that cannot be read at all: the message names it."""


@dataclass(frozen=True)
class LogLine:
    """One non-blank line: its JSON value, or why it has none."""

    where: str  # "file:line", 1-based
    data: Any = None
    problem: str | None = None


def _open(path: Path) -> IO[bytes]:
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise LogFileError(f"{path}: cannot read the log: {exc.strerror or exc}") from None
    if path.suffix == ".gz":
        return gzip.GzipFile(fileobj=handle, mode="rb")  # type: ignore[return-value]
    return handle


def _lines(handle: IO[bytes], limit: int) -> Iterator[bytes | None]:
    """Each line's bytes, or None for a line over `limit` (read past without keeping it)."""
    while True:
        line = handle.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or (line.endswith(b"\n") and len(line) == limit + 1):
            yield line
            continue
        while line and not line.endswith(b"\n"):  # the rest of the over-long line, dropped as read
            line = handle.readline(_CHUNK)
        yield None


def read_log(path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[LogLine]:
    """Every non-blank line of `path` (`.gz` read as gzip), as `LogLine`s in file order."""
    handle = _open(path)
    try:
        for number, raw in enumerate(_lines(handle, max_line_bytes), start=1):
            where = f"{path}:{number}"  # as given: two logs of one name in two folders stay apart
            if raw is None:
                yield LogLine(where, problem=f"over the body cap of {max_line_bytes:,} bytes")
                continue
            if not raw.strip():
                continue
            yield _parsed(where, raw)
    except (OSError, EOFError, zlib.error) as exc:  # a truncated or corrupt gzip stream
        raise LogFileError(f"{path}: cannot read the log: {exc}") from None
    finally:
        handle.close()


def _parsed(where: str, raw: bytes) -> LogLine:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return LogLine(where, problem=f"not UTF-8 text ({exc.reason} at byte {exc.start})")
    parsed = strict_json.parse(text)
    if isinstance(parsed, strict_json.Refused):
        return LogLine(where, problem=f"not JSON: {parsed.reason}")
    if "\\u" in text and _lone_surrogate(parsed.value):
        return LogLine(where, problem="a string holds a lone surrogate escape (\\uD800-\\uDFFF unpaired): no "
                                      "UTF-8 body can carry it")
    return LogLine(where, data=parsed.value)


def _lone_surrogate(value: object) -> bool:
    """Whether a string in the value holds a surrogate that was not half of a pair (JSON escapes one as
    `\\ud800`): such a str cannot be encoded, so the request could never be sent (found in review: the run
    would die at its first body)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
