"""Generate a JSON value that validates against a JSON Schema, from a seeded RNG.

Why: the sim's tool-call arguments and structured outputs must be valid by construction (so that a
validation failure in a rehearsal points at an injected fault, not at the sim), while still varying
with the seed and exercising optional fields, enums and bounds. Accepts the loose dialect found in
real tool catalogues (BFCL's "dict", "float", "tuple").
"""

from __future__ import annotations

import random
import re
from typing import Any

_WORDS = (
    "alpha bravo cedar delta ember falcon garnet harbor indigo juniper kestrel lumen meadow nimbus "
    "orchid pepper quartz raven sierra tundra umber velvet willow xenon yarrow zephyr"
).split()

_TYPE_ALIASES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer", "bool": "boolean"}


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    return _TYPE_ALIASES.get(kind, kind)


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    if fmt == "date":
        return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if fmt == "date-time":
        return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:00:00Z"
    if fmt == "email":
        return f"{rng.choice(_WORDS)}@example.com"
    lo, hi = schema.get("minLength", 1), schema.get("maxLength", 24)
    text = " ".join(rng.choice(_WORDS) for _ in range(3))
    while len(text) < lo:
        text += " " + rng.choice(_WORDS)
    text = text[: max(hi, lo)]
    pattern = schema.get("pattern")
    if pattern and not re.search(pattern, text):
        for candidate in (rng.choice(_WORDS), str(rng.randint(0, 9999)), rng.choice(_WORDS).upper()):
            if re.search(pattern, candidate):
                return candidate
    return text


def _number(schema: dict[str, Any], rng: random.Random, integer: bool) -> int | float:
    lo = schema.get("minimum", schema.get("exclusiveMinimum", 0))
    hi = schema.get("maximum", schema.get("exclusiveMaximum", lo + 100))
    if integer:
        lo_i = int(lo) + (1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0)
        hi_i = int(hi) - (1 if "exclusiveMaximum" in schema and "maximum" not in schema else 0)
        return rng.randint(lo_i, max(lo_i, hi_i))
    value = min(max(round(rng.uniform(lo, hi), 3), lo), hi)
    if value in (lo, hi):  # exclusive bounds must not be met
        value = (lo + hi) / 2
    return value


def _object(schema: dict[str, Any], rng: random.Random, optional_rate: float, depth: int) -> dict[str, Any]:
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    out: dict[str, Any] = {}
    for name, sub in props.items():
        if name in required or rng.random() < optional_rate:
            out[name] = instance(sub if isinstance(sub, dict) else {}, rng, optional_rate, depth + 1)
    return out


def instance(schema: dict[str, Any], rng: random.Random, optional_rate: float = 0.5, depth: int = 0) -> Any:
    """A value valid against `schema` (as far as the keywords above go)."""
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        choice = rng.choice(schema["enum"])
        if _type_of(schema) == "array" and not isinstance(choice, list):
            return [choice]  # enum misplaced on an array (seen in BFCL): follow the evident intent
        return choice
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return instance(schema[key][0], rng, optional_rate, depth + 1)
    if schema.get("allOf"):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged.update(part)
        return instance(merged, rng, optional_rate, depth + 1)
    kind = _type_of(schema)
    if kind == "object":
        return _object(schema, rng, optional_rate if depth < 4 else 0.0, depth)
    if kind == "array":
        lo, hi = schema.get("minItems", 1), schema.get("maxItems", 3)
        items = schema.get("items")
        if not isinstance(items, dict):
            items = {}
        return [instance(items, rng, optional_rate, depth + 1) for _ in range(rng.randint(lo, max(lo, hi)))]
    if kind in ("integer", "number"):
        return _number(schema, rng, kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, rng)
