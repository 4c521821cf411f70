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


def _call(call: Any) -> dict[str, Any]:
    """A recorded call (`{"id", "type", "function": {"name", "arguments"}}`) as compared: name and arguments."""
    call = call if isinstance(call, Mapping) else {}
    function = call.get("function") or {}
    name = function.get("name") or call.get("name") or ""
    arguments = function.get("arguments", call.get("arguments"))
    return {"name": str(name), "arguments": canonical_json(arguments if isinstance(arguments, str) else
                                                           _dumps(arguments))}


def answer_signature(turn_kind: str | None, tool_calls: Iterable[Any] | None, content: str | None) -> str | None:
    """What an answer did, as canonical text (module docstring); None for a turn whose answers are not compared."""
    if turn_kind not in COMPARED_KINDS:
        return None
    # by name, then arguments: a parallel call list in another order is the same action, and the calls of one
    # tool pair up with each other when two answers are told apart (what_differs)
    calls = sorted((_call(c) for c in tool_calls or ()), key=lambda c: (c["name"], _dumps(c["arguments"])))
    payload: dict[str, Any] = {"calls": calls}
    if turn_kind == "json":
        payload["output"] = canonical_json(content or "")
    text = _dumps(payload)
    return text if len(text) <= SIGNATURE_CAP else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def repeats(temperature: Any, seed: Any) -> bool:
    return seed is not None or (type(temperature) in (int, float) and temperature == 0)


def compared(turn_kind: Any, status: Any, temperature: Any, seed: Any) -> bool:
    """Whether a record's answer is ever compared: a tool-call or json turn answered in full that must repeat. The
    decoders sign only these (canonical JSON of every call is the costly part of reading a record)."""
    return turn_kind in COMPARED_KINDS and status == "ok" and repeats(temperature, seed)
