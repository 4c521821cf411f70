"""Logged lines -> chat requests with their recorded answers, whatever form the log took.

    exchanges, problems = read_exchanges([Path("batch_in.jsonl"), Path("batch_out.jsonl")])

The forms an operator's log comes in (one JSON object per line, any of them in any file):
- a Chat Completions request body as the agent sent it (`messages`, ...): no recorded answer;
- `{"request": BODY, "response": ANSWER}`: the body with the answer the agent got (`response` may be
  absent or null);
- the OpenAI Batch input format (`custom_id`, `method`, `url`, `body`), joined by `custom_id` with the
  Batch output file's lines (`custom_id`, `response: {status_code, body}`, `error`), in any file given.

An answer is read from a `chat.completion` object (`choices[0].message`), or from a streamed answer as a
logging proxy keeps it: the list of its `chat.completion.chunk` objects, or its raw SSE text (`data: {...}`
lines up to `data: [DONE]`), the deltas joined (content, reasoning, each call's id, name and argument text
by its index); a refused or failed answer (a Batch error, a status other than 200) is no answer. A line that
is none of these forms, or whose body is not a chat request (no `messages` list of objects with a `role`, a
Batch `url` other than /v1/chat/completions, a `method` other than POST), is a `Problem` naming `file:line`;
so is a Batch output line whose `custom_id` no input line has, and a `custom_id` given twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3load.traffic.log_lines import read_log
from k3load.workload import strict_json

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")


@dataclass(frozen=True)
class Problem:
    where: str  # "file:line"
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass
class Exchange:
    """One logged chat request and, where the log has it, the answer it got."""

    where: str
    body: dict[str, Any]
    answer: dict[str, Any] | None = None  # the answer's message: content, tool_calls, reasoning_content


def chat_problem(body: Any) -> str | None:
    """Why `body` is not a Chat Completions request (None: it is one)."""
    if not isinstance(body, dict):
        return "not a chat request (not a JSON object)"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "not a chat request (no `messages` list)"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"not a chat request (messages[{i}] has no `role`)"
    if "model" in body and not isinstance(body["model"], str):
        return "not a chat request (`model` is not a string)"
    return None


def answer_of(response: Any) -> dict[str, Any] | None:
    """The assistant message of a recorded `chat.completion`, or of a streamed one's chunks or SSE text (None:
    no usable answer)."""
    if isinstance(response, str):
        response = _sse_chunks(response)
    if isinstance(response, list):
        return _joined(response)
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    return message if isinstance(message, dict) else None


def _sse_chunks(text: str) -> list[Any] | None:
    """The JSON chunks of raw SSE text (`data: ...` lines; `[DONE]` ends it); None when it holds none."""
    chunks: list[Any] = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunks.append(strict_json.loads_or_none(data))
    return chunks or None


def _joined(chunks: list[Any]) -> dict[str, Any] | None:
    """A streamed answer's deltas joined into the message it made (None: no chunk carried a choice)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    seen = False
    for chunk in chunks:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        delta = choices[0].get("delta") if isinstance(choices, list) and choices and \
            isinstance(choices[0], dict) else None
        if not isinstance(delta, dict):
            continue
        seen = True
        for parts, key in ((content, "content"), (reasoning, "reasoning_content"), (reasoning, "reasoning")):
            if isinstance(delta.get(key), str):
                parts.append(delta[key])
        deltas = delta.get("tool_calls")
        for call in deltas if isinstance(deltas, list) else []:
            if isinstance(call, dict) and isinstance(call.get("index", 0), int):
                _add_call_delta(calls.setdefault(call.get("index", 0), {"function": {"arguments": ""}}), call)
    if not seen:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if content else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [{"type": "function", **calls[i]} for i in sorted(calls)]
    return message


def _add_call_delta(call: dict[str, Any], delta: dict[str, Any]) -> None:
    if isinstance(delta.get("id"), str):
        call["id"] = delta["id"]
    function = delta.get("function")
    if isinstance(function, dict):
        if isinstance(function.get("name"), str):
            call["function"]["name"] = function["name"]
        if isinstance(function.get("arguments"), str):
            call["function"]["arguments"] += function["arguments"]


def _batch_answer(data: dict[str, Any]) -> dict[str, Any] | None:
    response = data.get("response")
    if data.get("error") or not isinstance(response, dict):
        return None
    if response.get("status_code", 200) != 200:
        return None
    return answer_of(response.get("body"))


def _classify(where: str, data: Any) -> tuple[str, Any]:
    """("request", Exchange) | ("batch_in", (custom_id, Exchange)) | ("batch_out", (custom_id, answer)) |
    ("problem", Problem)."""
    if not isinstance(data, dict):
        return "problem", Problem(where, "not a chat request (not a JSON object)")
    if "custom_id" in data:
        custom_id = data["custom_id"]
        if not isinstance(custom_id, str):
            return "problem", Problem(where, "Batch line whose `custom_id` is not a string")
        if "body" in data:
            if str(data.get("method", "POST")).upper() != "POST" or data.get("url") not in CHAT_PATHS:
                return "problem", Problem(where, f"not a chat request (Batch {data.get('method')} "
                                                 f"{str(data.get('url'))[:80]})")
            problem = chat_problem(data["body"])
            return ("problem", Problem(where, problem)) if problem else \
                ("batch_in", (custom_id, Exchange(where, data["body"])))
        if "response" in data or "error" in data:
            return "batch_out", (custom_id, _batch_answer(data))
        return "problem", Problem(where, "Batch line with neither `body` nor `response`")
    if "request" in data:
        problem = chat_problem(data["request"])
        if problem:
            return "problem", Problem(where, problem)
        return "request", Exchange(where, data["request"], answer_of(data.get("response")))
    problem = chat_problem(data)
    return ("problem", Problem(where, problem)) if problem else ("request", Exchange(where, data))


def read_exchanges(paths: Iterable[Path], max_line_bytes: int | None = None) -> tuple[list[Exchange], list[Problem]]:
    """Every usable exchange in file and line order (a Batch input line where it stands, its answer joined
    from whichever file holds it), and every line that could not be used."""
    exchanges: list[Exchange] = []
    problems: list[Problem] = []
    batch: dict[str, Exchange] = {}
    answers: dict[str, tuple[str, dict[str, Any] | None]] = {}
    for path in paths:
        lines = read_log(path) if max_line_bytes is None else read_log(path, max_line_bytes)
        for line in lines:
            if line.problem is not None:
                problems.append(Problem(line.where, line.problem))
                continue
            kind, item = _classify(line.where, line.data)
            if kind == "problem":
                problems.append(item)
            elif kind == "request":
                exchanges.append(item)
            elif kind == "batch_in":
                custom_id, exchange = item
                if custom_id in batch:
                    problems.append(Problem(line.where, f"Batch custom_id {custom_id!r} already at "
                                                        f"{batch[custom_id].where}"))
                    continue
                batch[custom_id] = exchange
                exchanges.append(exchange)
            else:
                custom_id, answer = item
                if custom_id in answers:
                    problems.append(Problem(line.where, f"Batch output custom_id {custom_id!r} already at "
                                                        f"{answers[custom_id][0]}"))
                    continue
                answers[custom_id] = (line.where, answer)
    for custom_id, (where, answer) in answers.items():
        if custom_id not in batch:
            problems.append(Problem(where, f"Batch output for custom_id {custom_id!r}, which no input line has"))
        else:
            batch[custom_id].answer = answer
    return exchanges, problems
