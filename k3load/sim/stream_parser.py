"""Kimi's streamed-only tool-call failures: what vLLM's streaming tool parser sends for the same tokens.

Why apart from faults.py: vLLM parses `stream: true` answers with an incremental, stateful parser and
`stream: false` answers in one pass over the whole text; these bugs live in the incremental one. The
model generated the same tokens either way, so every rewrite here keeps one piece per token (usage,
timing and chunk count stay the twin's) and changes only what the parser sends for them:
- vllm#54701 (`stream_empty_tool_calls`): under load every tool-call delta is `"tool_calls": []`;
- vllm#50604 (`tool_args_burst`): arguments do not stream, each call arrives whole in one delta
  (K2 style too), after a silence the server adds before the first tool-call delta;
- vllm#24478 (`parallel_call_*`): of several calls, the last is lost, the second's arguments are
  glued to the first's under its index, or one call is sent again under a new index with its id.
When several hit one answer they apply in this order: drop, merge, duplicate, burst, empty.
"""

from __future__ import annotations

from typing import Any

from k3load.sim.faults import FaultDecision
from k3load.sim.generate import OutputPlan, Piece

Calls = list[dict[str, Any]]
TOOL_DELTA_KINDS = ("tool_header", "tool_args", "tool_whole", "tool_empty")


def apply_streaming(plan: OutputPlan, fault: FaultDecision, crowded: bool) -> OutputPlan:
    """The plan's pieces as the streaming parser emits them; `crowded`: the engine held at least
    `stream_empty_tool_calls_min_running` requests when this one arrived."""
    pieces, calls = list(plan.pieces), [dict(c) for c in plan.tool_calls]
    body = len(pieces) - (plan.finish_reason != "length")  # the last piece is EOS unless cut
    if fault.parallel_call_drop and len(_started(pieces)) >= 2:
        last = max(_started(pieces))
        pieces = [Piece("none") if _of_call(p, last, i, body) else p for i, p in enumerate(pieces)]
        calls = calls[:last]
    if fault.parallel_call_merge and len(_started(pieces)) >= 2:
        pieces, calls = _merge_second_into_first(pieces, calls, body)
    if fault.parallel_call_duplicate and _started(pieces) and body < len(pieces):
        pieces, calls = _duplicate_last(pieces, calls)
    if fault.tool_args_burst_s:
        pieces = _whole_calls(pieces, body)
    if fault.stream_empty_tool_calls and crowded:
        pieces = [Piece("tool_empty") if p.kind in TOOL_DELTA_KINDS else p for p in pieces]
    return OutputPlan(pieces, plan.finish_reason, calls)


def _started(pieces: list[Piece]) -> list[int]:
    """Indexes of the calls whose first delta (header or whole call) is among the pieces, in order."""
    return sorted({p.tool_index for p in pieces if p.kind in ("tool_header", "tool_whole")})


def _of_call(piece: Piece, index: int, position: int, body: int) -> bool:
    return position < body and piece.kind in TOOL_DELTA_KINDS and piece.tool_index == index


def _streamed_text(pieces: list[Piece], index: int) -> str:
    return "".join(p.text for p in pieces if p.kind in ("tool_args", "tool_whole") and p.tool_index == index)


def _merge_second_into_first(pieces: list[Piece], calls: Calls, body: int) -> tuple[list[Piece], Calls]:
    """The second call's header is lost; its argument text follows the first's under index 0, later
    calls move down one index. No delta ever names a call twice (a rename breaks any client)."""
    first, second = _started(pieces)[:2]
    out = []
    for i, p in enumerate(pieces):
        if _of_call(p, second, i, body):
            p = Piece("tool_args", p.text, first) if p.text else Piece("none")
        elif i < body and p.kind in TOOL_DELTA_KINDS and p.tool_index > second:
            p = Piece(p.kind, p.text, p.tool_index - 1)
        out.append(p)
    merged = {**calls[first], "arguments": calls[first]["arguments"] + calls[second]["arguments"]}
    return out, [*calls[:first], merged, *calls[second + 1:]]


def _duplicate_last(pieces: list[Piece], calls: Calls) -> tuple[list[Piece], Calls]:
    """The last call begun is sent again, whole, with its id under the next index, on the final
    token (a parser flushing a call it had already emitted when the section closes)."""
    again = _started(pieces)[-1]
    new = again + 1
    text = _streamed_text(pieces, again)
    return [*pieces[:-1], Piece("tool_whole", text, new)], [*calls[:new], dict(calls[again])]


def _whole_calls(pieces: list[Piece], body: int) -> list[Piece]:
    """K2 style as K3 streams it: nothing while a call is written, then the call whole in one delta
    on its last token (K3 already streams this way)."""
    out = list(pieces)
    for index in _started(pieces):
        positions = [i for i, p in enumerate(pieces) if _of_call(p, index, i, body)]
        if any(pieces[i].kind == "tool_whole" for i in positions):
            continue
        text = _streamed_text(pieces, index)
        for i in positions:
            out[i] = Piece("none")
        out[positions[-1]] = Piece("tool_whole", text, index)
    return out
