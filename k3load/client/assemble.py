"""Rebuild one answer (reasoning, content, tool calls, finish reason, id, usage) from vLLM chunks.

Why a class of its own: the decoding rules are where servers differ and where bugs hide, so they
are tested here on real captures without any socket. Rules, each from a real wire shape:
- reasoning arrives as `delta.reasoning` (vLLM since early 2026) or the legacy
  `delta.reasoning_content`; when both are present they carry the same text, so `reasoning` wins.
- K2/hermes-style tool calls: a first delta `{index, id, type, function: {name, arguments?}}`, then
  `{index, function: {arguments: piece}}` (vLLM 0.32 adds `"name": null` to those on
  `tool_choice=required`). K3-style: each call whole (name and complete arguments) in one delta.
  Both merge by `index`; arguments are kept as the raw text received (parsing is validation's job).
- vLLM puts the last token's delta in the same chunk as `finish_reason`: deltas are applied first.
- usage comes in the final chunk with `choices: []` (or in every chunk with continuous usage
  stats): the last one seen wins. An in-band error is `{"error": {...}}` (or the older
  `{"object": "error", "message": ...}`).
- What a chunk added is told apart (`add` returns TEXT, TOOL_PART, both or 0): the client keeps the
  arrival of every chunk that carried a tool-call part (an id, a name or argument text), so a call
  held back and sent whole after a silence (vllm#50604) shows as such. A `"tool_calls": []` array,
  an empty `"arguments": ""`, or an id or name repeated (vLLM's `"name": null`) adds nothing.
  `answered` turns true with the first chunk that adds content or a tool-call part (not reasoning):
  the client reads it only until then, to time the first answer token after any thinking.
Shapes that break the protocol raise AssemblyError (a typed error the client reports as malformed),
never a KeyError or TypeError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3load.client.result import StreamResult, ToolCall

# What Assembler.add says a chunk added (bits; 0 for nothing): reasoning or content text, a tool-call part.
TEXT = 1
TOOL_PART = 2


class AssemblyError(ValueError):
    """A chunk or body whose shape is not an OpenAI chat completion (or chunk)."""


@dataclass
class _CallParts:
    index: int
    id: str | None = None
    name: str | None = None
    pieces: list[str] = field(default_factory=list)


class Assembler:
    """Accumulates the chunks of one streamed answer, or takes one non-streamed body."""

    __slots__ = ("_calls", "_content", "_reasoning", "answered", "error", "finish_reason", "response_id", "usage")

    def __init__(self) -> None:
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, _CallParts] = {}
        self.finish_reason: str | None = None
        self.response_id: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None  # the first in-band error object
        self.answered = False  # a chunk added content or a tool-call part (not only reasoning)

    # -- streaming --------------------------------------------------------------------------------
    def add(self, chunk: dict[str, Any]) -> int:
        """Apply one chunk; what it added: TEXT | TOOL_PART bits, 0 for nothing (true: token-bearing)."""
        if "error" in chunk or chunk.get("object") == "error":
            if self.error is None:
                self.error = _error_object(chunk)
            return 0
        if self.response_id is None:
            self.response_id = chunk.get("id")
        usage = chunk.get("usage")
        if usage is not None:
            self.usage = usage
        choices = chunk.get("choices")
        if not choices:
            return 0
        if type(choices) is not list:
            raise AssemblyError(f"choices is {type(choices).__name__}, not a list")
        token = 0
        for choice in choices:
            if type(choice) is not dict or choice.get("index", 0) != 0:
                raise AssemblyError(f"choice {choice!r:.80}: only one choice (n=1, index 0) is assembled")
            delta = choice.get("delta")
            if delta:  # the delta first: it may carry the last token
                token |= self._delta(delta)
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish_reason = reason
        return token

    def _delta(self, delta: dict[str, Any]) -> int:
        token = 0
        text = delta.get("reasoning")
        if text is None:
            text = delta.get("reasoning_content")
        if text:
            self._reasoning.append(_text(text, "reasoning"))
            token = TEXT
        text = delta.get("content")
        if text:
            self._content.append(_text(text, "content"))
            token = TEXT
            self.answered = True
        calls = delta.get("tool_calls")
        if calls:
            if type(calls) is not list:
                raise AssemblyError(f"delta.tool_calls is {type(calls).__name__}, not a list")
            for item in calls:
                if self._tool_delta(item):
                    token |= TOOL_PART
                    self.answered = True
        return token

    def _tool_delta(self, item: Any) -> bool:
        if type(item) is not dict:
            raise AssemblyError(f"tool call delta {item!r:.80} is not an object")
        index = item.get("index")
        if index is None:  # not OpenAI-conformant, but unambiguous: an id opens a call
            index = len(self._calls) if item.get("id") else max(self._calls, default=0)
        elif type(index) is not int:
            raise AssemblyError(f"tool call index {index!r:.40} is not an integer")
        part = self._calls.get(index)
        if part is None:
            part = self._calls[index] = _CallParts(index)
        added = False
        call_id = item.get("id")
        if call_id and part.id is None:
            part.id = _text(call_id, "tool call id")
            added = True
        function = item.get("function") or {}
        name = function.get("name")
        if name:
            if part.name is None:
                part.name = _text(name, "tool call name")
                added = True
            elif name != part.name:
                raise AssemblyError(f"tool call {index} renamed from {part.name!r} to {name!r:.80}")
        arguments = function.get("arguments")
        if arguments:
            part.pieces.append(_text(arguments, "tool call arguments"))
            added = True
        return added

    # -- non-streaming ----------------------------------------------------------------------------
    def add_completion(self, body: Any) -> None:
        """Take a whole `chat.completion` body (the non-streaming answer)."""
        if type(body) is not dict:
            raise AssemblyError(f"response body is {type(body).__name__}, not a JSON object")
        if "error" in body or body.get("object") == "error":
            self.error = _error_object(body)
            return
        self.response_id = body.get("id")
        self.usage = body.get("usage")
        choices = body.get("choices")
        if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
            raise AssemblyError(f"choices {choices!r:.80}: exactly one choice expected")
        choice = choices[0]
        message = choice.get("message")
        if type(message) is not dict:
            raise AssemblyError(f"choices[0].message is {type(message).__name__}, not an object")
        self.finish_reason = choice.get("finish_reason")
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning:
            self._reasoning.append(_text(reasoning, "reasoning"))
        if message.get("content"):
            self._content.append(_text(message["content"], "content"))
        for position, call in enumerate(message.get("tool_calls") or []):
            self._whole_call(position, call)

    def _whole_call(self, position: int, call: Any) -> None:
        if type(call) is not dict or type(call.get("function")) is not dict:
            raise AssemblyError(f"message.tool_calls[{position}] {call!r:.80} has no function object")
        function = call["function"]
        part = self._calls[position] = _CallParts(position, call.get("id"), function.get("name"))
        arguments = function.get("arguments")
        if arguments:
            part.pieces.append(_text(arguments, "tool call arguments"))

    # -- output -----------------------------------------------------------------------------------
    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        return "".join(self._content)

    def text_chars(self) -> int:
        """Characters of text held so far (reasoning, content, tool arguments): what the body cap
        bounds in a stream. Sums every piece, so the client calls it rarely."""
        pieces = (*self._reasoning, *self._content, *(p for c in self._calls.values() for p in c.pieces))
        return sum(map(len, pieces))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(p.index, p.id, p.name, "".join(p.pieces)) for _, p in sorted(self._calls.items())]

    def fill(self, result: StreamResult) -> None:
        """Copy what was assembled into the attempt's result (whatever its status)."""
        result.reasoning = self.reasoning
        result.content = self.content
        result.tool_calls = self.tool_calls
        result.finish_reason = self.finish_reason
        result.response_id = self.response_id
        result.usage = self.usage


def error_message(error: dict[str, Any]) -> str:
    """One line out of an OpenAI/vLLM error object: 'Type (code): message'."""
    message = str(error.get("message", "")).replace("\n", " ").strip()
    kind = error.get("type") or "error"
    code = error.get("code")
    return f"{kind} ({code}): {message}" if code is not None else f"{kind}: {message}"


def _error_object(chunk: dict[str, Any]) -> dict[str, Any]:
    error = chunk.get("error", chunk)
    return error if type(error) is dict else {"message": str(error)}


def _text(value: Any, what: str) -> str:
    if type(value) is not str:
        raise AssemblyError(f"{what} is {type(value).__name__} {value!r:.80}, not a string")
    return value
