"""What an imported turn is judged on, from the answer the agent recorded; and the tools' recorded results.

Why from the recorded answer: the log says what the deployment answered in production. A turn whose
answer called tools is expected to call one of those tools (each of them, when it called several at
once); one that answered with text, to answer (as JSON of the requested format when it asked for one).
Where the log has no answer for a turn, the next request of the conversation usually sent it back (the
assistant message an agent appends), and that is the recorded answer. A turn with neither is judged on
validity alone (`expect: {kind: any}`) and its scenario lists it (`source.turns_without_answer`).

The recorded results (`executors`) are what `history: model` answers the model's own calls with: each
logged tool message, matched to its call by `tool_call_id`, becomes a table row (the call's arguments ->
the result as logged); a call the log never answered has no row, and a tool's `default` is its first
recorded result.
"""

from __future__ import annotations

from typing import Any

from k3load.workload import logged, strict_json


def recorded_answer(answer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The `recorded` block of a turn from an assistant message (None: no answer)."""
    if not isinstance(answer, dict) or answer.get("role", "assistant") != "assistant":
        return None
    out: dict[str, Any] = {"content": _text(answer.get("content"))}
    reasoning = answer.get("reasoning_content", answer.get("reasoning"))
    if isinstance(reasoning, str):
        out["reasoning"] = reasoning
    calls = [_call(c) for c in answer.get("tool_calls") or [] if isinstance(c, dict)]
    calls = [c for c in calls if c is not None]
    if calls:
        out["tool_calls"] = calls
    return out


def _text(content: Any) -> str | None:
    """A message's content as text: a string, or the text parts of a content list joined."""
    if isinstance(content, str) or content is None:
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return None


def _call(call: dict[str, Any]) -> dict[str, Any] | None:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        parsed = strict_json.loads_or_none(arguments)
        arguments = parsed if parsed is not None else arguments
    out: dict[str, Any] = {"name": function["name"], "arguments": arguments}
    if isinstance(call.get("id"), str):
        out = {"id": call["id"], **out}
    return out


def expectation(recorded: dict[str, Any] | None, request: dict[str, Any]) -> dict[str, Any]:
    """The turn's `expect` from its recorded answer and its body."""
    if recorded is None:
        return {"kind": "any"}
    offered = {logged.tool_name(t) for t in logged.request_tools(request)}
    calls = [c["name"] for c in recorded.get("tool_calls", [])]
    if calls:
        if not set(calls) <= offered:
            return {"kind": "any"}  # it called a tool this request did not offer: nothing to hold a replay to
        expect: dict[str, Any] = {"kind": "tool_call", "tools": sorted(set(calls))}
        return expect | ({"calls": sorted(calls)} if len(calls) > 1 else {})
    response_format = request.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object"):
        return {"kind": "json"}
    if recorded.get("content"):
        return {"kind": "answer"}
    return {"kind": "any"}


def executors(turns_added: list[list[dict[str, Any]]], recorded: list[dict[str, Any] | None],
              offered: set[str]) -> dict[str, Any]:
    """Tool name -> {table: [{match, result}], default} from the conversation's logged tool results."""
    calls: dict[str, tuple[str, Any]] = {}
    for answer in recorded:
        for call in (answer or {}).get("tool_calls", []):
            if "id" in call:
                calls[call["id"]] = (call["name"], call["arguments"])
    out: dict[str, Any] = {}
    for messages in turns_added:
        for message in messages:
            if message.get("role") == "assistant":
                for call in (recorded_answer(message) or {}).get("tool_calls", []):
                    if "id" in call:
                        calls[call["id"]] = (call["name"], call["arguments"])
            elif message.get("role") == "tool" and message.get("tool_call_id") in calls:
                name, arguments = calls[message["tool_call_id"]]
                if name not in offered:
                    continue
                result = message.get("content")
                executor = out.setdefault(name, {"table": [], "default": result})
                if isinstance(arguments, dict) and not any(r["match"] == arguments for r in executor["table"]):
                    executor["table"].append({"match": arguments, "result": result})
    return {name: ({"default": e["default"]} | ({"table": e["table"]} if e["table"] else {}))
            for name, e in out.items()}
