"""One records.jsonl line straight to its lean attempt, decoding only the fields the rules read.

Why msgspec: an hour at 100 requests/s is 360,000 lines of about 2 KB, most of it text no rule reads
(reasoning, content, tool-call arguments). `json.loads` builds every string of it; msgspec decodes a
line into a typed struct of the kept fields and skips the rest in C. Measured on the hour's soak of
`bench/analysis_scale.py` (2-core machine, Dec 2026): 0.88 s per 90,000 lines against 2.09 s for the
reader it replaced (which cut the tool calls and findings out of the text and parsed the rest).

Every kept field is typed `Any`, so a value is taken as `json.loads` gives it (msgspec returns the same
Python objects, big integers and -0.0 included); what msgspec cannot take as such a record (a line that
is not an object, a required field missing, a call or finding of another shape, NaN or Infinity, a
lone surrogate escape, a torn line) it refuses, and the line is read whole by `json.loads` and
`lean_attempt`, which say what is wrong exactly as before (`analysis/run/rundata.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Annotated, Any

import msgspec
from msgspec.structs import astuple

from k3load.analysis.run.answer_signature import COMPARED_KINDS, compared, signature_of_calls
from k3load.analysis.run.lean import DEFAULTS, NUMBERS, PLAIN_INT, REQUIRED, Interner, LeanAttempt, derived_layer
from k3load.analysis.run.record_columns import NAMES, RecordColumns

# Fields the record columns keep that the lean attempt does not (analysis/run/record_columns.py), in the order
# `RecordColumns.add` takes them: taken from the line as it passes.
FRAME_ONLY = ("ttfa_ms", "itl_mean_ms", "completion_tokens", "max_tokens", "error", "session_id", "intended_send_ts")
# Every field LeanAttempt keeps, the frame-only ones and the turn's kind (for the answer's signature), but the
# calls and findings (decoded apart).
_OPTIONAL = tuple(name for name in dict.fromkeys([*(f.name for f in fields(LeanAttempt)), *FRAME_ONLY, "turn_kind"])
                  if name not in REQUIRED and name not in ("tool_calls", "findings", "answer_signature"))


class _Function(msgspec.Struct, gc=False):
    name: Any = None
    arguments: Any = None  # read for the answer's signature (analysis/pillars/agent/reproducibility.py)


class _Call(msgspec.Struct, gc=False):
    """A recorded tool call as far as a rule reads it: its name (`lean.call_name`'s two places for it)."""

    function: _Function | None = None
    name: Any = None
    arguments: Any = None


# The record's kept fields: the required ones without a default (absent: refused, then read whole, which
# names them), the others with Attempt's defaults, applied only where the key is absent as dict.get's are.
# A count or time the rules compute with is a JSON number a float can hold: anything else (a string, a boolean,
# an integer past 2**53) is refused here, and the line read whole, which reads it as unknown (`lean.plain_number`).
_Number = Annotated[int, msgspec.Meta(ge=-PLAIN_INT, le=PLAIN_INT)] | float | None
# The attempt number, the turn and `valid`, which every rule orders, groups and counts by, are the types k3load
# writes: anything else is refused here, and the line read whole is refused with its line named (`lean_attempt`).
_STRICT: dict[str, Any] = {"attempt": int, "turn": int, "valid": bool}
_Line = msgspec.defstruct(
    "_Line",
    [*((name, _STRICT.get(name, Any)) for name in sorted(REQUIRED)),
     *((name, _Number if name in NUMBERS else _STRICT.get(name, Any), DEFAULTS[name]) for name in _OPTIONAL),
     ("tool_calls", list[_Call] | None, None),
     ("findings", msgspec.Raw, msgspec.Raw(b"[]")),
     ("content", msgspec.Raw, msgspec.Raw(b'""'))],  # parsed only for a json turn's signature
    kw_only=True, gc=False)
_REFUSED = (msgspec.DecodeError, ValueError, TypeError)  # msgspec.ValidationError is a DecodeError
_SLOT = {name: i for i, name in enumerate(_Line.__struct_fields__)}  # a field's place in `astuple(line)`
# Fields `_read` interns (a dict key): a batch holding anything else in them is read line by line, where the line
# that holds it is refused and read whole, as it always was
_INTERNED = ("stage", "scenario", "family", "user_id", "request_sha256", "prefix_sha256", "status", "finish_reason",
             "primary_layer", "control_role", "stream_role", "path")
_HASHABLE = frozenset((str, type(None), int, float, bool))


def _layer(layer: Any, valid: Any, findings: Any) -> Any:
    """The record's primary layer; for one written before the field existed, the same rule from its findings."""
    return derived_layer(findings) if layer is None and not valid else layer


class RecordDecoder:
    """Appends each line's lean attempt (to `attempts`) and its columns (to `columns`), or says the line must be
    read whole."""

    def __init__(self, shared: Interner, attempts: list[Any] | dict[int, Any], columns: RecordColumns,
                 keep: Callable[[Any], bool] | None = None) -> None:
        """`attempts`: a list that gets every lean attempt, or, with `keep`, a dict that gets those `keep` says, by
        their row (their position in the columns): the few a rule reads whole (`RunData.pick`)."""
        self.shared = shared
        # `_Line` is built at import from Attempt's fields (declared once, in k3load.records), so no checker can
        # see its attributes: a decoded line is read as `Any`, its fields as json.loads would give them
        self._decode: Callable[[str | bytes], Any] = msgspec.json.Decoder(_Line).decode
        self._attempts, self._keep, self._row = attempts, keep, 0
        self._append = attempts.append if isinstance(attempts, list) else None
        self._columns = columns.add
        self._extend = columns.extend_fields

    def take(self, line: str | bytes) -> bool:
        """True when the line (JSON text, or its UTF-8 bytes) was taken; False (nothing appended) when it
        must be read whole."""
        try:
            lean, frame = self._read(line)
        except _REFUSED:  # an unhashable value too (TypeError): the whole-line reading says what is wrong
            return False
        self.add(lean, frame)
        return True

    def take_many(self, lines: Sequence[bytes]) -> bool:
        """True when every line was taken, as one batch, straight into the columns; False (nothing taken) when
        some line would be refused: the caller then gives each line to `take`, in order, which refuses it.

        Why a batch: a lean attempt per record (built, its values read back into the columns, then dropped for
        all but the few `keep` picks) was most of an hour's reading. Here each field of the batch is one tuple
        (`astuple`, then one transposition), the columns take those tuples whole, and a lean attempt is built
        only for a row `keep` picks. Every value is the one `take` gives: the same decoder, the same findings
        and names shared, the same derived layer and signature (tests/unit/test_record_decode_batch.py)."""
        try:
            lines_read = list(map(self._decode, lines))
            fields_read = list(zip(*map(astuple, lines_read), strict=True))
            if not fields_read:
                return True
            for name in _INTERNED:  # `_read` interns these: a dict key each
                if not _HASHABLE.issuperset(map(type, fields_read[_SLOT[name]])):
                    return False
            derived = self._derived(lines_read, fields_read)
        except _REFUSED:
            return False
        values = [derived[name] if name in derived else fields_read[_SLOT[name]] for name in NAMES]
        self._keep_many(lines_read, derived, values)
        self._row += len(lines_read)
        self._extend(values)
        return True

    def _derived(self, lines_read: list[Any], fields_read: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
        """The columns that are not a line's value as it stands, each as `_read` makes it for its lean attempt."""
        findings_of = self.shared.findings_of_text
        findings = [findings_of(bytes(raw)) for raw in fields_read[_SLOT["findings"]]]
        names = [self._names(calls) for calls in fields_read[_SLOT["tool_calls"]]]
        layers = [_layer(layer, valid, found) for layer, valid, found
                  in zip(fields_read[_SLOT["primary_layer"]], fields_read[_SLOT["valid"]], findings, strict=True)]
        signatures: list[Any] = [None] * len(lines_read)
        for i, kind in enumerate(fields_read[_SLOT["turn_kind"]]):
            if kind in COMPARED_KINDS:  # `compared`'s first test (an unhashable kind raises, as there)
                signatures[i] = self._signature(lines_read[i])
        return {"primary_layer": layers, "findings": findings, "tool_calls": names, "answer_signature": signatures}

    def _keep_many(self, lines_read: list[Any], derived: dict[str, list[Any]], values: list[Any]) -> None:
        """The lean attempts of a batch: every one (a list), or those `keep` picks (by row)."""
        if self._append is None and self._keep is None:
            return
        many = getattr(self._keep, "many", None)
        if self._append is None and many is not None:
            column = dict(zip(NAMES, values, strict=True))
            picked = many(column["drill"], column["chain_id"], column["control_role"], column["http_status"],
                          column["findings"])
        else:
            picked = range(len(lines_read))
        for i in picked:
            lean = self._lean(lines_read[i], derived["findings"][i], derived["tool_calls"][i],
                              derived["primary_layer"][i], derived["answer_signature"][i])
            if self._append is not None:
                self._append(lean)
            elif many is not None or (self._keep is not None and self._keep(lean)):
                self._attempts[self._row + i] = lean

    def add(self, lean: Any, frame: tuple[Any, ...]) -> None:
        """An attempt and its frame-only values (in FRAME_ONLY's order); a line read whole comes here too."""
        if self._append is not None:
            self._append(lean)
        elif self._keep is not None and self._keep(lean):
            self._attempts[self._row] = lean
        self._row += 1
        self._columns(lean, frame)

    def _signature(self, r: Any) -> str | None:
        """The answer's signature (analysis/pillars/agent/reproducibility.py) for a tool-call or json turn, interned."""
        if not compared(r.turn_kind, r.status, r.temperature, r.seed):
            return None
        calls = [(str(c.function.name or ""), c.function.arguments) if c.function is not None else
                 (str(c.name or ""), c.arguments) for c in r.tool_calls or ()]
        content = msgspec.json.decode(bytes(r.content)) if r.turn_kind == "json" else None
        found = signature_of_calls(r.turn_kind, calls, content if isinstance(content, str) else None)
        return None if found is None else self.shared.intern(found, found)

    def _read(self, line: str | bytes) -> tuple[LeanAttempt, tuple[Any, ...]]:
        r = self._decode(line)
        findings = self.shared.findings_of_text(bytes(r.findings))
        lean = self._lean(r, findings, self._names(r.tool_calls), _layer(r.primary_layer, r.valid, findings),
                          self._signature(r))
        frame = (r.ttfa_ms, r.itl_mean_ms, r.completion_tokens, r.max_tokens, r.error, r.session_id,
                 r.intended_send_ts)
        return lean, frame

    def _names(self, calls: Any) -> tuple[str, ...]:
        """The calls' function names (`lean.call_name`'s two places for one), the tuple shared among equal ones."""
        if not calls:
            return ()
        found = tuple([str((c.function.name if c.function is not None else None) or c.name or "") for c in calls])
        named: tuple[str, ...] = self.shared.intern(found, found)
        return named

    def _lean(self, r: Any, findings: Any, names: Any, layer: Any, signature: Any) -> LeanAttempt:
        """A decoded line's lean attempt, its findings, call names, layer and signature made already."""
        intern = self.shared.intern
        http_status = r.http_status
        stage, scenario, family, user, request, prefix, status, finish, role, stream_role = (
            r.stage, r.scenario, r.family, r.user_id, r.request_sha256, r.prefix_sha256, r.status, r.finish_reason,
            r.control_role, r.stream_role)
        lean = LeanAttempt(
            r.attempt_id, r.chain_id, r.attempt, intern(stage, stage), intern(scenario, scenario),
            intern(family, family), r.turn, intern(user, user), intern(request, request), intern(prefix, prefix),
            intern(status, status), r.send_ts, r.end_ts, r.first_token_ts, r.ttft_ms, r.e2e_ms, r.chunks,
            r.prompt_tokens, r.cached_tokens, r.request_bytes, intern(finish, finish), http_status,
            r.error_body if http_status == 400 else None, names, findings, r.valid, r.will_retry, r.drill,
            intern(layer, layer), r.control_pair, intern(role, role), r.stream_pair,
            intern(stream_role, stream_role), r.tool_call_span_ms, r.tool_call_max_gap_ms, r.tool_call_deltas,
            r.last_silence_ms, r.temperature, r.seed, r.stream, r.stream_reads, r.stream_bytes, r.history,
            r.model_round, signature, intern(r.path, r.path))
        return lean
