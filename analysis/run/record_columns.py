"""The records as columns: what the rules read of every record, a few bytes a field.

Why: the stage table, the crash and restart checks, the soak's windows, the capacity's what-if, the checklist and
most of the agent pillar read a few fields of every record. The stage table's read them from a pandas frame of every
record with 36 columns (strings as objects), built once more in send order: about 640 bytes a record at its peak,
5.5 GB for a day's soak.
Here each record's fields go, as it is read, into a batch, and a batch into numpy columns of the smallest
kind that keeps what the rules read (`Kind`): numbers as float64, strings as codes into the run's table
of distinct values, ids as their 16 bytes, a findings list or a tool-call names tuple by the object the decoder
shares among every record that holds the same (`SHARED`). About 290 bytes a record, in file order.

What a kind keeps is what the frame's rules made of the field (verdicts unchanged byte for byte):
`TRUTHY` is `astype(bool)`, `IS_TRUE` is `== True`, `REFUSED` is `str.contains("refused", case=False)`, a
`NUMBER` that is not a JSON number is missing (NaN), as `to_numeric(errors="coerce")` made it, and a
number column whose every record held an integer is said (`int_only`: the frame's int64 column, whose
values a rule wrote as integers). Per record, a NUMBER also says whether it was recorded as an integer
(`is_int`): a rule's sum, maximum or percentile keeps the type it had over the attempts read whole
(`Rows.total`, `Rows.recorded`).

Usage: `RecordColumns.extend_fields(fields)` per batch of records (analysis/run/record_decode.py's `take_many`) or
`RecordColumns.add(lean, frame_only)` per record (a line read whole), in file order, `rows()` for the
whole run or `rows(stage=name)`, then a `Rows` view: `view.number("ttft_ms")`, `view.code_is("status",
"ok")`, `view[mask]`; a rule that reads a few records whole picks them by their rows (`RunData.pick`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from typing import Any

import numpy as np

from k3load.analysis.run.answer_signature import UNREAD
from k3load.analysis.run.lean import PLAIN_INT

BATCH = 65_536  # records a batch holds before it becomes columns (a few MB of tuples, whatever the run's size)
MISSING_INT = np.iinfo(np.int64).min  # an INT field that was not an integer: never equal to a rule's 0 or 1
_REFUSED = re.compile("refused", flags=re.IGNORECASE)  # pandas' str.contains(case=False): the same search
_HEX = frozenset("0123456789abcdef")
NONE = type(None)
_PLAIN_NUMBERS = frozenset((float, int, NONE))
_INTS_OR_NONE = frozenset((int, NONE))
_HASHED = frozenset((str, NONE))  # types whose values are their own keys in a code table (`Codes`)
_SCALARS = frozenset((str, NONE, int, float, bool))  # hashable, keyed with their type unless str or None


class Kind(Enum):
    NUMBER = "number"  # float64; None and anything not a JSON number: NaN
    CODE = "code"  # int32 into the run's table of the field's distinct values (None is a value)
    TRUTHY = "truthy"  # bool(value)
    IS_TRUE = "is_true"  # value == True
    INT = "int"  # int64; anything not an integer: MISSING_INT
    REFUSED = "refused"  # the error text says "refused", in any case: nobody was listening
    SHARED = "shared"  # int32 into the run's table of distinct objects, by identity: the decoder shares one object
    # (a findings tuple, a tool-call names tuple) among every record that holds the same, a whole Attempt its own
    KEY = "key"  # an id: (kind, hi, lo): a uuid's 16 bytes, alone (kind 0) or after a prefix (kind 3 + the
    # prefix's code: a session's `k3load-`); another string's code (1); None (2)


# The fields kept, in the order a record's values are taken (`_values`); declared once.
FIELDS: dict[str, Kind] = {
    "stage": Kind.CODE, "status": Kind.CODE, "scenario": Kind.CODE, "family": Kind.CODE,
    "primary_layer": Kind.CODE, "stream_role": Kind.CODE, "request_sha256": Kind.CODE, "user_id": Kind.CODE,
    "send_ts": Kind.NUMBER, "end_ts": Kind.NUMBER, "ttft_ms": Kind.NUMBER, "e2e_ms": Kind.NUMBER,
    "prompt_tokens": Kind.NUMBER, "cached_tokens": Kind.NUMBER, "request_bytes": Kind.NUMBER,
    "http_status": Kind.NUMBER, "ttfa_ms": Kind.NUMBER, "itl_mean_ms": Kind.NUMBER, "completion_tokens": Kind.NUMBER,
    "max_tokens": Kind.NUMBER, "intended_send_ts": Kind.NUMBER,
    "drill": Kind.TRUTHY, "valid": Kind.IS_TRUE, "error": Kind.REFUSED, "turn": Kind.INT, "attempt": Kind.INT,
    "attempt_id": Kind.KEY, "chain_id": Kind.KEY, "session_id": Kind.KEY, "control_role": Kind.CODE,
    "stream": Kind.TRUTHY, "chunks": Kind.NUMBER, "stream_reads": Kind.NUMBER, "stream_bytes": Kind.NUMBER,
    "findings": Kind.SHARED, "tool_calls": Kind.SHARED, "will_retry": Kind.TRUTHY, "finish_reason": Kind.CODE,
    "temperature": Kind.CODE, "seed": Kind.CODE, "tool_call_max_gap_ms": Kind.NUMBER,
    "tool_call_span_ms": Kind.NUMBER, "tool_call_deltas": Kind.NUMBER, "history": Kind.CODE, "model_round": Kind.CODE,
    "answer_signature": Kind.CODE, "first_token_ts": Kind.NUMBER, "stream_pair": Kind.CODE, "control_pair": Kind.CODE,
    "path": Kind.CODE,
}
NAMES = tuple(FIELDS)


def _values(lean: Any, frame: Sequence[Any]) -> tuple[Any, ...]:
    """A record's kept values in FIELDS' order, from its lean attempt and its frame-only values (the decoder's
    `add`: ttfa, itl, completion tokens, max tokens, error, session id, intended send time)."""
    ttfa, itl, completion, max_tokens, error, session, intended = frame
    return (lean.stage, lean.status, lean.scenario, lean.family, lean.primary_layer, lean.stream_role,
            lean.request_sha256, lean.user_id, lean.send_ts, lean.end_ts, lean.ttft_ms, lean.e2e_ms,
            lean.prompt_tokens, lean.cached_tokens, lean.request_bytes, lean.http_status, ttfa, itl, completion,
            max_tokens, intended, lean.drill, lean.valid, error, lean.turn, lean.attempt, lean.attempt_id,
            lean.chain_id, session, lean.control_role, lean.stream, lean.chunks, lean.stream_reads, lean.stream_bytes,
            lean.findings, lean.tool_calls, lean.will_retry, lean.finish_reason, getattr(lean, "temperature", None),
            getattr(lean, "seed", None), lean.tool_call_max_gap_ms, lean.tool_call_span_ms, lean.tool_call_deltas,
            getattr(lean, "history", None), getattr(lean, "model_round", None),
            getattr(lean, "answer_signature", UNREAD), lean.first_token_ts, lean.stream_pair, lean.control_pair,
            getattr(lean, "path", None))


KEY_DTYPE = np.dtype([("kind", np.uint8), ("hi", np.uint64), ("lo", np.uint64)])
NO_KEY = 2  # a key's kind where the record held no id (None)
_KEY_BYTES = np.dtype(f"V{KEY_DTYPE.itemsize}")  # a key as one opaque value: compared whole (np.isin)
FIRST_PREFIX, MAX_PREFIXES = 3, 250  # kinds 3.. name the prefixes before a uuid's hex (a uint8 holds 252 of them)


class Codes:
    """A field's distinct values in order of first appearance, each with its code. A string (or None) is its own
    key; any other value is keyed with its type, so `0`, `0.0` and `False` (one dict key) stay three values."""

    def __init__(self) -> None:
        self.code_of: dict[Any, int] = {}  # a string or None, or (type, value)
        self.values: list[Any] = []

    def code(self, value: Any) -> int:
        key = _code_key(value)
        try:
            found = self.code_of.get(key)
        except TypeError:  # an unhashable value (a list where a string belongs): its text stands for it
            return self.code(("unhashable", repr(value)))
        if found is None:
            found = self.code_of[key] = len(self.values)
            self.values.append(value)
        return found

    def of(self, *values: Any) -> np.ndarray:
        """The codes of those values this run holds (a value it never held matches no row)."""
        keys = [_code_key(v) for v in values if _hashable(v)]
        return np.array([self.code_of[k] for k in keys if k in self.code_of], dtype=np.int32)


class Shared:
    """A field's distinct objects by identity, in order of first appearance, each with its code (each kept alive
    here, so an id names one object for as long as the table lives)."""

    def __init__(self) -> None:
        self.code_of: dict[int, int] = {}
        self.values: list[Any] = []

    def codes(self, values: Sequence[Any]) -> np.ndarray:
        code_of = self.code_of
        known = list(map(code_of.get, map(id, values)))
        if None in known:
            for i, value in enumerate(values):
                if known[i] is None:
                    found = code_of.get(id(value))
                    if found is None:
                        found = code_of[id(value)] = len(self.values)
                        self.values.append(value)
                    known[i] = found
        return np.array(known, dtype=np.int32)


def _code_key(value: Any) -> Any:
    return value if value is None or type(value) is str else (type(value), value)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _number(value: Any) -> float:
    kind = type(value)
    if kind is float:
        return value
    if kind is int:
        try:
            return float(value)
        except OverflowError:  # an integer past float range: no number a rule can compare
            return math.nan
    return math.nan


def _ints_of(values: Sequence[Any], numbers: np.ndarray) -> np.ndarray | bool:
    """Which of a batch's values (`numbers`: as NUMBER holds them) are integers a float holds exactly (True: all,
    False: none, else per value)."""
    types = set(map(type, values))
    if int not in types:
        return False
    if types <= _INTS_OR_NONE and not (np.abs(numbers) >= PLAIN_INT).any():  # None is NaN there: the rest are
        flags = ~np.isnan(numbers)  # integers, each smaller than 2**53
    else:
        flags = np.fromiter((type(v) is int and -PLAIN_INT <= v <= PLAIN_INT for v in values), dtype=bool,
                            count=len(values))
    return True if flags.all() else flags


def _int(value: Any) -> int:
    if type(value) is int or type(value) is bool:
        return int(value) if -(2 ** 63) < value < 2 ** 63 else MISSING_INT
    return MISSING_INT


class Column:
    """One field's batches, joined into one array when first read."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.parts: list[np.ndarray] = []
        self.codes = Codes() if kind in (Kind.CODE, Kind.KEY) else None
        self.shared = Shared() if kind is Kind.SHARED else None
        self.int_only = True  # NUMBER: every record held an integer (no None, no fraction written as such)
        # NUMBER: per batch, its size and which of its records held an integer (True: all of them, False: none)
        self.int_parts: list[tuple[int, np.ndarray | bool]] = []
        self._prefixes: dict[str, int] = {}  # KEY: the prefixes seen before a uuid's hex, each with its kind
        self._joined: np.ndarray | None = None

    def extend(self, values: Sequence[Any]) -> None:
        array = self._convert(values)
        self.parts.append(array)
        if self.kind is Kind.NUMBER:
            self.int_parts.append((len(values), _ints_of(values, array)))
        self._joined = None

    def is_int(self) -> np.ndarray:
        """NUMBER: whether each record held an integer (its value is then one, exactly: at most 2**53 in size)."""
        if len(self.int_parts) != 1 or isinstance(self.int_parts[0][1], bool):
            flags = [np.full(n, part, dtype=bool) if isinstance(part, bool) else part for n, part in self.int_parts]
            whole = np.concatenate(flags) if flags else np.zeros(0, dtype=bool)
            self.int_parts = [(len(whole), whole)]
        part = self.int_parts[0][1]
        assert not isinstance(part, bool)
        return part

    def array(self) -> np.ndarray:
        if self._joined is None:
            if len(self.parts) == 1:
                self._joined = self.parts[0]
            else:
                self._joined = np.concatenate(self.parts) if self.parts else self._convert(())
            self.parts = [self._joined]
        return self._joined

    def _convert(self, values: Sequence[Any]) -> np.ndarray:
        """A batch's values as this kind's array. Each kind has a fast path for a run's own records (one or two
        plain types) and the value-by-value rule for anything else; both give the same array."""
        n, kind = len(values), self.kind
        types = set(map(type, values))
        if kind is Kind.NUMBER:
            if types - {int}:
                self.int_only = False
            if types <= _PLAIN_NUMBERS:
                try:  # floats and integers as they are, None as NaN
                    return np.array([math.nan if v is None else v for v in values] if NONE in types else values,
                                    dtype=np.float64)
                except OverflowError:  # an integer past float range: NaN, value by value
                    pass
            return np.fromiter(map(_number, values), dtype=np.float64, count=n)
        if kind is Kind.CODE:
            assert self.codes is not None
            get = self.codes.code_of.get
            if types <= _HASHED:
                known = list(map(get, values))
            elif types <= _SCALARS:  # numbers keyed with their type (`_code_key`), without a call per value
                known = [get(v if v is None or type(v) is str else (type(v), v)) for v in values]
            else:
                return np.fromiter(map(self.codes.code, values), dtype=np.int32, count=n)
            if None not in known:  # every value seen before (a run repeats a few hundred)
                return np.array(known, dtype=np.int32)
            code = self.codes.code  # a new value: its code made, in order of first appearance
            return np.fromiter((c if c is not None else code(v) for c, v in zip(known, values, strict=True)),
                               dtype=np.int32, count=n)
        if kind is Kind.SHARED:
            assert self.shared is not None
            return self.shared.codes(values)
        if kind is Kind.TRUTHY:
            return np.fromiter(map(bool, values), dtype=bool, count=n)
        if kind is Kind.IS_TRUE:
            if types <= {bool}:
                return np.array(values, dtype=bool)
            return np.fromiter((v == True for v in values), dtype=bool, count=n)  # noqa: E712 (the frame's test)
        if kind is Kind.INT:
            if types <= {int}:
                try:
                    return np.array(values, dtype=np.int64) if n else np.empty(0, dtype=np.int64)
                except OverflowError:
                    pass
            return np.fromiter(map(_int, values), dtype=np.int64, count=n)
        if kind is Kind.REFUSED:
            if types <= {NONE}:
                return np.zeros(n, dtype=bool)
            return np.fromiter((type(v) is str and _REFUSED.search(v) is not None for v in values), dtype=bool,
                               count=n)
        return self._keys(values)

    def _keys(self, values: Sequence[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=KEY_DTYPE)
        if values and all(type(v) is str for v in values) and len(lengths := set(map(len, values))) == 1:
            cut = lengths.pop() - 32
            prefixes = {v[:cut] for v in values} if cut >= 0 else set()
            kind = self._prefix_kind(prefixes.pop()) if len(prefixes) == 1 else None
            tails = "".join(v[cut:] for v in values) if kind is not None else ""
            if kind is not None and _HEX.issuperset(tails):  # one prefix (or none), then a uuid's lowercase hex
                words = np.frombuffer(bytes.fromhex(tails), dtype=">u8").reshape(-1, 2)
                out["kind"], out["hi"], out["lo"] = kind, words[:, 0], words[:, 1]
                return out
        for i, value in enumerate(values):
            out[i] = self._key(value)
        return out

    def _prefix_kind(self, prefix: str) -> int | None:
        """The key kind of ids with this prefix before their uuid hex (None: too many prefixes to keep apart)."""
        if not prefix:
            return 0
        found = self._prefixes.get(prefix)
        if found is None and len(self._prefixes) < MAX_PREFIXES:
            found = self._prefixes[prefix] = FIRST_PREFIX + len(self._prefixes)
        return found

    def _key(self, value: Any) -> tuple[int, int, int]:
        if value is None:
            return NO_KEY, 0, 0
        if type(value) is str and len(value) >= 32 and _HEX.issuperset(value[-32:]):
            kind = self._prefix_kind(value[:-32])
            if kind is not None:
                whole = int(value[-32:], 16)
                return kind, whole >> 64, whole & 0xFFFF_FFFF_FFFF_FFFF
        assert self.codes is not None
        return 1, self.codes.code(value), 0

    def key_text(self, key: np.void) -> Any:
        """The id a key stands for (its text, as recorded)."""
        kind = int(key["kind"])
        if kind == NO_KEY:
            return None
        if kind == 1:
            assert self.codes is not None
            return self.codes.values[int(key["hi"])]
        prefix = "" if kind == 0 else next(p for p, k in self._prefixes.items() if k == kind)
        return f"{prefix}{int(key['hi']):016x}{int(key['lo']):016x}"


class RecordColumns:
    """Every record's kept fields (FIELDS), in file order, a batch at a time."""

    def __init__(self) -> None:
        self.columns = {name: Column(kind) for name, kind in FIELDS.items()}
        self._batch: list[tuple[Any, ...]] = []
        self._count = 0
        self._stage_index: dict[str, np.ndarray] | None = None

    def add(self, lean: Any, frame: Sequence[Any]) -> None:
        """A record read: its lean attempt (or whole `Attempt`) and its frame-only values (`_values`)."""
        self._batch.append(_values(lean, frame))
        if len(self._batch) >= BATCH:
            self._flush()

    def extend_fields(self, values: Sequence[Sequence[Any]]) -> None:
        """A batch of records given field by field (one sequence per field, in FIELDS' order): after every
        record added before it (the decoder's batches, with its lines read whole between them)."""
        self._flush()
        self._extend(values)

    def add_values(self, values: dict[str, Any]) -> None:
        """A record given by its fields (a test's rows; a field left out is None)."""
        self._batch.append(tuple(values.get(name) for name in NAMES))
        if len(self._batch) >= BATCH:
            self._flush()

    @classmethod
    def of(cls, records: Iterable[dict[str, Any]]) -> RecordColumns:
        columns = cls()
        for record in records:
            columns.add_values(record)
        return columns

    def _flush(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        self._extend(list(zip(*batch, strict=True)))

    def _extend(self, fields: Sequence[Sequence[Any]]) -> None:
        """Records given field by field (FIELDS' order) made columns, after those made before."""
        count = len(fields[0]) if fields else 0
        if not count:
            return
        for column, values in zip(self.columns.values(), fields, strict=True):
            column.extend(values)
        self._count += count
        self._stage_index = None

    def __len__(self) -> int:
        return self._count + len(self._batch)

    def array(self, name: str) -> np.ndarray:
        self._flush()
        return self.columns[name].array()

    def is_int(self, name: str) -> np.ndarray:
        self._flush()
        return self.columns[name].is_int()

    def rows(self, stage: str | None = None) -> Rows:
        """Every record, or those naming `stage` (the stage each was sent in)."""
        self._flush()
        if stage is None:
            return Rows(self, None)
        if self._stage_index is None:
            self._stage_index = self._by_stage()
        return Rows(self, self._stage_index.get(stage, np.empty(0, dtype=np.intp)))

    def _by_stage(self) -> dict[str, np.ndarray]:
        codes = self.array("stage")
        names = self.columns["stage"].codes
        assert names is not None
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(len(names.values) + 1))
        out: dict[str, np.ndarray] = {}
        for code, value in enumerate(names.values):
            if isinstance(value, str):
                out[value] = order[bounds[code]:bounds[code + 1]]
        return out


class Rows:
    """Some records of a run (`index` into its columns, file order; None: all), read as columns."""

    def __init__(self, columns: RecordColumns, index: np.ndarray | None) -> None:
        self.columns = columns
        self.index = index

    def __len__(self) -> int:
        return len(self.columns) if self.index is None else len(self.index)

    @property
    def empty(self) -> bool:
        return len(self) == 0

    def __getitem__(self, mask: np.ndarray) -> Rows:
        """The rows where `mask` (one bool per row of this view) holds."""
        picked = np.flatnonzero(mask)
        return Rows(self.columns, picked if self.index is None else self.index[picked])

    def take(self, positions: np.ndarray) -> Rows:
        """The rows at these positions of this view, in that order."""
        return Rows(self.columns, positions if self.index is None else self.index[positions])

    def _get(self, name: str) -> np.ndarray:
        whole = self.columns.array(name)
        return whole if self.index is None else whole[self.index]

    def number(self, name: str) -> np.ndarray:
        return self._get(name)

    def is_int(self, name: str) -> np.ndarray:
        """Whether each row's value of a NUMBER field was an integer (exactly its float: at most 2**53)."""
        whole = self.columns.is_int(name)
        return whole if self.index is None else whole[self.index]

    def total(self, name: str, falsy_as_zero: bool = False) -> int | float:
        """Python's `sum` of a NUMBER field's values as recorded (an integer where a record held one), in row order:
        the same value and type. `falsy_as_zero`: a zero counted as the integer 0 (`value or 0`). Unknown values
        (NaN) are the caller's to leave out."""
        values, ints = self.number(name), self.is_int(name)
        if ints.all():
            if float(np.abs(values).sum()) < PLAIN_INT:  # every partial sum exact, in any order
                return int(values.sum())
            return sum(int(v) for v in values.tolist())
        recorded = [int(v) if i else v for v, i in zip(values.tolist(), ints.tolist(), strict=True)]
        return sum([v or 0 for v in recorded] if falsy_as_zero else recorded)

    def recorded(self, name: str) -> np.ndarray | list[Any]:
        """A NUMBER field's values as recorded: its floats, or, where a record held an integer, a list with that
        integer in its place (a rule that keeps a value, a percentile or a maximum, keeps its type)."""
        values, ints = self.number(name), self.is_int(name)
        if not ints.any():
            return values
        return [int(v) if i else v for v, i in zip(values.tolist(), ints.tolist(), strict=True)]

    def flag(self, name: str) -> np.ndarray:
        return self._get(name)

    def ints(self, name: str) -> np.ndarray:
        return self._get(name)

    def code_is(self, name: str, *values: Any) -> np.ndarray:
        """Whether each row's value of a CODE field is one of `values`."""
        table = self.columns.columns[name].codes
        assert table is not None
        return np.isin(self._get(name), table.of(*values))

    def table(self, name: str) -> list[Any]:
        """A CODE or SHARED field's distinct values, each at its code."""
        column = self.columns.columns[name]
        table = column.codes or column.shared
        assert table is not None
        return table.values

    def code_where(self, name: str, test: Callable[[Any], Any]) -> np.ndarray:
        """Whether each row's value of a CODE or SHARED field passes `test` (asked once per distinct value)."""
        column = self.columns.columns[name]
        table = column.codes or column.shared
        assert table is not None
        passed = np.fromiter((bool(test(v)) for v in table.values), dtype=bool, count=len(table.values))
        return passed[self._get(name)]

    def values(self, name: str) -> list[Any]:
        """A CODE field's values, as recorded."""
        table = self.columns.columns[name].codes
        assert table is not None
        return [table.values[c] for c in self._get(name).tolist()]

    def counts(self, name: str) -> dict[Any, int]:
        """A CODE field's values with their counts, in order of first appearance in the run."""
        table = self.columns.columns[name].codes
        assert table is not None
        codes, counts = np.unique(self._get(name), return_counts=True)
        return {table.values[c]: n for c, n in zip(codes.tolist(), counts.tolist(), strict=True)}

    def distinct(self, name: str) -> int:
        """Distinct values of a CODE field, None left out (pandas' `nunique`)."""
        table = self.columns.columns[name].codes
        assert table is not None
        codes = np.unique(self._get(name))
        return sum(1 for c in codes.tolist() if table.values[c] is not None)

    def keys(self, name: str) -> np.ndarray:
        return self._get(name)

    def key_in(self, name: str, among: np.ndarray) -> np.ndarray:
        """Whether each row's KEY of `name` is one of `among` (keys of the same column)."""
        return np.isin(self._get(name).view(_KEY_BYTES), among.view(_KEY_BYTES))

    def groups(self, name: str) -> np.ndarray:
        """Each row's group: rows with the same KEY of `name` share a number (0..), a row without one (None)
        is a group of its own."""
        keys = self._get(name)
        count, group = group_of(keys)
        alone = keys["kind"] == NO_KEY
        group[alone] = count + np.arange(int(alone.sum()))
        return group

    def seen(self, name: str) -> list[Any]:
        """A CODE field's distinct values in these rows, in order of first appearance in the run."""
        table = self.columns.columns[name].codes
        assert table is not None
        return [table.values[c] for c in np.unique(self._get(name)).tolist()]

    def key_texts(self, name: str) -> list[Any]:
        column = self.columns.columns[name]
        return [column.key_text(k) for k in self._get(name)]

    def as_recorded(self, name: str, values: np.ndarray) -> list[Any]:
        """A NUMBER field's values as the frame's column gave them: integers where every record held one."""
        if self.columns.columns[name].int_only:
            return [int(v) for v in values.tolist()]
        return values.tolist()

    def file_positions(self) -> np.ndarray:
        return np.arange(len(self)) if self.index is None else self.index


def designed_body_rows(rows: Rows) -> np.ndarray:
    """`lean.designed_body` of each row: whether it sent its scenario's designed body (a model-driven
    conversation's requests after its first carry the model's own answers)."""
    found: np.ndarray = ~rows.code_is("history", "model") | ((rows.ints("turn") == 0) &
                                                           rows.code_where("model_round", lambda r: not r))
    return found


def in_send_order(rows: Rows) -> np.ndarray:
    """The positions of these rows by (send_ts, attempt_id), ties in row order: a stable sort on both keys that
    reads the ids of tied rows only (`ties_by_id`)."""
    sent = rows.number("send_ts")
    return ties_by_id(sent, np.argsort(sent, kind="stable"), lambda tied: rows.take(tied).key_texts("attempt_id"))


def ties_by_id(send: np.ndarray, order: np.ndarray, ids_of: Callable[[np.ndarray], list[Any]]) -> np.ndarray:
    """`order` (rows by send time, a stable argsort of `send`) with each run of equal send times put in order of
    its rows' ids (`ids_of(rows)`: their ids, compared as recorded; stable): a sort on (send_ts, attempt_id) that
    reads the ids of tied rows only, which almost never occur."""
    ordered = send[order]
    tied = np.flatnonzero(ordered[1:] == ordered[:-1])
    if not len(tied):
        return order
    order = order.copy()
    start = 0
    while start < len(tied):
        end = start
        while end + 1 < len(tied) and tied[end + 1] == tied[end] + 1:
            end += 1
        span = slice(int(tied[start]), int(tied[end]) + 2)
        members = order[span]
        ids = ids_of(members)
        order[span] = members[sorted(range(len(members)), key=ids.__getitem__)]
        start = end + 1
    return order


def group_heads(group: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """Per group (numbered 0.. without gaps), its row that sorts first by `keys` (numpy's lexsort order: the last
    key first), equals in row order: a chain's final or first attempt, a request's reference answer."""
    order = np.lexsort((np.arange(len(group)), *keys, group))
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = group[order][1:] != group[order][:-1]
    return order[starts]


def group_of(keys: np.ndarray) -> tuple[int, np.ndarray]:
    """(distinct keys, each row's group number) of a KEY column's values. Sorted by the three words at once
    (`lexsort`): `np.unique` on the structured keys sorted them field by field, about three times slower."""
    if not len(keys):
        return 0, np.empty(0, dtype=np.intp)
    order = np.lexsort((keys["lo"], keys["hi"], keys["kind"]))
    ordered = keys[order]
    starts = np.ones(len(ordered), dtype=bool)
    for field in ("kind", "hi", "lo"):
        starts[1:] &= ordered[field][1:] == ordered[field][:-1]
    starts = ~starts
    starts[0] = True
    inverse = np.empty(len(keys), dtype=np.intp)
    inverse[order] = np.cumsum(starts) - 1
    return int(starts.sum()), inverse


def distinct_keys(keys: np.ndarray) -> int:
    """Distinct ids among a KEY column's values, None left out (pandas' `nunique`)."""
    return group_of(keys[keys["kind"] != NO_KEY])[0]


def all_by_group(groups: int, inverse: np.ndarray, good: np.ndarray) -> np.ndarray:
    """Per group, whether every row of it is good (pandas' `groupby(...).all()`)."""
    bad = np.bincount(inverse, weights=~good, minlength=groups)
    return bad == 0

