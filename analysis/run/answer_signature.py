"""What an answer did, as canonical text: the signature two answers to the same bytes are compared by
(analysis/pillars/agent/reproducibility.py says which answers must repeat and what a difference means).

Why here, in the run data: the decoders (analysis/run/lean.py, analysis/run/record_decode.py) sign each record as
they read it, so the judge never keeps an answer's calls; only answers that are ever compared are signed
(`compared`), because canonical JSON of every call is the costly part of reading a record.

What is compared, for turns that expect a tool call or structured output: the calls' names and arguments, each
argument parsed and written as canonical JSON (keys sorted, no spaces, a whole float as its integer), arguments
that are not JSON as their raw text; the calls as a multiset (sorted); the call ids never. On a `json` turn the
content too. A signature longer than SIGNATURE_CAP is kept as its sha256.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

SIGNATURE_CAP = 512  # characters of canonical JSON kept as they are; longer: "sha256:<hex>"
COMPARED_KINDS = ("tool_call", "json")


def _canonical_value(value: Any) -> Any:
    """A JSON value with each whole float as its integer (1.0 and 1 are the same argument to a tool)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical_value(v) for v in value]
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(text: str) -> dict[str, Any]:
    """{"json": value} for text that parses as JSON (its value canonical), else {"raw": text}."""
    try:
        return {"json": _canonical_value(json.loads(text))}
    except (ValueError, RecursionError):  # not JSON, a 5,000-digit integer, 60,000 brackets deep
        return {"raw": text}


def _name_and_arguments(call: Any) -> tuple[str, Any]:
    """A recorded call (`{"id", "type", "function": {"name", "arguments"}}`) as compared: name and arguments."""
    call = call if isinstance(call, Mapping) else {}
    function = call.get("function") or {}
    return str(function.get("name") or call.get("name") or ""), function.get("arguments", call.get("arguments"))


class Canonical:
    """Canonical JSON text of argument and content strings, and of whole calls, remembered while the same texts
    come again.

    Why: a model that must repeat sends the same arguments text again and again (that is what is compared), and
    parsing and writing it canonically was most of what signing a record cost (about 5 s of an hour's 18 s in
    bench/analysis_scale.py). At most CAP texts and CAP calls are kept, each of at most LONGEST characters (a
    longer one is written each time), then that memory starts again: at most a few tens of MB, over a day."""

    CAP = 20_000
    LONGEST = 512

    def __init__(self) -> None:
        self._texts: dict[str, str] = {}
        self._calls: dict[tuple[str, str], tuple[str, str]] = {}

    def __call__(self, text: str) -> str:
        found = self._texts.get(text)
        if found is None:
            found = self._keep(self._texts, text, _dumps(canonical_json(text)), len(text))
        return found

    def call(self, name: str, arguments: Any) -> tuple[str, str]:
        """(the arguments' canonical text, the call's canonical text `{"arguments":...,"name":...}`): the same text
        `_dumps` writes of the call's dict, keys sorted and no spaces."""
        text = arguments if isinstance(arguments, str) else _dumps(arguments)
        found = self._calls.get((name, text))
        if found is None:
            canonical = self(text)
            found = self._keep(self._calls, (name, text),
                               (canonical, '{"arguments":' + canonical + ',"name":' + _dumps(name) + "}"),
                               len(text) + len(name))
        return found

    def _keep(self, memory: dict[Any, Any], key: Any, value: Any, size: int) -> Any:
        """`value`, remembered under `key` unless over LONGEST characters (the memory started again when full)."""
        if size <= self.LONGEST:
            if len(memory) >= self.CAP:
                memory.clear()
            memory[key] = value
        return value


_CANONICAL = Canonical()


def signature_of_calls(turn_kind: str | None, calls: Iterable[tuple[str, Any]], content: str | None,
                       canonical: Canonical = _CANONICAL) -> str | None:
    """`answer_signature` of calls given as (name, arguments) pairs, joined from canonical pieces: the text of
    `_dumps({"calls": [...], "output": ...})` without building or writing the payload (tests/unit/
    test_reproducibility.py holds the two equal on any calls)."""
    if turn_kind not in COMPARED_KINDS:
        return None
    # by name, then arguments: a parallel call list in another order is the same action, and the calls of one
    # tool pair up with each other when two answers are told apart (what_differs)
    pieces = sorted(((name, *canonical.call(name, arguments)) for name, arguments in calls),
                    key=lambda p: (p[0], p[1]))
    text = '{"calls":[' + ",".join(p[2] for p in pieces) + "]"
    if turn_kind == "json":
        text += ',"output":' + canonical(content or "")
    text += "}"
    return text if len(text) <= SIGNATURE_CAP else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def answer_signature(turn_kind: str | None, tool_calls: Iterable[Any] | None, content: str | None) -> str | None:
    """What an answer did, as canonical text (module docstring); None for a turn whose answers are not compared."""
    return signature_of_calls(turn_kind, map(_name_and_arguments, tool_calls or ()), content)


def payload_signature(turn_kind: str | None, tool_calls: Iterable[Any] | None, content: str | None) -> str | None:
    """The signature as first written: the payload built whole and written by `_dumps` (the reference the joined
    pieces are held to, tests/unit/test_reproducibility.py)."""
    if turn_kind not in COMPARED_KINDS:
        return None
    calls = sorted(({"name": name, "arguments": canonical_json(arguments if isinstance(arguments, str) else
                                                               _dumps(arguments))}
                    for name, arguments in map(_name_and_arguments, tool_calls or ())),
                   key=lambda c: (c["name"], _dumps(c["arguments"])))
    payload: dict[str, Any] = {"calls": calls}
    if turn_kind == "json":
        payload["output"] = canonical_json(content or "")
    text = _dumps(payload)
    return text if len(text) <= SIGNATURE_CAP else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


UNREAD = object()  # the signature of a record read without it (a reader that kept no arguments): never guessed


def repeats(temperature: Any, seed: Any) -> bool:
    return seed is not None or (type(temperature) in (int, float) and temperature == 0)


def compared(turn_kind: Any, status: Any, temperature: Any, seed: Any) -> bool:
    """Whether a record's answer is ever compared: a tool-call or json turn answered in full that must repeat. The
    decoders sign only these (canonical JSON of every call is the costly part of reading a record)."""
    return turn_kind in COMPARED_KINDS and status == "ok" and repeats(temperature, seed)
