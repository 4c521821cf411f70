"""What the sim 'model' answers: an output plan of token pieces for one chat request.

Why a plan: the engine only needs one piece per decode step, while the server needs to know what
each piece means on the wire (reasoning, content, a tool-call header, argument text). Deciding the
whole answer up front from a seeded RNG makes every answer reproducible for identical requests.
The 'intent' rule for tool_choice=auto is lexical on purpose: scenario authors can write a turn
that must call a tool (it names the tool's words) and a turn that must not (it does not).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from k3load.sim.schema_instance import instance
from k3load.sim.tokenizer import tokenize

_ANSWER_WORDS = (
    "the result shows that everything is within the expected range and the next step is to confirm "
    "with the owner before we continue with the plan as agreed earlier today"
).split()


@dataclass
class Piece:
    """One generated token and what it adds to the response ('none' adds nothing visible yet)."""

    kind: str  # "reasoning" | "content" | "tool_header" | "tool_args" | "tool_whole" | "none"
    text: str = ""
    tool_index: int = 0


@dataclass
class OutputPlan:
    pieces: list[Piece]
    finish_reason: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # id, name, arguments (string)

    @property
    def reasoning_token_count(self) -> int:
        return sum(1 for p in self.pieces if p.kind == "reasoning")


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_ANSWER_WORDS) for _ in range(count))


def _pieces(kind: str, text: str, tool_index: int = 0) -> list[Piece]:
    return [Piece(kind, t, tool_index) for t in tokenize(text)]


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content)
    return ""


def _tool_words(tool: dict[str, Any]) -> set[str]:
    fn = tool.get("function", {})
    text = fn.get("name", "").replace("_", " ").replace(".", " ") + " " + fn.get("description", "")
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3}


def choose_tool(request: dict[str, Any]) -> dict[str, Any] | None:
    """The tool this request calls, or None for a plain answer."""
    tools = request.get("tools") or []
    choice = request.get("tool_choice", "auto" if tools else "none")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name")
        return next(t for t in tools if t.get("function", {}).get("name") == name)
    messages = request.get("messages") or []
    if choice == "auto" and messages and messages[-1].get("role") == "tool":
        return None  # a tool result came back: answer it
    words = set(re.findall(r"[a-z]+", _last_user_text(messages).lower()))
    scored = [(len(words & _tool_words(t)), i) for i, t in enumerate(tools)]
    best, index = max(scored, key=lambda s: (s[0], -s[1]))
    if best == 0 and choice == "auto":
        return None
    return tools[index]


def kimi_call_id(name: str, messages: list[dict[str, Any]]) -> str:
    """`functions.NAME:IDX`, IDX continuing the count of calls already in the history (Kimi form)."""
    previous = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
    return f"functions.{name}:{previous}"


def _answer_text(request: dict[str, Any], rng: random.Random, length: int) -> str:
    fmt = request.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") or {}
        return json.dumps(instance(schema, rng), separators=(",", ":"))
    if fmt.get("type") == "json_object":
        return json.dumps({"answer": _words(rng, 4)}, separators=(",", ":"))
    messages = request.get("messages") or []
    if messages and messages[-1].get("role") == "tool":
        return "Based on the tool result, " + _words(rng, length)
    return _words(rng, length).capitalize() + "."


def plan_output(request: dict[str, Any], rng: random.Random, reasoning_tokens: int, answer_len: int,
                tool_call_style: str) -> OutputPlan:
    """The full answer before any max_tokens cut: reasoning, then a tool call or an answer."""
    pieces: list[Piece] = []
    if reasoning_tokens:
        pieces += _pieces("reasoning", "Let me think. " + _words(rng, max(reasoning_tokens - 3, 1)))
    tool = choose_tool(request)
    if tool is None:
        pieces += [*_pieces("content", _answer_text(request, rng, answer_len)), Piece("content", "")]  # EOS
        return OutputPlan(pieces, "stop")
    fn = tool["function"]
    arguments = json.dumps(instance(fn.get("parameters") or {}, rng), separators=(",", ":"))
    call = {"id": kimi_call_id(fn["name"], request.get("messages") or []), "name": fn["name"],
            "arguments": arguments}
    arg_pieces = _pieces("tool_args", arguments)
    if tool_call_style == "k3":  # the parser emits the call whole once its close marker arrives
        pieces += [Piece("none")] * (len(arg_pieces) + 1) + [Piece("tool_whole", arguments)]
    else:
        pieces += [Piece("tool_header"), *arg_pieces]
    named = isinstance(request.get("tool_choice"), dict)  # vLLM finishes a named call with "stop"
    pieces.append(Piece("tool_args", "") if named else Piece("none"))  # EOS: adds nothing to the call
    return OutputPlan(pieces, "stop" if named else "tool_calls", [call])


def truncate(plan: OutputPlan, max_tokens: int, ignore_eos: bool, rng: random.Random) -> OutputPlan:
    """Apply max_tokens (finish 'length') or, with ignore_eos, pad the answer up to it."""
    pieces = plan.pieces
    if ignore_eos and len(pieces) < max_tokens and plan.finish_reason == "stop" and not plan.tool_calls:
        pieces = pieces[:-1] + _pieces("content", " " + _words(rng, max_tokens))  # past EOS
        pieces += [Piece("content", " more")] * (max_tokens - len(pieces))
        return OutputPlan(pieces[:max_tokens], "length", plan.tool_calls)
    if len(pieces) <= max_tokens:
        return plan
    kept = pieces[:max_tokens]
    calls = plan.tool_calls if any(p.kind == "tool_whole" for p in kept) else []
    return OutputPlan(kept, "length", calls)
