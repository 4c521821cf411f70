"""Logged scenarios (`mode: logged`, written by `k3load import`): an agent's own requests, replayed as sent.

    body = logged_body(scenario, 2, "kimi-k3")     # turn 2's body: its logged keys in logged order

Why a mode of its own rather than a scripted scenario: a scripted scenario's body is built by k3load in
its declared key order from a system prompt, tools and scripted replies. An agent's request carries
keys k3load never writes (`top_p`, `presence_penalty`, `metadata`, a tool without `parameters`, content
parts), in the order the agent's SDK wrote them, and a chat template renders that order. So a logged
turn keeps the body as logged: its `request` holds every key but the history, in logged order, with
`messages: null` where the history goes, and its `messages` are what this request added to the
previous one's (the first turn: all of them). Concatenated, they are the logged `messages`, byte for
byte once compacted. Only `model` changes: the served model's name replaces the one the agent sent
(a gateway's alias means nothing to the server under test), in the same place.

A turn's settings (what the records and the validation read: max_tokens, temperature, stream,
tool_choice, response_format) come from its body, so a plan's `tool_turns` and `sampling` never
change a logged turn: the body is the operator's traffic, not ours.

Tool schemas are validated as sent where they are valid JSON Schema, else against a normalised copy:
real agents send BFCL-style types (`dict`, `float`, `tuple`, `any`) that a schema validator rejects
(../shared/data/bfcl/README.md); `normalised_schema` maps them (dict->object, float->number,
tuple->array, any->no type) and `schema_changes` says what it changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

LOGGED = "logged"
NON_STANDARD_TYPES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer", "bool": "boolean",
                      "str": "string", "list": "array", "any": None}
_SCHEMA_KEYS_OF_SCHEMAS = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then",
                           "else")
_SCHEMA_KEYS_OF_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_KEYS_OF_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def normalised_schema(schema: Any, changes: list[str] | None = None, where: str = "") -> Any:
    """`schema` with BFCL-style type names mapped to JSON Schema's; `changes` gains one `path: a -> b`
    per mapped type. Key order kept; the input is never modified."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            mapped = _mapped_type(value, changes, where)
            if mapped is not None:
                out[key] = mapped
        elif key in _SCHEMA_KEYS_OF_SCHEMAS:
            out[key] = normalised_schema(value, changes, f"{where}.{key}")
        elif key in _SCHEMA_KEYS_OF_LISTS and isinstance(value, list):
            out[key] = [normalised_schema(v, changes, f"{where}.{key}[{i}]") for i, v in enumerate(value)]
        elif key in _SCHEMA_KEYS_OF_MAPS and isinstance(value, dict):
            out[key] = {k: normalised_schema(v, changes, f"{where}.{key}.{k}") for k, v in value.items()}
        else:
            out[key] = value
    return out


def _mapped_type(value: Any, changes: list[str] | None, where: str) -> Any:
    names = value if isinstance(value, list) else [value]
    mapped = []
    for name in names:
        if isinstance(name, str) and name in NON_STANDARD_TYPES:
            target = NON_STANDARD_TYPES[name]
            if changes is not None:
                changes.append(f"{where.lstrip('.') or '(top)'}: type {name} -> {target or 'any (no type)'}")
            if target is None:
                return None  # `any` anywhere in the list: no constraint
            mapped.append(target)
        else:
            mapped.append(name)
    return mapped if isinstance(value, list) else mapped[0]


def tool_parameters(tool: Any) -> dict[str, Any]:
    """A logged tool's parameter schema for validation (normalised; a function without `parameters`
    takes any object, as the OpenAI API reads it)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    parameters = function.get("parameters") if isinstance(function, dict) else None
    return normalised_schema(parameters) if isinstance(parameters, dict) else {"type": "object"}


def offered_schemas(request: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """A request's tools by name, each parameter schema normalised (the first of a name, as a server reads it);
    computed once per turn when the scenario loads, since every answer's tool calls are validated against it."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in request_tools(request):
        name = tool_name(tool)
        if name is not None and name not in schemas:
            schemas[name] = tool_parameters(tool)
    return schemas


def tool_name(tool: Any) -> str | None:
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def request_tools(request: dict[str, Any] | None) -> list[Any]:
    tools = (request or {}).get("tools")
    return tools if isinstance(tools, list) else []


def settings_of(request: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """What the records and the validation read, from the body as logged (see the module docstring):
    `max_tokens` (or `max_completion_tokens`; None: the server's default), `temperature` (None: the
    server's), `stream` (the API's default: false), the tool and format settings; `timeout_s` and
    `retry` from the scenario's `defaults`, which the import sets."""
    settings: dict[str, Any] = {"timeout_s": defaults["timeout_s"], "retry": defaults["retry"],
                                "max_tokens": request.get("max_tokens", request.get("max_completion_tokens")),
                                "temperature": request.get("temperature"), "stream": bool(request.get("stream"))}
    for key in ("tool_choice", "response_format", "parallel_tool_calls", "seed"):
        if key in request:
            settings[key] = request[key]
    return settings


def history_through(turns: Iterable[Any], turn_index: int) -> list[dict[str, Any]]:
    """The logged `messages` of turn `turn_index`: every turn's added messages up to it, in order."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        if turn.index > turn_index:
            break
        messages += [dict(m) for m in turn.messages]
    return messages


def body_with(request: dict[str, Any], model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The body as logged with `messages` in the place the log had them and the served `model` in
    place of the logged one (first, where the log had none)."""
    body: dict[str, Any] = {} if "model" in request else {"model": model}
    for key, value in request.items():
        body[key] = messages if key == "messages" else model if key == "model" else value
    return body


def leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system (or developer) messages a conversation opens with: with the tools, its fixed prefix."""
    head = []
    for message in messages:
        if message.get("role") not in ("system", "developer"):
            break
        head.append(message)
    return head
