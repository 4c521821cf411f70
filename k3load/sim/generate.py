"""What the sim 'model' answers: an output plan of token pieces for one chat request.

Why a plan: the engine only needs one piece per decode step, while the server needs to know what
each piece means on the wire (reasoning, content, a tool-call header, argument text). Deciding the
whole answer up front from a seeded RNG makes every answer reproducible for identical requests.
The 'intent' rule for tool_choice=auto is lexical on purpose: scenario authors can write a turn
that must call a tool (it names the tool's words) and a turn that must not (it does not). With
`parallel_tool_calls: true` the same rule runs per clause (`choose_tools`), so a turn can ask for
several calls in one answer by naming them in one sentence.
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

    kind: str  # "reasoning" | "content" | "tool_header" | "tool_args" | "tool_whole" | "tool_empty" | "none"
    text: str = ""
    tool_index: int = 0


@dataclass
class OutputPlan:
    pieces: list[Piece]
    finish_reason: str
    # id, name, arguments (string) and parameters (the tool's schema, which the wire never shows)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

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
    best, index = _best_tool(words, tools)
    if best == 0 and choice == "auto":
        return None
    return tools[index]


_CLAUSE_RE = re.compile(r"\b(and|also)\b|(;)|[?.]")
MAX_PARALLEL_CALLS = 8


def _best_tool(words: set[str], tools: list[dict[str, Any]]) -> tuple[int, int]:
    """(score, index) of the tool sharing most words with `words`; ties go to the earlier tool."""
    scored = [(len(words & _tool_words(t)), i) for i, t in enumerate(tools)]
    return max(scored, key=lambda s: (s[0], -s[1]))


def _clauses(text: str) -> list[tuple[str, bool]]:
    """(clause, joined) pairs: `joined` when a list joint (and, also, ';') precedes the clause rather
    than a sentence end ('?', '.') or the start of the text."""
    out: list[tuple[str, bool]] = []
    joined, start = False, 0
    for match in _CLAUSE_RE.finditer(text):
        out.append((text[start:match.start()], joined))
        joined = match.group(1) is not None or match.group(2) is not None
        start = match.end()
    out.append((text[start:], joined))
    return out


def choose_tools(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The tools this request calls, in order (one entry per call; empty for a plain answer).

    One call, by `choose_tool`, unless the body says `"parallel_tool_calls": true` and tool_choice
    is auto or required (absent or false keeps one call; a named tool is always one call). Then the
    rule is lexical, like choose_tool's, applied to the last user message cut into clauses at "and",
    "also", ";", "?" and ".": a clause whose words score > 0 for some tool calls its best tool (the
    same word scoring as choose_tool); a clause with no tool words that is joined by "and", "also"
    or ";" to a clause that made a call repeats that call's tool ("weather for Boston, MA and also
    for San Francisco": two weather calls), while one after "?" or "." does not (a trailing "Thanks."
    is not a call). Clauses without letters are skipped. At most MAX_PARALLEL_CALLS; no call at all
    falls back to choose_tool.
    """
    choice = request.get("tool_choice", "auto" if request.get("tools") else "none")
    single = choose_tool(request)
    if request.get("parallel_tool_calls") is not True or choice not in ("auto", "required") or single is None:
        return [single] if single is not None else []
    tools = request.get("tools") or []
    calls: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for clause, joined in _clauses(_last_user_text(request.get("messages") or []).lower()):
        words = set(re.findall(r"[a-z]+", clause))
        if not words:
            continue
        score, index = _best_tool(words, tools)
        previous = tools[index] if score > 0 else previous if joined else None
        if previous is not None:
            calls.append(previous)
    return calls[:MAX_PARALLEL_CALLS] or [single]


def kimi_call_id(name: str, messages: list[dict[str, Any]], position: int = 0) -> str:
    """`functions.NAME:IDX`, IDX continuing the count of calls already in the history (Kimi form);
    `position` is the call's place among the calls of this answer."""
    previous = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
    return f"functions.{name}:{previous + position}"


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


def call_pieces(index: int, arguments: str, tool_call_style: str) -> list[Piece]:
    """The tokens of one call. K3: the parser holds the call (one silent token per argument token and
    one for its open marker) and emits it whole; K2: a header delta, then the argument pieces."""
    args = _pieces("tool_args", arguments, index)
    if tool_call_style == "k3":
        return [Piece("none", "", index)] * (len(args) + 1) + [Piece("tool_whole", arguments, index)]
    return [Piece("tool_header", "", index), *args]


def plan_output(request: dict[str, Any], rng: random.Random, reasoning_tokens: int, answer_len: int,
                tool_call_style: str) -> OutputPlan:
    """The full answer before any max_tokens cut: reasoning, then tool call(s) or an answer."""
    pieces: list[Piece] = []
    if reasoning_tokens:
        pieces += _pieces("reasoning", "Let me think. " + _words(rng, max(reasoning_tokens - 3, 1)))
    tools = choose_tools(request)
    if not tools:
        pieces += [*_pieces("content", _answer_text(request, rng, answer_len)), Piece("content", "")]  # EOS
        return OutputPlan(pieces, "stop")
    messages = request.get("messages") or []
    calls = []
    for position, tool in enumerate(tools):
        fn = tool["function"]
        arguments = json.dumps(instance(fn.get("parameters") or {}, rng), separators=(",", ":"))
        calls.append({"id": kimi_call_id(fn["name"], messages, position), "name": fn["name"],
                      "arguments": arguments, "parameters": fn.get("parameters") or {}})  # the schema: vary_arguments
        pieces += call_pieces(position, arguments, tool_call_style)
    named = isinstance(request.get("tool_choice"), dict)  # vLLM finishes a named call with "stop"
    pieces.append(Piece("tool_args", "") if named else Piece("none"))  # EOS: adds nothing to the call
    return OutputPlan(pieces, "stop" if named else "tool_calls", calls)


def vary_arguments(arguments: str, parameters: dict[str, Any], rng: random.Random, tries: int = 5) -> str | None:
    """The arguments with one value decoded otherwise: a near-tie token taken the other way, as a batch of
    another size can make a greedy decode do (`faults.batch_dependent`). The value is another instance of
    the same property's schema, so the answer stays valid; None when no property can differ (an enum of one,
    no properties, arguments that are not a JSON object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(value, dict) or not isinstance(properties, dict):
        return None
    keys = [k for k in value if isinstance(properties.get(k), dict)]
    rng.shuffle(keys)
    for key in keys:
        for _ in range(tries):
            other = instance(properties[key], rng)
            if other != value[key]:
                return json.dumps({**value, key: other}, separators=(",", ":"))
    return None


def truncate(plan: OutputPlan, max_tokens: int, ignore_eos: bool, rng: random.Random,
             min_tokens: int = 0) -> OutputPlan:
    """Apply max_tokens (finish 'length') or, with ignore_eos, pad the answer up to it. `min_tokens`: a plain
    answer shorter than it goes on past its EOS until it is that long, then ends (vLLM's SamplingParams.min_tokens:
    EOS and stop tokens are suppressed until then), so min_tokens = max_tokens gives exactly that many tokens,
    finish 'length'."""
    pieces = plan.pieces
    if min_tokens > len(pieces) - 1 and plan.finish_reason == "stop" and not plan.tool_calls:
        extra = _pieces("content", " " + _words(rng, min_tokens))[: min_tokens - len(pieces) + 1]
        pieces = [*pieces[:-1], *extra, pieces[-1]]  # the EOS moved to after min_tokens tokens
        plan = OutputPlan(pieces, plan.finish_reason, plan.tool_calls)
    if ignore_eos and len(pieces) < max_tokens and plan.finish_reason == "stop" and not plan.tool_calls:
        pieces = pieces[:-1] + _pieces("content", " " + _words(rng, max_tokens))  # past EOS
        pieces += [Piece("content", " more")] * (max_tokens - len(pieces))
        return OutputPlan(pieces[:max_tokens], "length", plan.tool_calls)
    if len(pieces) <= max_tokens:
        return plan
    kept = pieces[:max_tokens]
    started = {p.tool_index for p in kept if p.kind in ("tool_header", "tool_whole")}
    return OutputPlan(kept, "length", plan.tool_calls[: len(started)])  # the calls begun before the cut
