"""Judge one attempt: protocol, tool calls, structured output, separation, expectation.

Why layers: a failed agent turn is only actionable when it says whose fault it is. `gateway`: the
HTTP path failed on the way (a proxy's HTML page, 429/502/504, a reset, a cut or malformed stream);
`server`: vLLM answered with its own error (JSON body, mid-stream error event, the context-length
400); `parser`: the server's tool/reasoning parser left the model's markup unparsed or produced
unparsable arguments; `model_output`: the answer is well-formed but wrong against the schema or the
turn's expectation; `client`: our own side (our deadline passed, or our scenario's schema is
unusable). One attempt is counted once, under its primary layer (`primary_layer`). Checks follow K2-Vendor-Verifier:
known name, arguments parse, `jsonschema` passes, `finish_reason == tool_calls` needs calls.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jsonschema

from k3load.client.result import STATUS_HTTP_ERROR, STATUS_OK, STATUS_STREAM_ERROR, STATUS_TIMEOUT, StreamResult
from k3load.outcomes import CLIENT, GATEWAY, MODEL_OUTPUT, PARSER, SERVER
from k3load.records import Finding, timing_fields
from k3load.workload import strict_json
from k3load.workload.scenario import Scenario, Turn

# Markup that must never reach `content`: K2 and K3 tool sections, hermes tags, reasoning tags.
TOOL_MARKUP = ("<tool_call>", "</tool_call>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
               "<|open|>call", "<|open|>tools")
REASONING_MARKUP = ("<think>", "</think>", "<|open|>think", "<|close|>think", "◁think▷")


def _fail(check: str, layer: str, detail: str) -> Finding:
    return Finding(check, False, layer, detail[:500])


# vLLM's context-length refusal (vllm/entrypoints/openai/serving_engine.py, 0.32): HTTP 400 with
# "This model's maximum context length is N tokens. However, your prompt contains M input tokens ..."
CONTEXT_LENGTH = re.compile(r"maximum context length is (\d+) tokens.*?(?:prompt|request|messages)\D{0,40}?(\d+)",
                            re.IGNORECASE | re.DOTALL)
GATEWAY_STATUSES = (429, 502, 504)  # vLLM itself never answers these: a proxy or rate limiter did


def vllm_error(body: str | None) -> dict[str, Any] | None:
    """vLLM's own JSON error body ({"error": {"message", "type", "code"}} in 0.32, the flat
    {"object": "error", "message"} before): a server answer, not a proxy's page. Read strictly
    (k3load.workload.strict_json): a body nested without limit is no vLLM error, and never raises."""
    data = strict_json.loads_or_none(body)
    if not isinstance(data, dict):
        return None
    nested = data.get("error")
    error = nested if isinstance(nested, dict) else data if data.get("object") == "error" else None
    return error if error and isinstance(error.get("message"), str) else None


class ContextRefusal(NamedTuple):
    """vLLM's context-length 400, read. Why `at_least`: vLLM 0.32 tokenizes a prompt only up to
    max_model_len + 1 tokens and then says "at least N" (vllm/renderers/params.py), so a 1,400-token
    prompt against a 1,024-token context reads 1,025: a floor, never the prompt's size. A prompt far
    over is refused on its characters before tokenizing (`prompt_chars`, no token count at all)."""

    max_model_len: int
    prompt_tokens: int | None
    at_least: bool = False
    prompt_chars: int | None = None
    completion_tokens: int | None = None  # the output budget asked for, where the refusal counts it


_CHARACTERS = re.compile(r"contains (\d+) characters", re.IGNORECASE)
# Other wordings of the same refusal, from vLLM releases around 0.32 and the servers in front of them:
# the prompt fits, prompt + max_tokens does not ("(1000 in the messages, 100 in the completion)"; "'max_tokens'
# ... is too large: 100 ... your request has 1000 input tokens"), or get_max_tokens' own "Input length (N)
# exceeds model's maximum context length (M)". Read whole, the prompt's count is never the sum.
_SPLIT = re.compile(r"\((\d+) in the messages, (\d+) in the completion\)", re.IGNORECASE)
_TOO_LARGE = re.compile(r"max_(?:completion_)?tokens'? is too large: (\d+)\..*?maximum context length is (\d+) "
                        r"tokens and your request has (\d+) input tokens", re.IGNORECASE | re.DOTALL)
_INPUT_LENGTH = re.compile(r"Input length \((\d+)\) exceeds model's maximum context length \((\d+)\)",
                           re.IGNORECASE)


def context_length(body: str | None) -> ContextRefusal | None:
    """The refusal's numbers from vLLM's context-length 400 (its JSON body or stream error), or None."""
    error = vllm_error(body)
    message = error["message"] if error else ""
    if found := _TOO_LARGE.search(message):
        return ContextRefusal(int(found.group(2)), int(found.group(3)), completion_tokens=int(found.group(1)))
    if found := _INPUT_LENGTH.search(message):
        return ContextRefusal(int(found.group(2)), int(found.group(1)))
    match = CONTEXT_LENGTH.search(message)
    if not match:
        return None
    limit = int(match.group(1))
    if chars := _CHARACTERS.search(message):
        return ContextRefusal(limit, None, True, int(chars.group(1)))
    if split := _SPLIT.search(message):
        return ContextRefusal(limit, int(split.group(1)), completion_tokens=int(split.group(2)))
    tokens = int(match.group(2))
    at_least = "at least" in message[max(0, match.start(2) - 12):match.start(2)] or tokens == limit + 1
    return ContextRefusal(limit, tokens, at_least)


def refusal_text(refusal: ContextRefusal) -> str:
    """`prompt 1532 tokens`, `prompt at least 1025 tokens`, `prompt 1000 tokens + 100 for the completion`, or
    `prompt of 90000 characters`."""
    if refusal.prompt_tokens is None:
        return f"prompt of {refusal.prompt_chars} characters (not tokenized)"
    said = f"prompt {'at least ' if refusal.at_least else ''}{refusal.prompt_tokens} tokens"
    return said if refusal.completion_tokens is None else f"{said} + {refusal.completion_tokens} for the completion"


def transport_layer(result: StreamResult) -> str:
    """Who failed when the exchange itself failed. `client`: our deadline. `server`: vLLM's own JSON
    error body or its mid-stream error event. `gateway`: everything a proxy produces or that breaks
    on the way (HTML pages, 429/502/504, an error without vLLM's body, resets, cut or malformed streams)."""
    if result.status == STATUS_TIMEOUT:
        return CLIENT
    if result.status == STATUS_STREAM_ERROR:
        return SERVER
    if result.status == STATUS_HTTP_ERROR:
        own = vllm_error(result.error_body) is not None
        return SERVER if own and result.http_status not in GATEWAY_STATUSES else GATEWAY
    return GATEWAY


def stall(result: StreamResult, turn: Turn, timing: dict[str, Any], max_gap_ms: float | None) -> Finding | None:
    """A timeout that was a stall, not our deadline: the server had begun answering (its first event
    came) and then sent nothing for at least the plan's `max_tool_call_gap_ms` before our deadline cut
    it. Why it matters: with a client deadline of 60 s, a parser that holds a K3 call back for minutes
    (vllm#50604) would otherwise read as our own timeout. A timeout drill whose first deadline is
    shorter than the limit can never meet this: its silence is at most its deadline."""
    silence = timing.get("last_silence_ms")
    if result.status != STATUS_TIMEOUT or max_gap_ms is None or silence is None or \
            result.first_event_ts is None or silence < max_gap_ms:
        return None
    tool_turn = turn.kind == "tool_call"
    why = ("a parser holding a tool call back until its end (vllm#50604) looks like this" if tool_turn else
           "the server stopped streaming")
    return _fail("stream.stall", PARSER if tool_turn else SERVER,
                 f"no token for {silence / 1000:.1f} s before our deadline cut the answer ({len(result.chunk_ts)} "
                 f"token chunks before it; limit {max_gap_ms / 1000:g} s, thresholds.agent_api.max_tool_call_gap_ms): "
                 f"a stall, not a slow answer; {why}")


def check_transport(result: StreamResult) -> list[Finding]:
    if result.status == STATUS_OK:
        return [Finding("transport", True)]
    refusal = context_length(result.error_body) if result.http_status == 400 else None
    if refusal:
        return [_fail("request.context_length", SERVER, f"{refusal_text(refusal)} > max_model_len "
                      f"{refusal.max_model_len} (vLLM's context-length 400: {result.error_body or ''})")]
    detail = f"{result.status}: {result.error or ''}"
    if result.http_status is not None:
        detail = f"HTTP {result.http_status}: {result.error_body or result.error or ''}"
    return [_fail("transport", transport_layer(result), detail)]


def check_tool_calls(result: StreamResult, scenario: Scenario, turn: Turn | None = None) -> list[Finding]:
    findings: list[Finding] = []
    if result.finish_reason == "tool_calls" and not result.tool_calls:
        findings.append(_fail("tool_call.present", PARSER, "finish_reason tool_calls with no tool_calls"))
    ids = [c.id for c in result.tool_calls if c.id]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:  # the model writes arguments, the server assigns ids: a repeated id is the parser's
        findings.append(_fail("tool_call.unique_ids", PARSER, f"call id {repeated[0]!r} appears "
                              f"{ids.count(repeated[0])} times among {len(result.tool_calls)} calls: the parser "
                              "emitted one call twice (vllm#24478)"))
    for call in result.tool_calls:
        where = f"call {call.index} ({call.name})"
        schema = scenario.tool_schema(call.name or "", turn)
        if schema is None:
            findings.append(_fail("tool_call.name", MODEL_OUTPUT, f"{where}: not one of the request's tools"))
            continue
        parsed = strict_json.parse(call.arguments or "")
        if isinstance(parsed, strict_json.Refused):
            findings.append(_arguments_not_json(result, where, parsed, call.arguments))
            continue
        arguments = parsed.value
        if not isinstance(arguments, dict):
            findings.append(_fail("tool_call.arguments_schema", MODEL_OUTPUT, f"{where}: not an object"))
            continue
        findings.append(_schema_finding("tool_call.arguments_schema", arguments, schema, where))
    return findings


def _arguments_not_json(result: StreamResult, where: str, refused: strict_json.Refused, text: str | None) -> Finding:
    """Arguments that do not parse: the parser's fault, unless the model ran out of tokens mid-call
    (finish_reason `length`). A small model looping inside a string argument ("...-task-to-add-to-...")
    until max_tokens leaves cut JSON that no parser could mend: that is the model's output. Arguments that
    are JSON but refused by the strict rules (nested past the limit, NaN, a key given twice, a number past
    the limits: k3load.workload.strict_json) are what the model wrote, copied faithfully: `model_output`."""
    if refused.strict:
        return _fail("tool_call.arguments_json", MODEL_OUTPUT,
                     f"{where}: arguments {refused.reason} ({_size(text)}: {_start(text)})")
    exc = refused.reason
    if result.finish_reason == "length":
        return _fail("tool_call.arguments_json", MODEL_OUTPUT,
                     f"{where}: cut at max_tokens (finish_reason length) mid-arguments: {exc}: {text!r}")
    return _fail("tool_call.arguments_json", PARSER, f"{where}: {exc}: {text!r}")


def _schema_finding(check: str, value: Any, schema: dict[str, Any], where: str) -> Finding:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return _fail(check, MODEL_OUTPUT, f"{where}: {exc.message}")
    except jsonschema.SchemaError as exc:
        return _fail(check, CLIENT, f"{where}: our schema is not usable: {exc.message}")
    return Finding(check, True)


def check_cadence(result: StreamResult, timing: dict[str, Any], max_gap_ms: float | None) -> list[Finding]:
    """A streamed tool call with a silence past the plan's limit inside it (the silence leading into
    its first delta included): the model generated the arguments (decoding went on) but the parser
    sent nothing until the call was whole (vllm#50604); a client shows nothing, or times out. When the
    stream went as long without a token outside the call too, the silences are the path's (a proxy
    that buffers the stream and flushes it in lumps), not the parser's: `gateway`."""
    gap = timing.get("tool_call_max_gap_ms")
    if gap is None or max_gap_ms is None:
        return []
    if gap <= max_gap_ms:
        return [Finding("tool_call.cadence", True)]
    deltas = timing.get("tool_call_deltas")
    said = f"{gap / 1000:.1f} s without a token inside a tool call (limit {max_gap_ms / 1000:g} s, " \
        "thresholds.agent_api.max_tool_call_gap_ms)"
    outside = _longest_gap_outside_calls(result)
    if outside >= max_gap_ms:
        return [_fail("tool_call.cadence", GATEWAY, f"{said}, and {outside / 1000:.1f} s outside it too: the whole "
                      "stream arrived in lumps (a buffering proxy), not a parser holding the call back")]
    return [_fail("tool_call.cadence", PARSER, f"{said}; the call came in {deltas} delta(s): arguments held "
                  "back until the call was whole (vllm#50604), not slow decoding")]


def _longest_gap_outside_calls(result: StreamResult) -> float:
    """The longest interval (ms) between token chunks that ends outside the tool-call window (from the
    chunk before the first tool delta to the last one)."""
    ts, idx = result.chunk_ts, result.tool_chunk_idx
    first, last = (idx[0], idx[-1]) if idx else (len(ts), len(ts))
    gaps = [(ts[i] - ts[i - 1]) * 1000 for i in range(1, len(ts)) if not first <= i <= last]
    return max(gaps, default=0.0)


def check_transition(result: StreamResult, turn: Turn) -> list[Finding]:
    """Reasoning present, content and calls empty: the answer never left the reasoning. With the
    tool-call markup inside the reasoning (or finish_reason tool_calls), the model wrote its call but
    omitted the think-to-answer transition and the reasoning parser kept everything (vllm#53246):
    the parser's. Without that evidence the model thought and then said nothing: the model's. A turn judged on
    validity alone (`any`: a trace row, an unrecorded logged turn, a model-driven turn off its script) is spared
    only when cut at max_tokens: a budget spent thinking is no missing transition."""
    if not result.reasoning.strip() or result.content.strip() or result.tool_calls or \
            (turn.kind == "any" and result.finish_reason == "length"):
        return []
    markup = [m for m in TOOL_MARKUP if m in result.reasoning]
    if markup or result.finish_reason == "tool_calls":
        evidence = f"tool-call markup {markup} inside reasoning" if markup else "finish_reason tool_calls"
        return [_fail("reasoning.no_transition", PARSER, f"reasoning present, content and calls empty, {evidence}:"
                      " the answer never left the reasoning (no think-to-answer transition, vllm#53246)")]
    return [_fail("reasoning.no_transition", MODEL_OUTPUT, "reasoning present, content and calls empty, no "
                  "tool-call markup in the reasoning: the model thought and then said nothing")]


def check_separation(result: StreamResult) -> list[Finding]:
    findings = []
    tool_markup = [m for m in TOOL_MARKUP if m in result.content]
    findings.append(_fail("content.tool_markup", PARSER, f"tool-call markup in content: {tool_markup}")
                    if tool_markup else Finding("content.tool_markup", True))
    think_markup = [m for m in REASONING_MARKUP if m in result.content]
    leaked = bool(result.reasoning) and result.reasoning.strip() in result.content
    if think_markup or leaked:
        detail = f"reasoning markup in content: {think_markup}" if think_markup else "reasoning repeated in content"
        findings.append(_fail("content.reasoning_leak", PARSER, detail))
    else:
        findings.append(Finding("content.reasoning_leak", True))
    return findings


def check_expectation(result: StreamResult, turn: Turn) -> list[Finding]:
    expect = turn.expect
    kind = expect["kind"]
    if kind == "tool_call":
        if not result.tool_calls:
            return [_fail("expect.tool_call", MODEL_OUTPUT, "expected a tool call, got an answer")]
        allowed = expect.get("tools")
        wrong = [c.name for c in result.tool_calls if allowed and c.name not in allowed]
        findings = [_fail("expect.tool_call", MODEL_OUTPUT, f"called {wrong}, expected one of {allowed}")
                    if wrong else Finding("expect.tool_call", True)]
        return findings + ([_check_calls(result, expect["calls"])] if expect.get("calls") else [])
    if kind == "answer":
        if result.tool_calls:
            return [_fail("expect.answer", MODEL_OUTPUT, "expected an answer without tools, got a tool call")]
        if not result.content.strip():
            return [_fail("expect.answer", MODEL_OUTPUT, "empty answer")]
        return [Finding("expect.answer", True)]
    if kind == "json":
        return [_check_json(result, turn)]
    return []


def _check_calls(result: StreamResult, expected: list[str]) -> Finding:
    """The calls one answer must carry (parallel calls), by name, in any order. A shortfall reads as
    the model's unless another check found the parser's hand (merged arguments, a repeated id) or the
    streaming-equivalence drill's non-streamed twin got them all."""
    got = sorted(c.name or "" for c in result.tool_calls)
    if got == sorted(expected):
        return Finding("expect.calls", True)
    missing = _minus(sorted(expected), got)
    extra = _minus(got, sorted(expected))
    parts = [f"{len(got)} calls {got}, expected {len(expected)} {sorted(expected)}"]
    parts += [f"missing {missing}"] if missing else []
    parts += [f"extra {extra}"] if extra else []
    return _fail("expect.calls", MODEL_OUTPUT, "; ".join(parts))


def _minus(items: list[str], taken: list[str]) -> list[str]:
    left = list(items)
    for item in taken:
        if item in left:
            left.remove(item)
    return left


def _check_json(result: StreamResult, turn: Turn) -> Finding:
    schema = turn.expect.get("schema") or \
        (turn.settings.get("response_format") or {}).get("json_schema", {}).get("schema", {})
    parsed = strict_json.parse(result.content)
    if isinstance(parsed, strict_json.Refused) and parsed.strict:  # JSON, but not what a strict client reads
        return _fail("expect.json", MODEL_OUTPUT, f"content {parsed.reason} ({_size(result.content)}: "
                     f"{_start(result.content)})")
    if isinstance(parsed, strict_json.Refused):
        exc = parsed.reason
        if result.finish_reason == "length":  # cut by max_tokens: no grammar or parser can close it
            return _fail("expect.json", MODEL_OUTPUT, f"content cut at max_tokens (finish_reason length), not "
                         f"JSON ({exc}): {result.content[:200]!r}")
        layer = PARSER if "response_format" in turn.settings else MODEL_OUTPUT
        return _fail("expect.json", layer, f"content is not JSON ({exc}): {result.content[:200]!r}")
    return _schema_finding("expect.json", parsed.value, schema, "content")


def _size(text: str | None) -> str:
    return f"{len(text or ''):,} characters"


def _start(text: str | None) -> str:
    """The first 80 characters, quoted: enough to recognise the shape, never a 100 KB detail."""
    text = text or ""
    return repr(text[:80]) + ("…" if len(text) > 80 else "")


def validate(result: StreamResult, scenario: Scenario, turn: Turn, timing: dict[str, Any] | None = None,
             max_tool_call_gap_ms: float | None = None) -> list[Finding]:
    """All findings for one attempt; when the transport failed, nothing else can be judged (a stall
    cut by our deadline is said as the stall, not as our timeout). `timing` is the attempt's
    `timing_fields` (computed once by the runner); `max_tool_call_gap_ms` the plan's silence limit."""
    timing = timing if timing is not None else timing_fields(result)
    transport = check_transport(result)
    if not transport[0].ok:
        stalled = stall(result, turn, timing, max_tool_call_gap_ms)
        return [stalled] if stalled else transport
    return transport + check_tool_calls(result, scenario, turn) + \
        check_cadence(result, timing, max_tool_call_gap_ms) + check_separation(result) + \
        check_transition(result, turn) + check_expectation(result, turn)


# Upstream first: a failure there makes every later judgment of the same attempt a consequence
# (a parser that lost the call also fails the turn's tool-call expectation). `client` leads because
# our own unusable schema or deadline invalidates whatever else was judged.
PRIMARY_ORDER = (CLIENT, GATEWAY, SERVER, PARSER, MODEL_OUTPUT)


def primary_layer(findings: list[Finding]) -> str | None:
    """The one layer blamed for a failed attempt (None when every finding is ok)."""
    failed = {f.layer for f in findings if not f.ok and f.layer}
    return next((layer for layer in PRIMARY_ORDER if layer in failed), None)

