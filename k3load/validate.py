"""Judge one attempt: protocol, tool calls, structured output, separation, expectation.

Why layers: a failed agent turn is only actionable when it says whose fault it is. `gateway`: the
HTTP/transport path failed (status, error body, cut stream); `parser`: the server's tool/reasoning
parser left the model's markup unparsed or produced unparsable arguments; `model_output`: the answer
is well-formed but wrong against the schema or the turn's expectation; `client`: our own side
(our deadline passed, or our scenario's schema is unusable). Checks follow K2-Vendor-Verifier:
known name, arguments parse, `jsonschema` passes, `finish_reason == tool_calls` needs calls.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from k3load.client.result import STATUS_OK, STATUS_TIMEOUT, StreamResult
from k3load.records import Finding
from k3load.scenario import Scenario, Turn

# Markup that must never reach `content`: K2 and K3 tool sections, hermes tags, reasoning tags.
TOOL_MARKUP = ("<tool_call>", "</tool_call>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
               "<|open|>call", "<|open|>tools")
REASONING_MARKUP = ("<think>", "</think>", "<|open|>think", "<|close|>think", "◁think▷")


def _fail(check: str, layer: str, detail: str) -> Finding:
    return Finding(check, False, layer, detail[:500])


def check_transport(result: StreamResult) -> list[Finding]:
    if result.status == STATUS_OK:
        return [Finding("transport", True)]
    layer = "client" if result.status == STATUS_TIMEOUT else "gateway"
    detail = f"{result.status}: {result.error or ''}"
    if result.http_status is not None:
        detail = f"HTTP {result.http_status}: {result.error_body or result.error or ''}"
    return [_fail("transport", layer, detail)]


def check_tool_calls(result: StreamResult, scenario: Scenario) -> list[Finding]:
    findings: list[Finding] = []
    if result.finish_reason == "tool_calls" and not result.tool_calls:
        findings.append(_fail("tool_call.present", "parser", "finish_reason tool_calls with no tool_calls"))
    for call in result.tool_calls:
        where = f"call {call.index} ({call.name})"
        schema = scenario.tool_schema(call.name or "")
        if schema is None:
            findings.append(_fail("tool_call.name", "model_output", f"{where}: not one of the request's tools"))
            continue
        try:
            arguments = json.loads(call.arguments or "")
        except json.JSONDecodeError as exc:
            findings.append(_fail("tool_call.arguments_json", "parser", f"{where}: {exc}: {call.arguments!r}"))
            continue
        if not isinstance(arguments, dict):
            findings.append(_fail("tool_call.arguments_schema", "model_output", f"{where}: not an object"))
            continue
        findings.append(_schema_finding("tool_call.arguments_schema", arguments, schema, where))
    return findings


def _schema_finding(check: str, value: Any, schema: dict[str, Any], where: str) -> Finding:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return _fail(check, "model_output", f"{where}: {exc.message}")
    except jsonschema.SchemaError as exc:
        return _fail(check, "client", f"{where}: our schema is not usable: {exc.message}")
    return Finding(check, True)


def check_separation(result: StreamResult) -> list[Finding]:
    findings = []
    tool_markup = [m for m in TOOL_MARKUP if m in result.content]
    findings.append(_fail("content.tool_markup", "parser", f"tool-call markup in content: {tool_markup}")
                    if tool_markup else Finding("content.tool_markup", True))
    think_markup = [m for m in REASONING_MARKUP if m in result.content]
    leaked = bool(result.reasoning) and result.reasoning.strip() in result.content
    if think_markup or leaked:
        detail = f"reasoning markup in content: {think_markup}" if think_markup else "reasoning repeated in content"
        findings.append(_fail("content.reasoning_leak", "parser", detail))
    else:
        findings.append(Finding("content.reasoning_leak", True))
    return findings


def check_expectation(result: StreamResult, turn: Turn) -> list[Finding]:
    expect = turn.expect
    kind = expect["kind"]
    if kind == "tool_call":
        if not result.tool_calls:
            return [_fail("expect.tool_call", "model_output", "expected a tool call, got an answer")]
        allowed = expect.get("tools")
        wrong = [c.name for c in result.tool_calls if allowed and c.name not in allowed]
        return [_fail("expect.tool_call", "model_output", f"called {wrong}, expected one of {allowed}")
                if wrong else Finding("expect.tool_call", True)]
    if kind == "answer":
        if result.tool_calls:
            return [_fail("expect.answer", "model_output", "expected an answer without tools, got a tool call")]
        if not result.content.strip():
            return [_fail("expect.answer", "model_output", "empty answer")]
        return [Finding("expect.answer", True)]
    if kind == "json":
        return [_check_json(result, turn)]
    return []


def _check_json(result: StreamResult, turn: Turn) -> Finding:
    schema = turn.expect.get("schema") or \
        (turn.settings.get("response_format") or {}).get("json_schema", {}).get("schema", {})
    try:
        value = json.loads(result.content)
    except json.JSONDecodeError as exc:
        layer = "parser" if "response_format" in turn.settings else "model_output"
        return _fail("expect.json", layer, f"content is not JSON ({exc}): {result.content[:200]!r}")
    return _schema_finding("expect.json", value, schema, "content")


def validate(result: StreamResult, scenario: Scenario, turn: Turn) -> list[Finding]:
    """All findings for one attempt; when the transport failed, nothing else can be judged."""
    transport = check_transport(result)
    if not transport[0].ok:
        return transport
    return transport + check_tool_calls(result, scenario) + check_separation(result) + \
        check_expectation(result, turn)


# Upstream first: a failure there makes every later judgment of the same attempt a consequence
# (a parser that lost the call also fails the turn's tool-call expectation). `client` leads because
# our own unusable schema or deadline invalidates whatever else was judged.
PRIMARY_ORDER = ("client", "gateway", "server", "parser", "model_output")


def primary_layer(findings: list[Finding]) -> str | None:
    """The one layer blamed for a failed attempt (None when every finding is ok)."""
    failed = {f.layer for f in findings if not f.ok and f.layer}
    return next((layer for layer in PRIMARY_ORDER if layer in failed), None)

