"""Compact evidence: `records.jsonl.gz` and `metrics.jsonl.gz`, gzip-compressed JSON lines written as they happen.

Why compressed: an hour at 100 requests/s wrote 650 MB of records (1.8 KB each) and 110 MB of scrapes (31 KB
each at 1 Hz). Deflated as one stream the records take about 250 B each; a scrape line with its series
names written once per file (`SeriesTable`) about 0.9 KB (2 KB deflated whole): 258 B per request
together on `make demo` (54 requests/s), 283 B on tests/data/scale-run (35/s; `bench/evidence_size.py`).
Nothing is dropped: compression met the 300 B target, so every line reads back as it was written and
no check reads less than before.

Why gzip and the standard library: `zcat records.jsonl.gz | jq` still works, nothing to install, and a
truncated stream (a killed run) still reads back up to the cut. Columnar files (Parquet) would need
pyarrow and could not be appended to a line at a time.

Why a sync flush at most every `FLUSH_EVERY_S`: deflate output reaches the file only at a flush; a
flush per line would cost the compression (290 B per record at one flush per record, against 253). `GzipSink`
flushes when an append comes `FLUSH_EVERY_S` after the last flush, and a flusher (a thread; a greenlet
where gevent patched `threading`, as in every Locust process) flushes an idle log: a `kill -9` loses at
most the last `FLUSH_EVERY_S` of lines. A reopened file gets a new gzip member (gzip reads members in turn).

Why one reader (`lines`; `Follow` for a file still being written): every reader of records or metrics
(analysis, summaries, the web UI's tail, worker spools, benchmarks, tests) opens either the compressed
file or a legacy plain `.jsonl` of an older run, and splits at "\\n" only, as
`k3load.records.jsonl_lines` explains.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import queue
import sys
import threading
import zlib
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from k3load.evidence_sinks import FLUSH_EVERY_S as FLUSH_EVERY_S  # the writers, re-exported
from k3load.evidence_sinks import LEVEL as LEVEL
from k3load.evidence_sinks import FileAppender as FileAppender
from k3load.evidence_sinks import GzipSink as GzipSink
from k3load.evidence_sinks import PlainSink as PlainSink
from k3load.evidence_sinks import start_flusher as start_flusher

RECORDS, METRICS = "records.jsonl.gz", "metrics.jsonl.gz"
LEGACY = {RECORDS: "records.jsonl", METRICS: "metrics.jsonl"}  # what runs before compact evidence wrote
READ_BYTES = 1 << 20


def evidence_file(run_dir: Path, name: str) -> Path:
    """`run_dir/name` (compressed) when there, else its legacy plain file when that is there, else `run_dir/name`."""
    path = run_dir / name
    legacy = run_dir / LEGACY.get(name, name)
    return legacy if not path.exists() and legacy.exists() else path


def records_file(run_dir: Path) -> Path:
    return evidence_file(run_dir, RECORDS)


def metrics_file(run_dir: Path) -> Path:
    return evidence_file(run_dir, METRICS)


class Inflater:
    """Whole lines of a gzip stream fed in pieces: any number of members; a truncated stream gives every
    line before the cut. `rest` is the text after the last "\\n" (a torn line, or the end of the file).
    `feed` is `inflate` then `split`: `lines` may inflate in another thread (`_read_ahead`)."""

    def __init__(self, errors: str = "strict") -> None:
        self._z = zlib.decompressobj(wbits=31)
        self._text = codecs.getincrementaldecoder("utf-8")(errors)
        self._pending: list[str] = []  # the text after the last "\n", in pieces (joined once its end comes)

    def feed(self, data: bytes) -> list[str]:
        """The lines completed by `data`, each with its "\\n"; raises zlib.error on data that is not gzip."""
        return self.split(self.inflate(data))

    def inflate(self, data: bytes) -> bytes:
        """The bytes `data` inflates to; raises zlib.error on data that is not gzip."""
        out = []
        while data:
            out.append(self._z.decompress(data))
            if not self._z.eof:
                break
            data = self._z.unused_data  # another member follows (a log reopened by a later writer)
            self._z = zlib.decompressobj(wbits=31)
        return b"".join(out)

    def split(self, inflated: bytes) -> list[str]:
        """The lines completed by the next inflated bytes, each with its "\\n"."""
        text = self._text.decode(inflated)
        if "\n" not in text:  # a line longer than a block: kept in pieces, never copied block after block
            if text:
                self._pending.append(text)
            return []
        *whole, rest = text.split("\n")  # at "\n" only: U+2028 and the like are text in a JSON string
        if self._pending:
            whole[0] = "".join([*self._pending, whole[0]])
        self._pending = [rest] if rest else []
        return [line + "\n" for line in whole]

    @property
    def rest(self) -> str:
        """The text after the last "\\n" (a torn line, or the end of the file)."""
        return "".join(self._pending)


def lines(path: Path, errors: str = "strict", *, inflate_ahead: bool = False) -> Iterator[str]:
    """The lines of a JSONL file, compressed (`.gz`) or plain, each with its "\\n"; the last one without it
    when the file does not end in "\\n" (a torn line: the callers skip it as they always have). Raises
    ValueError where a compressed file stops being gzip (bytes changed: not a truncation).

    `inflate_ahead`: a compressed file is inflated in a second thread while this one splits and the caller
    reads, where that can run in parallel (`_read_ahead`). Why: zlib lets go of the GIL while it inflates,
    and an hour's records (91 MB deflated, 710 MB of text) take 1.6 s to inflate on this machine's cores."""
    if path.name.endswith(".gz"):
        yield from _inflated(path, errors, inflate_ahead)
        return
    with path.open(encoding="utf-8", errors=errors, newline="\n") as handle:
        yield from handle


def _inflated(path: Path, errors: str, ahead: bool) -> Iterator[str]:
    text = Inflater(errors)  # its split only: `blocks` inflates
    for piece in blocks(path, inflate_ahead=ahead):
        yield from text.split(piece)
    if text.rest:
        yield text.rest


def blocks(path: Path, *, inflate_ahead: bool = False) -> Iterator[bytes]:
    """The bytes of a JSONL file in pieces that end anywhere (a compressed file's inflated), for a reader that
    splits lines itself (analysis/run/rundata.py: msgspec reads UTF-8 bytes as they are). Raises ValueError where
    a compressed file stops being gzip; `inflate_ahead` as for `lines`."""
    if not path.name.endswith(".gz"):
        with path.open("rb") as handle:
            while block := handle.read(READ_BYTES):
                yield block
        return
    pieces = _inflate_blocks(path, Inflater().inflate)
    yield from _read_ahead(pieces) if inflate_ahead and _threads_run_in_parallel() else pieces


def _inflate_blocks(path: Path, inflate: Callable[[bytes], bytes]) -> Generator[bytes, None, None]:
    offset = 0
    with path.open("rb") as handle:
        while block := handle.read(READ_BYTES):
            try:
                yield inflate(block)
            except zlib.error as exc:
                raise ValueError(f"{path}: not a gzip stream near byte {offset}: {exc}") from exc
            offset += len(block)


def _threads_run_in_parallel() -> bool:
    """False where gevent patched `threading` (every Locust process): a thread would be a greenlet there,
    running only while the reader waits for it, so reading ahead would gain nothing and cost a switch."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is None or not monkey.is_module_patched("threading")


_END = object()
READ_AHEAD = 4  # inflated blocks waiting at most (about 8 MB each from an hour's records)


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _read_ahead(items: Generator[bytes, None, None], depth: int = READ_AHEAD) -> Iterator[bytes]:
    """`items`, produced by a daemon thread up to `depth` ahead of the reader; the thread's exception is
    raised here, in turn. A reader that stops early (an error, a `break`) stops the thread, which closes
    `items` (and so its file) before this generator returns."""
    handoff: queue.Queue[Any] = queue.Queue(depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            with contextlib.closing(items):
                for item in items:
                    if not put(item):
                        return
            put(_END)
        except BaseException as exc:  # handed to the reader, raised there
            put(_Failed(exc))

    thread = threading.Thread(target=produce, name="k3load-inflate-ahead", daemon=True)
    thread.start()
    try:
        while (item := handoff.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()


FOLLOW_CHUNK = 4 << 20  # bytes a follower reads at once


class Follow:
    """Whole lines appended to a file since the last call, for a reader that follows a run as it is written
    (the web UI's tail, the master waiting on a worker's spool): a compressed file's up to its writer's last
    flush, a plain file's up to its last "\\n"; a torn last line waits for its end. Another file at the path
    (a run moved aside, a new one begun under the same name) is read from its start."""

    def __init__(self, path: Path, errors: str = "replace") -> None:
        self.path, self._errors = path, errors
        self._restart(None)

    def _restart(self, identity: tuple[int, int] | None) -> None:
        self.offset, self._identity, self._inflater = 0, identity, Inflater(self._errors)

    def new_lines(self) -> list[str]:
        """Each with its "\\n"; [] while the file is missing, and once a compressed one stops being gzip."""
        return list(self.iter_new_lines())

    def iter_new_lines(self, chunk_bytes: int = FOLLOW_CHUNK) -> Iterator[str]:
        """`new_lines` read `chunk_bytes` at a time, so a reader that comes back after hours (a capacity search
        begun late in a day, a web UI page opened late) holds one chunk's lines at once, never the file's.
        Consume it whole: the position moves on as lines are given."""
        try:
            with self.path.open("rb") as handle:
                stat = os.fstat(handle.fileno())
                if (stat.st_dev, stat.st_ino) != self._identity or stat.st_size < self.offset:
                    self._restart((stat.st_dev, stat.st_ino))
                handle.seek(self.offset)
                compressed = self.path.name.endswith(".gz")
                while data := handle.read(chunk_bytes):
                    if compressed:
                        self.offset += len(data)
                        try:
                            yield from self._inflater.feed(data)
                        except zlib.error:
                            return
                        continue
                    while b"\n" not in data and len(data) % chunk_bytes == 0:  # a line longer than a chunk
                        more = handle.read(chunk_bytes)
                        if not more:
                            break
                        data += more
                    end = data.rfind(b"\n") + 1
                    if not end:
                        return  # a torn last line waits for its end
                    self.offset += end
                    handle.seek(self.offset)
                    text = data[:end].decode("utf-8", errors=self._errors)
                    yield from (line + "\n" for line in text.split("\n")[:-1])
        except OSError:
            return


class SeriesTable:
    """A metrics line with its `samples` names written once per file: `sample_keys` ({index: name}, only
    names this file has not seen yet) and `sample_values` ([[index, value], ...], the samples in order)
    stand where `samples` stood. Why: a scrape repeats about 350 series names (31 KB); the values alone
    are 5 KB, and deflated 0.9 KB, against 2 KB for the whole line deflated.

    One table per writer and one per reader, each reading lines in file order: a later writer (a new gzip
    member) numbers from 0 again and redefines what it uses, which replaces the earlier entries."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def encode(self, row: dict[str, Any]) -> dict[str, Any]:
        samples = row.get("samples")
        if not isinstance(samples, dict):
            return row
        out: dict[str, Any] = {}
        for key, value in row.items():
            if key != "samples":
                out[key] = value
                continue
            new = {name: len(self._index) + i for i, name in enumerate(n for n in samples if n not in self._index)}
            if new:
                self._index.update(new)
                out["sample_keys"] = {str(i): name for name, i in new.items()}
            out["sample_values"] = [[self._index[name], v] for name, v in samples.items()]
        return out

    def learn(self, row: Any) -> None:
        """The names a line defines, without decoding it: a reader skipping lines it does not want (the rows
        before a capacity search's step) still reads the later ones right."""
        keys = row.get("sample_keys") if isinstance(row, dict) else None
        if isinstance(keys, dict):
            try:
                self._names.update((int(i), name) for i, name in keys.items())
            except (TypeError, ValueError):
                return

    def decode(self, row: Any) -> Any:
        """The line as it was before `encode` (keys in the same order); any other line as it is."""
        if not isinstance(row, dict) or "sample_values" not in row:
            return row
        out: dict[str, Any] = {}
        for key, value in row.items():
            if key == "sample_keys":
                self._names.update((int(i), name) for i, name in value.items())
            elif key == "sample_values":
                try:
                    out["samples"] = {self._names[i]: v for i, v in value}
                except (KeyError, TypeError, ValueError) as exc:  # a name never defined before this line
                    raise ValueError(f"sample_values: {type(exc).__name__}: {exc}") from exc
            else:
                out[key] = value
        return out
