"""Per-request fault decisions and the plan rewrites that inject them.

Why rewrite the plan rather than the wire: each injected fault must look like the layer that really
produces it (a parser that could not extract a call leaves markup in content; a model that emits
bad JSON yields unparsable arguments), so that the harness's layer attribution is tested for real.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass
from typing import Any

from k3load.sim.config import HOSTILE_JSON_SHAPES, FaultProfile
from k3load.sim.generate import OutputPlan, Piece, vary_arguments
from k3load.sim.tokenizer import tokenize

_K3_MARKER = re.compile(r"(<\|(?:open|close|sep)\|>)")


@dataclass(frozen=True)
class FaultDecision:
    http_error: bool = False
    malformed_tool_args: bool = False
    hostile_json: str = ""  # one of config.HOSTILE_JSON_SHAPES written as the model's JSON ("" none)
    empty_tool_calls: bool = False
    raw_tool_markup: bool = False
    reasoning_leak: bool = False
    midstream_error: bool = False
    truncate_stream: bool = False
    slow_first_token_s: float = 0.0
    slow_drip_s: float = 0.0
    connection_reset: bool = False
    midstream_reset: bool = False
    weak_answer: bool = False
    # Kimi's known tool-call failures (vllm#54701, #50604, #24478, #53246); the streamed-only ones
    # are applied by stream_parser.py, missing_think_transition here (both paths share the parser).
    stream_empty_tool_calls: bool = False
    tool_args_burst_s: float = 0.0
    parallel_call_drop: bool = False
    parallel_call_merge: bool = False
    parallel_call_duplicate: bool = False
    missing_think_transition: bool = False
    skip_tool_call: bool = False  # the model answers in prose where it should call a tool
    ignore_disconnect: bool = False  # the engine keeps decoding after the client left (no abort)
    hold_after_done_s: float = 0.0  # a proxy holds the streamed body open this long after [DONE] (wall s)


def decide(profile: FaultProfile, rng: random.Random, time_scale: float) -> FaultDecision:
    """Draw every fault once, in a fixed order, so one seed gives one decision. The wire resets, then
    Kimi's tool-call failures, are drawn last and only when their rate is set, so a profile without
    them draws (and answers) exactly as before they existed."""

    def hit(rate: float) -> bool:
        return rng.random() < rate

    def hit_if_set(rate: float) -> bool:
        return rate > 0 and rng.random() < rate

    decision = FaultDecision(
        http_error=hit(profile.http_error_rate),
        malformed_tool_args=hit(profile.malformed_tool_args_rate),
        empty_tool_calls=hit(profile.empty_tool_calls_rate),
        raw_tool_markup=hit(profile.raw_tool_markup_rate),
        reasoning_leak=hit(profile.reasoning_leak_rate),
        midstream_error=hit(profile.midstream_error_rate),
        truncate_stream=hit(profile.truncate_stream_rate),
        slow_first_token_s=profile.slow_first_token_ms * time_scale / 1000
        if hit(profile.slow_first_token_rate) else 0.0,
        slow_drip_s=profile.slow_drip_ms * time_scale / 1000 if hit(profile.slow_drip_rate) else 0.0,
    )
    decision = dataclasses.replace(decision, connection_reset=hit_if_set(profile.connection_reset_rate),
                                   midstream_reset=hit_if_set(profile.midstream_reset_rate),
                                   weak_answer=hit_if_set(profile.weak_answer_rate))
    decision = dataclasses.replace(  # keyword arguments are evaluated in order: the draws keep this order
        decision, stream_empty_tool_calls=hit_if_set(profile.stream_empty_tool_calls_rate),
        tool_args_burst_s=profile.tool_args_burst_ms * time_scale / 1000
        if hit_if_set(profile.tool_args_burst_rate) else 0.0,
        parallel_call_drop=hit_if_set(profile.parallel_call_drop_rate),
        parallel_call_merge=hit_if_set(profile.parallel_call_merge_rate),
        parallel_call_duplicate=hit_if_set(profile.parallel_call_duplicate_rate),
        missing_think_transition=hit_if_set(profile.missing_think_transition_rate),
        skip_tool_call=hit_if_set(profile.skip_tool_call_rate))
    # the serving side: a disconnect that never reaches the engine (drawn after every model fault)
    decision = dataclasses.replace(decision, ignore_disconnect=hit_if_set(profile.ignore_disconnect_rate))
    decision = dataclasses.replace(decision, hostile_json=_hostile_shape(profile, rng) if
                                   hit_if_set(profile.hostile_json_rate) else "")  # the model's
    # a proxy holding the body open after [DONE] (wall time: a proxy's, not the model's), drawn last of all
    return dataclasses.replace(decision, hold_after_done_s=profile.hold_after_done_ms / 1000
                               if hit_if_set(profile.hold_after_done_rate) else 0.0)


def _hostile_shape(profile: FaultProfile, rng: random.Random) -> str:
    shape = profile.hostile_json_shape
    return rng.choice(HOSTILE_JSON_SHAPES) if shape == "mixed" else shape


def _as_content(text: str) -> list[Piece]:
    return [Piece("content", t) for t in tokenize(text)]


def apply_to_plan(plan: OutputPlan, fault: FaultDecision) -> OutputPlan:
    """The plan as a faulty model/parser would have produced it (both the streamed and whole paths)."""
    pieces = list(plan.pieces)
    calls = [dict(c) for c in plan.tool_calls]
    finish = plan.finish_reason
    if fault.weak_answer:  # a weak model: thinks, then says nothing and calls nothing (well-formed, wrong)
        return OutputPlan([p for p in pieces if p.kind == "reasoning"] + [Piece("none")], "stop", [])
    if calls and fault.skip_tool_call and finish == "tool_calls":  # the model's choice: prose, no call
        prose = _as_content("I can answer that without looking anything up: it should be fine.")
        return OutputPlan([p for p in pieces if p.kind == "reasoning"] + prose + [Piece("content", "")], "stop", [])
    if fault.missing_think_transition and any(p.kind == "reasoning" for p in pieces):
        return _no_transition(plan)
    if fault.reasoning_leak:  # no reasoning parser: K3's think markup and text stay in content
        thinking = [Piece("content", p.text) for p in pieces if p.kind == "reasoning"]
        rest = [p for p in pieces if p.kind != "reasoning"]
        pieces = [*_as_content("<|open|>think<|sep|>"), *thinking, *_as_content("<|close|>think<|sep|>"), *rest]
    if calls and fault.malformed_tool_args:
        pieces = _malformed_first_call(pieces, calls, _is_k3(plan))
    elif fault.hostile_json:
        pieces = _hostile_first_call(pieces, calls, _is_k3(plan), fault.hostile_json) if calls else \
            _hostile_content(pieces, fault.hostile_json)
    if calls and fault.raw_tool_markup:
        markup = "".join(f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{c['arguments']}<|tool_call_end|>"
                         for c in calls)
        markup = f"<|tool_calls_section_begin|>{markup}<|tool_calls_section_end|>"
        pieces = [p for p in pieces if p.kind in ("reasoning", "content")] + _as_content(markup)
        pieces.append(Piece("content", ""))  # EOS
        return OutputPlan(pieces, "stop", [])
    if calls and fault.empty_tool_calls:
        pieces = [p for p in pieces if p.kind in ("reasoning", "content")] + [Piece("none")]
        return OutputPlan(pieces, "tool_calls", [])
    return OutputPlan(pieces, finish, calls)


def _malformed_first_call(pieces: list[Piece], calls: list[dict[str, Any]], whole: bool) -> list[Piece]:
    """The first call's arguments cut short and followed by unquoted text (a model writing bad JSON);
    any further calls keep their tokens."""
    bad = calls[0]["arguments"][:-1] + ', "note": unquoted text'
    calls[0]["arguments"] = bad
    args = tokenize(bad)
    tool_kinds = ("tool_header", "tool_args", "tool_whole", "none")
    head = [p for p in pieces if p.kind not in tool_kinds]
    first = [p for p in pieces if p.kind == "tool_header" and p.tool_index == 0]
    if whole:
        first += [*[Piece("none")] * len(args), Piece("tool_whole", bad)]
    else:
        first += [Piece("tool_args", t) for t in args]
    later = [p for p in pieces[:-1] if p.kind in tool_kinds and p.tool_index > 0]
    return [*head, *first, *later, Piece("none")]  # EOS


HOSTILE_DEPTH = 60_000


def hostile_text(shape: str, arguments: str = "{}") -> str:
    """JSON a lenient parser takes or crashes on: `deep` (arrays nested 60,000 deep, RecursionError in
    Python's json), `long_int` (5,000 digits, past Python's 4,300-digit conversion limit), `nan` (NaN and
    -Infinity, which JSON has not), `duplicate_key` (`arguments`' first key given again, else "key" twice)."""
    if shape == "deep":
        return '{"nested": ' + "[" * (HOSTILE_DEPTH - 1) + "]" * (HOSTILE_DEPTH - 1) + "}"
    if shape == "long_int":
        return '{"count": ' + "9" * 5000 + "}"
    if shape == "nan":
        return '{"value": NaN, "low": -Infinity}'
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if isinstance(value, dict) and value:
        key, item = next(iter(value.items()))
        return arguments.rstrip()[:-1] + f", {json.dumps(key)}: {json.dumps(item)}}}"
    return '{"key": 1, "key": 2}'


def _hostile_first_call(pieces: list[Piece], calls: list[dict[str, Any]], whole: bool, shape: str) -> list[Piece]:
    """The first call's arguments replaced by `hostile_text`, sent in one piece (60,000 brackets are no
    60,000 tokens a max_tokens cut should see); any further calls keep their tokens."""
    bad = calls[0]["arguments"] = hostile_text(shape, calls[0]["arguments"])
    tool_kinds = ("tool_header", "tool_args", "tool_whole", "none")
    head = [p for p in pieces if p.kind not in tool_kinds]
    first = [p for p in pieces if p.kind == "tool_header" and p.tool_index == 0]
    first += [Piece("none"), Piece("tool_whole", bad)] if whole else [Piece("tool_args", bad)]
    later = [p for p in pieces[:-1] if p.kind in tool_kinds and p.tool_index > 0]
    return [*head, *first, *later, Piece("none")]  # EOS


def _hostile_content(pieces: list[Piece], shape: str) -> list[Piece]:
    """A JSON answer (a structured output: its content starts with `{`) written as `hostile_text`; any other
    answer is left as it is."""
    content = "".join(p.text for p in pieces if p.kind == "content")
    if not content.lstrip().startswith("{"):
        return pieces
    bad = hostile_text(shape, content)
    return [*(p for p in pieces if p.kind == "reasoning"), Piece("content", bad), Piece("content", "")]  # EOS


def _no_transition(plan: OutputPlan) -> OutputPlan:
    """vllm#53246: the model never writes the think-to-answer transition (`<|close|>think<|sep|>`), so
    the reasoning parser never ends the reasoning and what follows stays in it as K3 markup: the
    `tools` channel with each call (the tool parser never sees it) or the `response` channel with the
    answer. Content empty, no calls, finish_reason "stop"."""
    reasoning = [p for p in plan.pieces if p.kind == "reasoning"]
    if plan.tool_calls:
        text = "<|open|>tools<|sep|>" + "".join(_k3_call(i, c) for i, c in enumerate(plan.tool_calls)) + \
            "<|close|>tools<|sep|>"
    else:
        answer = "".join(p.text for p in plan.pieces if p.kind == "content")
        text = f"<|open|>response<|sep|>{answer}<|close|>response<|sep|>"
    return OutputPlan([*reasoning, *_k3_pieces("reasoning", text), Piece("none")], "stop", [])


def _k3_pieces(kind: str, text: str) -> list[Piece]:
    """K3's markers (`<|open|>`, `<|sep|>`, `<|close|>`) are one special token each; the rest is text."""
    return [Piece(kind, t) for part in _K3_MARKER.split(text) if part
            for t in ([part] if _K3_MARKER.fullmatch(part) else tokenize(part))]


def _k3_call(index: int, call: dict[str, Any]) -> str:
    """One call in K3's XTML (vllm/tool_parsers/kimi_k3_tool_parser.py): strings raw, the rest JSON."""
    try:
        arguments = json.loads(call["arguments"])
    except json.JSONDecodeError:
        arguments = {}
    parts = "".join(
        f'<|open|>argument key="{key}" type="{_xtml_type(value)}"<|sep|>'
        f"{value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))}<|close|>argument<|sep|>"
        for key, value in (arguments.items() if isinstance(arguments, dict) else []))
    return f'<|open|>call tool="{call["name"]}" index="{index + 1}"<|sep|>{parts}<|close|>call<|sep|>'


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return {str: "string", int: "integer", float: "number", dict: "object", list: "array"}.get(type(value), "string")


def _is_k3(plan: OutputPlan) -> bool:
    return any(p.kind == "tool_whole" for p in plan.pieces)


def batch_dependent(plan: OutputPlan, key: str, rate: float) -> OutputPlan:
    """A batch-variant engine's answer (`--batch-dependent-args-rate`): each call, with chance `rate` drawn from
    `key`, has one argument value decoded otherwise (`generate.vary_arguments`: still valid against the tool's
    schema). The engine's key is the request and the number of requests it holds (engine.py), so a request
    answers the same at the same batch size, and otherwise under load.

    Why a fault of the engine, not of the model: vLLM is not batch-invariant by default. Its kernels reduce in
    an order that depends on the batch, so the same greedy request can take a near-tie token the other way when
    the batch around it changes; VLLM_BATCH_INVARIANT=1 (beta) makes the output "deterministic and independent
    of the batch size or the order of requests in a batch" (docs.vllm.ai/en/v0.32.0/features/batch_invariance/).
    A call already rewritten (a cut at max_tokens, a parser fault that moved or merged its arguments) is left
    as it is: its pieces no longer carry exactly its arguments."""
    pieces, calls = list(plan.pieces), [dict(c) for c in plan.tool_calls]
    for index, call in enumerate(calls):
        rng = random.Random(f"{key}:{index}")
        if rng.random() >= rate:
            continue
        varied = vary_arguments(call["arguments"], call.get("parameters") or {}, rng)
        carrying = [i for i, p in enumerate(pieces) if p.tool_index == index and p.kind in ("tool_args", "tool_whole")]
        if varied is None or not carrying or "".join(pieces[i].text for i in carrying) != call["arguments"]:
            continue
        tokens = [varied] if len(carrying) == 1 else tokenize(varied)
        for n, position in enumerate(carrying):  # the last piece takes what is left, a short call's rest are empty
            text = "".join(tokens[n:]) if n == len(carrying) - 1 else tokens[n] if n < len(tokens) else ""
            pieces[position] = Piece(pieces[position].kind, text, index)
        call["arguments"] = varied
    return OutputPlan(pieces, plan.finish_reason, calls)
