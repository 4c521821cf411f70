"""Load a run directory into typed tables: the only input of every judgment.

Why one loader: `k3load analyze DIR` must judge a directory copied from a GPU cluster exactly as the
run that wrote it did, so nothing downstream reads files or the clock on its own. Missing files are
empty tables (a pillar then says `not_run` or `inconclusive`, with the reason), never an error.

Why streamed and lean: an hour at 100 requests/s is 360,000 records (about 650 MB of JSON lines). Each
line is read, reduced to what the rules read (`analysis/run/lean.py`: the attempts) and the stage table's
columns (`RunData.columns`, analysis/run/record_columns.py), and dropped, so neither the file's text nor its
parsed dicts are held. The files are opened here only (`_read_records` through `k3load.evidence.blocks`,
`_jsonl` through `k3load.evidence.lines`: records.jsonl.gz and metrics.jsonl.gz, or an older run's plain
records.jsonl and metrics.jsonl; a compressed file inflated in a second thread meanwhile), and everything
downstream reads `RunData`.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd
import yaml

from k3load import evidence
from k3load.analysis.run.lean import DEFAULTS, AnyAttempt, Interner, lean_attempt
from k3load.analysis.run.record_columns import RecordColumns, Rows
from k3load.analysis.run.record_decode import FRAME_ONLY, RecordDecoder
from k3load.analysis.run.row_columns import RowColumns
from k3load.analysis.run.scrape_samples import Layouts
from k3load.errors import InputError
from k3load.events import Event
from k3load.outcomes import HARNESS_ERROR
from k3load.records import Attempt
from k3load.workload.plan import Plan, PlanError, parse_plan


@dataclass
class StageWindow:
    name: str
    kind: str
    start_ts: float
    end_ts: float
    users: int | None = None
    search: str | None = None  # a search step: the plan's search stage it is a step of (stage_start's `search`)
    sessions_per_s: float | None = None  # an open-loop stage's arrival rate (stage_start's; None: closed-loop)


@dataclass
class RunData:
    path: Path
    run: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None
    attempts: list[AnyAttempt] = field(default_factory=list)  # every record given whole, file order (a test's)
    # a run loaded from disk: the records a rule reads whole, as read, by row (`ReadWholeLater`); None: `attempts`
    kept: dict[int, AnyAttempt] | None = None
    rereads: int = 0  # times a rule picked a row not kept, and the records file was read again for it
    columns: RecordColumns = field(default_factory=RecordColumns)  # the same records as columns (record_columns.py)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    gpu: pd.DataFrame = field(default_factory=pd.DataFrame)
    events: list[dict[str, Any]] = field(default_factory=list)
    compat: dict[str, Any] | None = None
    reuse_design: dict[str, Any] | None = None  # reuse_design.json: designed prefix reuse (None: not measured)
    stages: list[StageWindow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unreadable lines or files, reported not hidden
    unreadable: dict[str, str] = field(default_factory=dict)  # a run file that is there but not readable: why

    def __post_init__(self) -> None:
        if self.attempts and not len(self.columns):  # attempts given whole (a test's): the same records as columns
            self.columns = columns_of(self.attempts)

    def pick(self, rows: Rows) -> list[AnyAttempt]:
        """The attempts of these rows, in their order. Why: a rule that reads a few records whole (the control
        pairs, the answers the harness could not judge) chooses them on the columns first and reads only those.
        A loaded run keeps those as it reads (`ReadWholeLater`); a row it did not keep is read again from the
        records file, every record of it then kept (slow, and never taken by today's rules)."""
        positions = rows.file_positions().tolist()
        if self.kept is None:
            return [self.attempts[i] for i in positions]
        if any(i not in self.kept for i in positions):
            self.kept = dict(enumerate(_read_records(evidence.records_file(self.path))[0]))
            self.rereads += 1
        return [self.kept[i] for i in positions]

    def events_named(self, *names: Event) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in names]

    def stage_of(self, ts: float) -> StageWindow | None:
        for stage in self.stages:
            if stage.start_ts <= ts < stage.end_ts:
                return stage
        return None


def columns_of(attempts: list[AnyAttempt]) -> RecordColumns:
    """The columns of attempts given whole or lean (each field the record columns keep and the attempt lacks: None).
    A whole `Attempt` goes in as its line would be read (`lean_attempt` of its JSON: its answer's signature, its
    counts as the reader keeps them, findings shared with the same ones), as a run's records go in."""
    columns, shared = RecordColumns(), Interner()
    for attempt in attempts:
        frame = tuple(getattr(attempt, name, None) for name in FRAME_ONLY)
        columns.add(lean_attempt(json.loads(attempt.to_json()), shared) if isinstance(attempt, Attempt) else attempt,
                    frame)
    return columns


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a run is loaded and indexed. Why: that builds millions of
    small containers (parsed dicts, lean records, sample tuples) that form no reference cycles, and each
    burst of allocations made the collector walk everything loaded so far: quadratic in the run's size.
    Reference counting still frees whatever is dropped; the collector resumes as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _lines(path: Path, errors: str = "strict") -> Iterator[tuple[int, str, bool]]:
    """(number, line, is_last) of the non-blank lines, streamed; lines end at "\\n" only (a record's
    text may hold U+2028 or U+0085, which `str.splitlines` would cut); compressed or plain (`evidence.lines`)."""
    previous: tuple[int, str] | None = None
    for number, line in enumerate(evidence.lines(path, errors, inflate_ahead=True), start=1):
        if previous is not None:
            yield previous[0], previous[1], False
            previous = None
        if line.strip():
            previous = (number, line)
        else:
            yield number, line, False  # a blank line after a torn one: that one was not the last
    if previous is not None:
        yield previous[0], previous[1], True


def _jsonl(path: Path, problems: list[str], layouts: Layouts | None = None,
           decode: Callable[[Any], Any] | None = None) -> list[dict[str, Any]]:
    """The rows of a JSONL file; `decode` gives back a row as it was before the writer's encoding (metrics:
    `evidence.SeriesTable.decode`); with `layouts`, a row's `samples` held compactly (`scrape_samples.Samples`).
    Unreadable lines and bytes are problems, never errors."""
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    _read_rows(path, problems, layouts, decode, rows.append)
    return rows


GPU_NUMBERS = ("ts", "memory_used_mib", "memory_total_mib", "memory_free_mib")  # what the GPU rules compute with


def _gpu_frame(path: Path, problems: list[str]) -> pd.DataFrame:
    """gpu.jsonl as `pd.DataFrame(rows)` would make it, without holding the rows (`row_columns`). A line that
    is not a JSON object is a problem, skipped (pandas could not have framed it); a reading whose time or memory
    is not a number (another writer's "n/a") is kept with that field unknown, and said."""
    columns = RowColumns()
    not_numbers: dict[str, int] = {}

    def add(row: Any) -> None:
        if not isinstance(row, dict):
            problems.append(f"{path.name}: a line that is not a JSON object ({type(row).__name__}) skipped")
            return
        for name in GPU_NUMBERS:
            value = row.get(name)
            if value is not None and (type(value) is bool or not isinstance(value, int | float)):
                not_numbers[name] = not_numbers.get(name, 0) + 1
                row[name] = None
        columns.add(row)

    if path.exists():
        _read_rows(path, problems, None, None, add)
    problems += [f"{path.name}: {n} reading(s) whose {name} is not a number, read as unknown"
                 for name, n in not_numbers.items()]
    return columns.frame()


def _read_rows(path: Path, problems: list[str], layouts: Layouts | None, decode: Callable[[Any], Any] | None,
               add: Callable[[Any], None]) -> None:
    try:
        _add_rows(path, problems, layouts, decode, add)
    except ValueError as exc:  # a compressed file that stops being gzip: what came before it counts
        problems.append(f"{path.name}: {exc}")


def _add_rows(path: Path, problems: list[str], layouts: Layouts | None, decode: Callable[[Any], Any] | None,
              add: Callable[[Any], None]) -> None:
    for number, line, last in _lines(path, errors="replace"):
        if not line.strip():
            continue
        try:
            row = json_line(line)
            row = decode(row) if decode is not None else row
        except ValueError:  # JSONDecodeError, or a line that does not decode
            if not last:  # a torn last line is expected after a crash
                problems.append(f"{path.name}:{number}: unreadable line skipped")
            continue
        if layouts is not None and isinstance(row, dict) and isinstance(row.get("samples"), dict):
            row["samples"] = layouts.compact(row["samples"])  # the keys once a run, the values 8 bytes each
        add(row)


_FAST_JSON = msgspec.json.Decoder().decode


def json_line(line: str) -> Any:
    """`json.loads(line)`, decoded by msgspec where it can (2.7x faster on metrics.jsonl: 0.44 s against
    1.17 s for an hour of scrapes). msgspec gives the same objects or refuses (numbers out of float
    range, lone surrogate escapes, anything not JSON): `json.loads` then reads the line as always, and
    says what is wrong with it."""
    try:
        return _FAST_JSON(line)
    except ValueError:  # msgspec.DecodeError (ValidationError too) is a ValueError
        return json.loads(line)


# Lines decoded as one batch (`RecordDecoder.take_many`): small enough that a batch's decoded lines are still in the
# CPU's cache when their fields are read (an hour's soak, Dec 2026: 3.9 s at 256 lines, 4.2 at 512 and at 64, 5.7 at
# a whole 8 MB block)
DECODE_BATCH = 256


class UnreadableRecords(InputError):
    """A records file with a line that is not an attempt record (not a torn last line): the run cannot be
    judged without guessing, so `k3load analyze` says which line, in one line, and exits 2."""


class ReadWholeLater:
    """Which records a rule reads whole (`RunData.pick`), asked of each record as it is read, in file order:
    - a prefix-cache control request (analysis/pillars/cache/pillar_cache.py: its pairs),
    - an answer the harness could not judge, its `harness.error` finding (analysis/pillars/agent/unjudged.py),
    - a refusal, HTTP 400 (pillar_agent.context_refusals: the context-length ones),
    - the timeout drill's attempts and every later attempt of a drill's chain (pillar_agent._drill),
    - a failed `stream.stall` or `tool_call.cadence` finding (tool_calls.cadence).
    Few in a healthy run; a rule that picks another row reads the file again (slow, never taken by today's)."""

    FAILED_CHECKS = frozenset(("stream.stall", "tool_call.cadence"))

    def __init__(self) -> None:
        self._findings: dict[int, bool] = {}  # by the findings tuple the reader shares among equal ones
        self._drill_chains: set[Any] = set()

    def __call__(self, lean: AnyAttempt) -> bool:
        return self._keeps(lean.drill, lean.chain_id, lean.control_role, lean.http_status, lean.findings)

    def _keeps(self, drill: Any, chain_id: Any, control_role: Any, http_status: Any, findings: Any) -> bool:
        """One record, by the fields this reads of it (in file order: a drill names its chain for what follows)."""
        if drill:
            with contextlib.suppress(TypeError):  # an unhashable chain id: its chain is read again if asked
                self._drill_chains.add(chain_id)
            return True
        if control_role is not None or http_status == 400:
            return True
        with contextlib.suppress(TypeError):
            if chain_id in self._drill_chains:
                return True
        found = self._findings.get(id(findings))  # each tuple is alive for as long as the reader's Interner
        if found is None:
            found = self._findings[id(findings)] = self._failed(findings)
        return found

    @classmethod
    def _failed(cls, findings: Any) -> bool:
        return any(f.check == HARNESS_ERROR or (f.check in cls.FAILED_CHECKS and not f.ok) for f in findings)

    def many(self, drill: Sequence[Any], chain: Sequence[Any], role: Sequence[Any], http: Sequence[Any],
             findings: Sequence[Any]) -> list[int]:
        """Which of a batch's records (their fields, in file order) this keeps: what `__call__` says of each in
        turn, without a call per record. A drill's chain keeps its later records: those after the drill's first
        record in this batch, and every one in later batches."""
        cached = self._findings
        for found in {id(f): f for f in findings}.values():
            if id(found) not in cached:
                cached[id(found)] = self._failed(found)
        chains, n = self._drill_chains, len(drill)
        with contextlib.suppress(TypeError):  # an unhashable chain id: record by record, as `__call__` does
            first: dict[Any, int] = {}  # a chain a drill of this batch names -> that drill's row
            for i in [i for i, d in enumerate(drill) if d]:
                first.setdefault(chain[i], i)
            kept = [i for i, (d, r, h, c, f) in enumerate(zip(drill, role, http, chain, findings, strict=True))
                    if d or r is not None or h == 400 or c in chains or first.get(c, n) < i or cached[id(f)]]
            chains.update(first)
            return kept
        return [i for i, row in enumerate(zip(drill, chain, role, http, findings, strict=True)) if self._keeps(*row)]


def _read_kept(path: Path, problems: list[str]) -> tuple[dict[int, AnyAttempt], RecordColumns]:
    """The record columns and, by row, the records a rule reads whole (`ReadWholeLater`)."""
    kept: dict[int, AnyAttempt] = {}
    return kept, _read_into(path, problems, kept, ReadWholeLater())


def _read_records(path: Path, problems: list[str] | None = None) -> tuple[list[AnyAttempt], RecordColumns]:
    """Every lean attempt and the record columns (`_read_into`)."""
    attempts: list[AnyAttempt] = []
    return attempts, _read_into(path, problems, attempts)


def _read_into(path: Path, problems: list[str] | None, attempts: list[AnyAttempt] | dict[int, AnyAttempt],
               keep: Callable[[Any], bool] | None = None) -> RecordColumns:
    """The lean attempts and the record columns, one line at a time: each line decoded by
    `RecordDecoder` (only the fields the rules read), or, where it refuses one, read whole. A torn last
    line (the writer was killed mid-write) is skipped, and said in `problems` with its size (a file that is
    not JSON lines at all is one such "line", which must not read as a run that recorded nothing); any
    other unreadable line is an error (as
    `k3load.records.read_records` says it). Lines end at "\\n" only (see `_lines`).

    Why bytes (`evidence.blocks`): msgspec reads UTF-8 bytes as they are, so the inflated text is never
    decoded to str nor copied line by line (0.5 s of an hour's 710 MB). msgspec does not check the UTF-8
    of the fields it skips, so a line that is not ASCII is checked first (`_utf8`); one that is not UTF-8
    is read whole, which names it, as before."""
    shared = Interner()
    columns = RecordColumns()
    decoder = RecordDecoder(shared, attempts, columns, keep)
    take, take_many = decoder.take, decoder.take_many
    number, tail = 0, []  # tail: the line the next block goes on with, in pieces (a line may span blocks)
    for block in evidence.blocks(path, inflate_ahead=True):  # inflated beside the decoding
        pieces = block.split(b"\n")
        if len(pieces) == 1:  # no line ends in this block
            tail.append(block)
            continue
        if tail:
            pieces[0] = b"".join([*tail, pieces[0]])
        tail = [pieces.pop()]
        for start in range(0, len(pieces), DECODE_BATCH):
            batch = pieces[start:start + DECODE_BATCH]
            if all(map(bytes.isascii, batch)) and take_many(batch):  # UTF-8 checked line by line (`_utf8`)
                number += len(batch)
                continue
            for line in batch:  # a line the batch would refuse: each line on its own, as always
                number += 1
                if not ((line.isascii() or _utf8(line)) and take(line)):
                    _read_whole(path, number, line, decoder, last=False)
    if rest := b"".join(tail):  # the file does not end in "\n": its last line, maybe torn mid-write
        number += 1
        if not ((rest.isascii() or _utf8(rest)) and take(rest)):
            _read_whole(path, number, rest, decoder, last=True, problems=problems)
    return columns


def _utf8(line: bytes) -> bool:
    try:
        line.decode()
    except UnicodeDecodeError:
        return False
    return True


def _skipped(problems: list[str] | None, what: str) -> None:
    if problems is not None:
        problems.append(what)


def _read_whole(path: Path, number: int, line: bytes, decoder: RecordDecoder, last: bool,
                problems: list[str] | None = None) -> None:
    """A line `RecordDecoder` refused: skipped when blank or a torn last line, else read whole by
    `json.loads` and `lean_attempt`, which say what is wrong with it (`UnreadableRecords`). Bytes that are
    not UTF-8 are kept as lone surrogates, so the line, not the whole file, is refused and named."""
    text = line.decode("utf-8", errors="surrogateescape")
    if not text.strip():
        return
    torn = f"{path.name}:{number}: the last line ({len(line):,} bytes, no line end) skipped as cut mid-write"
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        if last:  # the last line, torn inside a character
            _skipped(problems, torn)
            return
        raise UnreadableRecords(f"{path}:{number}: not an attempt record: not UTF-8 (at character "
                                f"{exc.start})") from exc
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        if last:  # the last line, torn mid-write (a whole last line that does not parse is an error, as any
            _skipped(problems, torn)  # other line is: it ends in "\n", so it is not `last` here)
            return
        raise UnreadableRecords(f"{path}:{number}: not an attempt record: {exc}") from exc
    try:
        if not isinstance(record, dict):
            raise TypeError(f"a JSON {type(record).__name__}, not an object")
        attempt = lean_attempt(record, decoder.shared)
    except TypeError as exc:
        raise UnreadableRecords(f"{path}:{number}: not an attempt record: {exc}") from exc
    decoder.add(attempt, tuple(record.get(name, DEFAULTS.get(name)) for name in FRAME_ONLY))


def read_attempts(path: Path) -> list[AnyAttempt]:
    """The lean attempts of a records.jsonl alone (a reference run's, for its profile)."""
    return _read_records(path)[0]


def read_columns(path: Path) -> RecordColumns:
    """The record columns of a records.jsonl alone (a reference run's, for its profile)."""
    return _read_records(path)[1]


def _stage_windows(events: list[dict[str, Any]], columns: RecordColumns) -> list[StageWindow]:
    starts = sorted((e for e in events if e.get("event") == Event.STAGE_START), key=lambda e: e["ts"])
    ends = [e["ts"] for e in events if e.get("event") == Event.RUN_END]
    answered = columns.array("end_ts")
    answered = answered[~np.isnan(answered)]  # a record's end that is no number: unknown
    last = max([*ends, *([float(answered.max())] if len(answered) else [])], default=None)
    # A search step ends where the live search decided it (its `search_step`): the analysis judges the evidence
    # the search judged, not the users' departure after the last step (k3load.loadgen.search)
    decided = {e.get("stage"): e["ts"] for e in events if e.get("event") == Event.SEARCH_STEP}
    searched = {e.get("stage"): e.get("search") for e in events if e.get("event") == Event.SEARCH_STEP}
    windows = []
    for i, event in enumerate(starts):
        end = starts[i + 1]["ts"] if i + 1 < len(starts) else (last if last is not None else event["ts"])
        end = min(end, decided.get(event["stage"], end))
        windows.append(StageWindow(event["stage"], event.get("kind", ""), event["ts"], max(end, event["ts"]),
                                   event.get("users"), event.get("search") or searched.get(event["stage"]),
                                   event.get("sessions_per_s")))
    return windows


def _json_object(path: Path, data: RunData) -> dict[str, Any] | None:
    """A run file holding one JSON object; None when missing, or when unreadable, cut or not an object (a run
    copied in part, a file edited by hand): then said in the run's problems and kept in `unreadable` by name,
    so the rule that needed it says why it could not tell, never a traceback."""
    if not path.exists():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = f"not readable as JSON ({type(exc).__name__}: {str(exc)[:200]})"
    else:
        if isinstance(found, dict):
            return found
        why = f"a JSON {type(found).__name__}, not an object"
    data.unreadable[path.name] = why
    data.problems.append(f"{path.name}: {why}")
    return None


def load_run(path: Path) -> RunData:
    with gc_paused():
        return _load(path)


def _load(path: Path) -> RunData:
    data = RunData(path=path)
    problems = data.problems
    data.run = _json_object(path / "run.json", data) or {}
    if (path / "plan.yaml").exists():
        text = (path / "plan.yaml").read_text()
        try:
            data.plan = parse_plan(yaml.safe_load(text), str(path / "plan.yaml"), text)
        except (PlanError, yaml.YAMLError) as exc:
            problems.append(f"plan.yaml: {exc}")
    records = evidence.records_file(path)
    if records.exists():
        data.kept, data.columns = _read_kept(records, problems)
    metrics = _jsonl(evidence.metrics_file(path), problems, Layouts(), evidence.SeriesTable().decode)
    data.metrics = sorted(metrics, key=lambda r: r.get("ts", 0))
    data.gpu = _gpu_frame(path / "gpu.jsonl", problems)
    data.events = sorted(_jsonl(path / "events.jsonl", problems), key=lambda r: r.get("ts", 0))
    for event in data.events_named(Event.WORKER_SPOOLS):  # the master gave up waiting for a worker's records
        problems += [f"{worker} did not report its users stopped: its last turns may be missing"
                     for worker in event.get("not_final") or []]
    data.compat = _json_object(path / "compat.json", data)
    data.reuse_design = _json_object(path / "reuse_design.json", data)
    data.stages = _stage_windows(data.events, data.columns)
    return data
