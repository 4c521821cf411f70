"""Production traces in the Mooncake format (FAST '25, kvcache-ai/Mooncake `FAST25-release/traces`), read for
a `kind: replay` stage (k3load.loadgen.replay).

One JSON object a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`timestamp`: the request's arrival in ms since the trace began (several rows may share one); `input_length`
and `output_length`: its prompt and answer in tokens; `hash_ids`: one id per `block_tokens`-token block of the
prompt (512 in Mooncake's traces), equal ids meaning equal blocks, so leading ids shared between rows are a
shared prefix (as NVIDIA Dynamo's `benchmarks/data_generator` and AIPerf's `mooncake_trace` loader read it).

Why strict: a trace is outside bytes, and a replay that silently skipped or reordered rows would offer another
load than production's. So every bad line is one TraceError naming `file:line` and what is wrong; rows must
come in time order (equal timestamps allowed; a trace out of order is refused, never sorted: its order is the
evidence); `hash_ids` must cover the prompt exactly (ceil(input_length / block_tokens) ids: a mismatch means
the trace was cut in other blocks than the plan's `block_tokens` says). Keys beyond the four are ignored
(extended traces carry e.g. a session id). Bounded: a line over MAX_LINE_BYTES, a row of more than
MAX_HASH_IDS blocks, or more than MAX_ROWS rows is refused. `.gz` files are read through gzip.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3load.errors import InputError

MAX_LINE_BYTES = 1 << 20  # one row's JSON: a 512k-token prompt's 1,024 ids take about 8 KiB
MAX_ROWS = 2_000_000  # Mooncake's published traces hold 12k-24k rows; a day of a busy service fits
MAX_HASH_IDS = 8192  # 4M tokens at 512 a block: past any model's context


class TraceError(InputError):
    """A trace that cannot be replayed: the message names the file and line."""


@dataclass(frozen=True)
class TraceRow:
    """One request of the trace: `line` is its 1-based line in the file."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int


def _int(row: dict[str, Any], key: str, where: str, minimum: int) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {key} must be an integer, got {_shown(value)}")
    if value < minimum:
        raise TraceError(f"{where}: {key} must be at least {minimum}, got {value}")
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value) if value is not None else "nothing"
    return text if len(text) <= 40 else text[:37] + "..."


def parse_row(text: str | bytes, where: str, line: int, block_tokens: int) -> TraceRow:
    """One line as a row; every problem is a TraceError starting with `where` (the file and line)."""
    if len(text) > MAX_LINE_BYTES:
        raise TraceError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
    try:
        row = json.loads(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise TraceError(f"{where}: not JSON ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    stamp = row.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp) or stamp < 0:
        raise TraceError(f"{where}: timestamp must be a number of ms at or after 0, got {_shown(stamp)}")
    input_length = _int(row, "input_length", where, 1)
    output_length = _int(row, "output_length", where, 1)
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers at or above 0, got {_shown(ids)}")
    if len(ids) > MAX_HASH_IDS:
        raise TraceError(f"{where}: {len(ids)} hash_ids, more than {MAX_HASH_IDS}")
    blocks = -(-input_length // block_tokens)
    if len(ids) != blocks:
        raise TraceError(f"{where}: {len(ids)} hash_ids for input_length {input_length}, which is {blocks} "
                         f"block(s) of block_tokens {block_tokens}: is the stage's block_tokens the trace's?")
    return TraceRow(float(stamp), input_length, output_length, tuple(ids), line)


def parse_lines(lines: Iterable[str | bytes], name: str, block_tokens: int = 512,
                max_rows: int | None = None) -> Iterator[TraceRow]:
    """The rows of a trace's lines, in order (blank lines skipped); stops after `max_rows`."""
    last: TraceRow | None = None
    count = 0
    for number, text in enumerate(lines, start=1):
        if max_rows is not None and count >= max_rows:
            return
        if len(text) <= MAX_LINE_BYTES and not text.strip():
            continue
        row = parse_row(text, f"{name}:{number}", number, block_tokens)
        if last is not None and row.timestamp_ms < last.timestamp_ms:
            raise TraceError(f"{name}:{number}: timestamp {row.timestamp_ms:g} is before line {last.line}'s "
                             f"{last.timestamp_ms:g}: a trace's rows must come in time order")
        count += 1
        if count > MAX_ROWS:
            raise TraceError(f"{name}:{number}: more than {MAX_ROWS} rows (set the stage's max_rows)")
        last = row
        yield row


def _bounded_lines(handle: io.BufferedIOBase) -> Iterator[bytes]:
    """Lines, each read no further than MAX_LINE_BYTES + 1 (a file of one endless line is not read whole)."""
    while line := handle.readline(MAX_LINE_BYTES + 1):
        yield line


def read_trace(path: Path, block_tokens: int = 512, max_rows: int | None = None) -> list[TraceRow]:
    """Every row of the file (or its first `max_rows`); a file that cannot be read, is empty or holds a bad
    line is one TraceError naming it."""
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as handle:
            rows = list(parse_lines(_bounded_lines(handle), str(path), block_tokens, max_rows))
    except (OSError, EOFError, zlib.error) as exc:  # gzip's BadGzipFile is an OSError; a corrupt stream, zlib's
        raise TraceError(f"{path}: cannot read the trace ({getattr(exc, 'strerror', None) or exc})") from None
    if not rows:
        raise TraceError(f"{path}: no rows")
    return rows


_READ: dict[tuple[Any, ...], list[TraceRow]] = {}
_READ_KEPT = 4  # traces kept parsed per process (a plan names a few)


def read_trace_once(path: Path, block_tokens: int = 512, max_rows: int | None = None) -> list[TraceRow]:
    """`read_trace`, parsed once per process while the file is unchanged: the plan's check reads it before the
    run, and a replay stage's start (on the gevent hub, where 200,000 rows would stall every user for
    seconds) takes the rows parsed then (found in review)."""
    try:
        stat = path.stat()
    except OSError:
        return read_trace(path, block_tokens, max_rows)  # says why, as a TraceError
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, block_tokens, max_rows)
    rows = _READ.get(key)
    if rows is None:
        rows = read_trace(path, block_tokens, max_rows)
        while len(_READ) >= _READ_KEPT:
            _READ.pop(next(iter(_READ)))
        _READ[key] = rows
    return rows


def shared_prefix_blocks(rows: Iterable[TraceRow]) -> list[int]:
    """Per row, how many of its leading blocks some earlier row already carried: the prefix a cache that kept
    every block could have served (equal ids chained from the start, as a prefix cache hashes them)."""
    seen: set[tuple[int, int]] = set()
    node_of: dict[tuple[int, int], int] = {}
    out = []
    for row in rows:
        node, shared, matching = 0, 0, True
        for block in row.hash_ids:
            key = (node, block)
            if matching and key in seen:
                shared += 1
            else:
                matching = False
                seen.add(key)
            node = node_of.setdefault(key, len(node_of) + 1)
        out.append(shared)
    return out
