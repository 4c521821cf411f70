"""Per-request fault decisions and the plan rewrites that inject them.

Why rewrite the plan rather than the wire: each injected fault must look like the layer that really
produces it (a parser that could not extract a call leaves markup in content; a model that emits
bad JSON yields unparsable arguments), so that the harness's layer attribution is tested for real.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from k3load.sim.config import FaultProfile
from k3load.sim.generate import OutputPlan, Piece
from k3load.sim.tokenizer import tokenize


@dataclass(frozen=True)
class FaultDecision:
    http_error: bool = False
    malformed_tool_args: bool = False
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


def decide(profile: FaultProfile, rng: random.Random, time_scale: float) -> FaultDecision:
    """Draw every fault once, in a fixed order, so one seed gives one decision. The wire resets are
    drawn last and only when their rate is set, so a profile without them draws (and answers) exactly
    as before they existed."""

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
    return dataclasses.replace(decision, connection_reset=hit_if_set(profile.connection_reset_rate),
                               midstream_reset=hit_if_set(profile.midstream_reset_rate),
                               weak_answer=hit_if_set(profile.weak_answer_rate))


def _as_content(text: str) -> list[Piece]:
    return [Piece("content", t) for t in tokenize(text)]


def apply_to_plan(plan: OutputPlan, fault: FaultDecision) -> OutputPlan:
    """The plan as a faulty model/parser would have produced it."""
    pieces = list(plan.pieces)
    calls = [dict(c) for c in plan.tool_calls]
    finish = plan.finish_reason
    if fault.weak_answer:  # a weak model: thinks, then says nothing and calls nothing (well-formed, wrong)
        return OutputPlan([p for p in pieces if p.kind == "reasoning"] + [Piece("none")], "stop", [])
    if fault.reasoning_leak:  # no reasoning parser: K3's think markup and text stay in content
        thinking = [Piece("content", p.text) for p in pieces if p.kind == "reasoning"]
        rest = [p for p in pieces if p.kind != "reasoning"]
        pieces = [*_as_content("<|open|>think<|sep|>"), *thinking, *_as_content("<|close|>think<|sep|>"), *rest]
    if calls and fault.malformed_tool_args:
        bad = calls[0]["arguments"][:-1] + ', "note": unquoted text'
        calls[0]["arguments"] = bad
        args = tokenize(bad)
        whole = _is_k3(plan)
        pieces = [p for p in pieces if p.kind not in ("tool_args", "tool_whole", "none")]
        if whole:
            pieces += [Piece("none")] * len(args) + [Piece("tool_whole", bad)]
        else:
            pieces += [Piece("tool_args", t) for t in args]
        pieces.append(Piece("none"))  # EOS
    if calls and fault.raw_tool_markup:
        markup = (f"<|tool_calls_section_begin|><|tool_call_begin|>{calls[0]['id']}"
                  f"<|tool_call_argument_begin|>{calls[0]['arguments']}<|tool_call_end|>"
                  "<|tool_calls_section_end|>")
        pieces = [p for p in pieces if p.kind in ("reasoning", "content")] + _as_content(markup)
        pieces.append(Piece("content", ""))  # EOS
        return OutputPlan(pieces, "stop", [])
    if calls and fault.empty_tool_calls:
        pieces = [p for p in pieces if p.kind in ("reasoning", "content")] + [Piece("none")]
        return OutputPlan(pieces, "tool_calls", [])
    return OutputPlan(pieces, finish, calls)


def _is_k3(plan: OutputPlan) -> bool:
    return any(p.kind == "tool_whole" for p in plan.pieces)
