"""RFC 8259 JSON for what a model writes: one parser, one result type, no exception past it.

Usage::

    from k3load.workload import strict_json
    parsed = strict_json.parse(call.arguments)
    if isinstance(parsed, strict_json.Refused):
        ...  # parsed.reason: "nested 60,000 deep; at most 64 are read"; parsed.kind: TOO_DEEP, ...
    else:
        value = parsed.value

Every text the harness reads as JSON from outside that a model wrote (tool-call arguments, a structured
output's content, the stream-equivalence drill's comparison of them) or that a server wrote as its error
body goes through `parse`. Why not `json.loads`: Python's parser is lenient where RFC 8259 and every strict
client in another language are not, and it raises past `JSONDecodeError` where a hostile answer can reach:

- `NaN`, `Infinity`, `-Infinity` are read as floats; they are not JSON. Refused (`NOT_JSON_NUMBER`).
- A name given twice in one object silently keeps its last value; which one a client takes is undefined
  (RFC 8259 section 4). Refused, naming the key (`DUPLICATE_KEY`).
- Nesting recurses: arrays nested tens of thousands deep raise `RecursionError`. The depth is measured first,
  without recursion (a scan of the text that counts `[` and `{` outside strings), and text nested deeper than
  `MAX_DEPTH` is refused before any parser sees it (`TOO_DEEP`). Why 64: the deepest value any tool or
  structured-output schema shipped in `scenarios/` describes is 2 levels, and the deepest of the 4,616 BFCL
  live and multi-turn tool definitions (`../shared/data/bfcl/`) is 3 (`uber.eat.order`,
  `extractor.extract_information`); 64 is twenty times that, and far below the recursion limit, so a value
  read is also safe for `jsonschema` to walk. RFC 8259 section 9 lets a parser set such a limit.
- An integer literal longer than Python's conversion limit (`sys.get_int_max_str_digits()`, 4,300 digits by
  default) raises `ValueError`. Integers are read exactly up to `MAX_INT_DIGITS` digits (or the process's
  own limit where that is lower) and refused beyond, with their length (`NUMBER_TOO_LONG`): a tool argument
  of thousands of digits is no quantity any schema here describes, and converting it costs quadratic time.
  A fraction or exponent beyond a double's range, which Python reads as infinity, is refused too
  (`NUMBER_TOO_LARGE`): it is `Infinity` in other words.

Everything else is `json.loads`'s own reading (strings with lone surrogate escapes included). `parse` returns
`Parsed` or `Refused` for any `str`, and never raises (tests/unit/test_strict_json.py holds it to that with
arbitrary text, and to `json.loads`'s value for valid JSON within the limits).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Final

MAX_DEPTH: Final = 64
MAX_INT_DIGITS: Final = 4300  # Python's default conversion limit, declared: a process's own setting only lowers it

# Refused.kind: SYNTAX is not JSON at all (json.loads refused it too); the others are JSON that Python would
# have read leniently or crashed on, refused here by the rules above.
SYNTAX: Final = "syntax"
TOO_DEEP: Final = "too_deep"
NOT_JSON_NUMBER: Final = "not_json_number"
DUPLICATE_KEY: Final = "duplicate_key"
NUMBER_TOO_LONG: Final = "number_too_long"
NUMBER_TOO_LARGE: Final = "number_too_large"
KINDS: Final = (SYNTAX, TOO_DEEP, NOT_JSON_NUMBER, DUPLICATE_KEY, NUMBER_TOO_LONG, NUMBER_TOO_LARGE)


@dataclass(frozen=True, slots=True)
class Parsed:
    """The value, as `json.loads` gives it."""

    value: Any


@dataclass(frozen=True, slots=True)
class Refused:
    """Why the text is not read: `reason` in words that follow a subject ("arguments " + reason)."""

    kind: str
    reason: str

    @property
    def strict(self) -> bool:
        """JSON that a lenient parser takes (or crashes on), refused by the rules: never a syntax error."""
        return self.kind != SYNTAX


Result = Parsed | Refused

# A JSON string, escapes included, or the rest of the text after an unterminated quote: possessive, so no
# backtracking and no recursion whatever the text.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def depth(text: str) -> int:
    """How deep `[` and `{` nest outside strings (0 for a scalar), read without recursion in linear time."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(0, max(accumulate(map(_STEP.__getitem__, brackets)), default=0))


class _Refusal(Exception):
    """Raised from inside json.loads's hooks to stop the parse; never leaves this module."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(refused.reason)
        self.refused = refused


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        counts = Counter(k for k, _ in pairs)
        key = next(k for k, _ in pairs if counts[k] > 1)  # the first name given again
        times = counts[key]
        raise _Refusal(Refused(DUPLICATE_KEY, f"with the key {_quoted(key)} {_times(times)} in one object (RFC 8259 "
                                              "leaves which value counts undefined)"))
    return value


def _constant(name: str) -> Any:
    raise _Refusal(Refused(NOT_JSON_NUMBER, f"with {name}, which is not JSON (RFC 8259 has no NaN or Infinity; "
                                            "strict parsers refuse it)"))


def _int_limit() -> int:
    own = sys.get_int_max_str_digits()
    return min(MAX_INT_DIGITS, own) if own else MAX_INT_DIGITS


def _int(literal: str) -> int:
    digits = len(literal) - literal.startswith("-")
    limit = _int_limit()
    if digits > limit:
        raise _Refusal(Refused(NUMBER_TOO_LONG, f"with an integer of {digits:,} digits; at most {limit:,} are read"))
    return int(literal)


def _float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        shown = literal if len(literal) <= 40 else f"{literal[:20]}…({len(literal):,} characters)"
        raise _Refusal(Refused(NUMBER_TOO_LARGE, f"with the number {shown}, beyond a double's range (it would read "
                                                 "as Infinity)"))
    return value


def parse(text: str, max_depth: int = MAX_DEPTH) -> Result:
    """`text` read as RFC 8259 JSON within the limits above: `Parsed(value)` or `Refused(kind, reason)`."""
    if not isinstance(text, str):
        return Refused(SYNTAX, f"not text but {type(text).__name__}")
    if text.count("[") + text.count("{") > max_depth and (deep := depth(text)) > max_depth:
        return Refused(TOO_DEEP, f"nested {deep:,} deep; at most {max_depth} are read")
    try:
        return Parsed(json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant, parse_int=_int,
                                 parse_float=_float))
    except _Refusal as refusal:
        return refusal.refused
    except (ValueError, RecursionError, MemoryError) as exc:  # JSONDecodeError; the others cannot pass the limits
        return Refused(SYNTAX, str(exc) or type(exc).__name__)


def loads_or_none(text: str | None, max_depth: int = MAX_DEPTH) -> Any:
    """The value, or None when the text is absent or refused (for texts read only when they are well formed,
    as a server's error body)."""
    parsed = parse(text, max_depth) if isinstance(text, str) else None
    return parsed.value if isinstance(parsed, Parsed) else None


def _quoted(key: str) -> str:
    return json.dumps(key if len(key) <= 60 else key[:60] + "…")


def _times(count: int) -> str:
    return "twice" if count == 2 else f"{count} times"
