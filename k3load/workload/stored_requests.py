"""Scenario turns -> exact request bytes, stored with their sha256, keys in the order declared.

Why exact bytes: a run must be able to prove it sent what the last run sent, and a warm request must
be shown to share the cold one's prefix byte for byte. The history of a conversation is built from the
scenario's scripted replies and deterministic tool results, never from what the server answered, so
every request of every run is known before the run starts.

Why the declared key order and never sorted keys: a chat template renders a tool's properties, a
response schema and every message in the order the body gives them, so key order is part of the
prompt (a provider that reorders keys is a known defect class; MiniMax's provider verifier checks it).
A body keeps the order its scenario gives, all the way down (tools, function, parameters, properties,
response_format schemas, messages, a replayed call's arguments); only whitespace is normalised.
`request_sha256` is over the body's bytes as sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3load.private_files import open_private
from k3load.workload import logged
from k3load.workload.scenario import Scenario, Turn, execute_tool

STORED_REQUEST_SALT = "SAMPLE"


def compact(obj: Any) -> bytes:
    """JSON as sent: keys in the order given, no whitespace, UTF-8 (not ASCII-escaped)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class PreparedRequest:
    scenario: str
    turn: int
    body: bytes
    sha256: str
    prefix_sha256: str  # system prompt (salted) + tools + fixed context, as sent


def _system(scenario: Scenario, salt: str) -> str:
    if scenario.prefix_salt == "none":
        return scenario.system_prompt
    return f"[session {salt}]\n{scenario.system_prompt}"


def _tools(scenario: Scenario, salt: str) -> list[dict[str, Any]]:
    """The tool definitions as sent. Kimi's chat template renders tool declarations before the system
    prompt, so a control pair's cold request would still hit the previous pair's tool head: for
    `pair` the salt also opens the first tool's description (where the scenario declares it, else
    right after the name: the order stays the declared one), making the whole prefix after the first
    tool's name new to the cache while the warm twin, same salt, repeats it byte for byte. `request`
    (the cold family) is salted there too: with the salt only in the system prompt, every cold request
    shared the whole tool head with every other (23% of its prompt reused, issue 15)."""
    tools = [dict(t) for t in scenario.tools]
    if scenario.prefix_salt in ("pair", "request") and tools:
        declared = tools[0]["function"]
        salted = f"[session {salt}] {declared.get('description', '')}".rstrip()
        function: dict[str, Any] = {}
        for key, value in declared.items():
            function[key] = salted if key == "description" else value
            if key == "name" and "description" not in declared:
                function["description"] = salted
        tools[0] = {**tools[0], "function": function}
    return tools


def replay_turn(scenario: Scenario, turn: Turn, messages: list[dict[str, Any]]) -> None:
    """Append what a finished turn leaves in the history: its user message, scripted reply, tool results."""
    if turn.user is not None:
        messages.append({"role": "user", "content": turn.user})
    reply = turn.reply or {}
    calls = reply.get("tool_calls") or []
    if not calls:
        if "content" in reply:
            messages.append({"role": "assistant", "content": reply["content"]})
        return
    done = sum(len(m.get("tool_calls") or []) for m in messages if m["role"] == "assistant")
    wire_calls = [{"id": f"functions.{c['name']}:{done + i}", "type": "function",
                   "function": {"name": c["name"], "arguments": compact(c["arguments"]).decode()}}
                  for i, c in enumerate(calls)]
    messages.append({"role": "assistant", "content": reply.get("content"), "tool_calls": wire_calls})
    for call, wire in zip(calls, wire_calls, strict=True):
        messages.append({"role": "tool", "tool_call_id": wire["id"],
                         "content": execute_tool(scenario, call["name"], call["arguments"])})


def fixed_messages(scenario: Scenario, salt: str, long_context: str | None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": _system(scenario, salt)}]
    messages += [dict(m) for m in scenario.context]
    if long_context:
        messages.append({"role": "user", "content": "Reference document for this session:\n\n" + long_context})
        messages.append({"role": "assistant", "content": "Understood. I will follow the reference document."})
    return messages


def build_request(scenario: Scenario, turn_index: int, model: str, salt: str = STORED_REQUEST_SALT,
                  long_context: str | None = None) -> PreparedRequest:
    """The exact bytes of one turn's request."""
    if scenario.is_logged:
        turn = scenario.turns[turn_index]
        return prepared_with_history(scenario, turn, model, logged.history_through(scenario.turns, turn_index), salt)
    fixed = fixed_messages(scenario, salt, long_context)
    messages = [dict(m) for m in fixed]
    if scenario.mode == "conversation":
        for earlier in scenario.turns[:turn_index]:
            replay_turn(scenario, earlier, messages)
    turn = scenario.turns[turn_index]
    if turn.user is not None:
        messages.append({"role": "user", "content": turn.user})
    tools = _tools(scenario, salt)
    body = _body(scenario, turn, model, messages, tools)
    prefix = compact({"messages": fixed, "tools": tools})  # each part's bytes as in the body
    data = compact(body)
    return PreparedRequest(scenario.name, turn_index, data, sha256(data), sha256(prefix))


def prepared_with_history(scenario: Scenario, turn: Turn, model: str, messages: list[dict[str, Any]], salt: str,
                          long_context: str | None = None) -> PreparedRequest:
    """One turn's bytes with `messages` as its whole history: a logged turn's body as logged around them
    (k3load.workload.logged), else the scripted body. `history: model` builds `messages` from what the
    model answered (k3load.workload.model_history); `build_request` from the script."""
    if scenario.is_logged:
        body = logged.body_with(turn.request or {"messages": None}, model, messages)
        prefix = compact({"messages": logged.leading_system(messages), "tools": logged.request_tools(turn.request)})
    else:
        tools = _tools(scenario, salt)
        body = _body(scenario, turn, model, messages, tools)
        prefix = compact({"messages": fixed_messages(scenario, salt, long_context), "tools": tools})
    data = compact(body)
    return PreparedRequest(scenario.name, turn.index, data, sha256(data), sha256(prefix))


def _body(scenario: Scenario, turn: Turn, model: str, messages: list[dict[str, Any]],
          tools: list[dict[str, Any]]) -> dict[str, Any]:
    s = turn.settings
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": s["max_tokens"],
                            "temperature": s["temperature"], "stream": s["stream"]}
    if "seed" in s:  # a plan's per-family seed (Plan.sampled): the scenarios set none
        body["seed"] = s["seed"]
    if s["stream"]:
        body["stream_options"] = {"include_usage": True}
    if tools:
        body["tools"] = tools
        body["tool_choice"] = s.get("tool_choice", "auto")
    if "response_format" in s:
        body["response_format"] = s["response_format"]
    if "parallel_tool_calls" in s and tools:
        body["parallel_tool_calls"] = s["parallel_tool_calls"]
    return body


def _bodies(scenarios: list[Scenario], model: str, long_context: Callable[[Scenario], str | None]
            ) -> Iterator[tuple[str, PreparedRequest, Scenario]]:
    """Every turn's stored request body, keyed `<scenario>/turn-<i>.json`."""
    for scenario in scenarios:
        context = long_context(scenario)
        for index in range(len(scenario.turns)):
            body = build_request(scenario, index, model, STORED_REQUEST_SALT, context)
            yield f"{scenario.name}/turn-{index}.json", body, scenario


def write_stored_requests(scenarios: list[Scenario], out_dir: Path, model: str,
                          long_context: Callable[[Scenario], str | None]) -> dict[str, str]:
    """Write every turn's body as `<scenario>/turn-<i>.json` plus `SHA256SUMS`; returns path -> sha. Files
    0600, folders 0700, as every file of a run directory (k3load.private_files)."""
    sums: dict[str, str] = {}
    for rel, prepared, _ in _bodies(scenarios, model, long_context):
        with open_private(out_dir / rel, "wb") as handle:
            handle.write(prepared.body)
        sums[rel] = prepared.sha256
    with open_private(out_dir / "SHA256SUMS", "w", encoding="utf-8") as handle:
        handle.write("".join(f"{sha}  {rel}\n" for rel, sha in sorted(sums.items())))
    return sums


def check_stored_requests(scenarios: list[Scenario], out_dir: Path, model: str,
                          long_context: Callable[[Scenario], str | None]) -> list[str]:
    """Differences between the stored requests and what the scenarios produce now (empty: identical).

    A stored body equal as JSON but with its keys in another order is a difference too, said with
    the first key path whose order differs: the order is part of the prompt."""
    stored = {}
    sums_file = out_dir / "SHA256SUMS"
    if sums_file.exists():
        for line in sums_file.read_text().splitlines():
            sha, rel = line.split("  ", 1)
            stored[rel] = sha
    problems = []
    for rel, prepared, scenario in _bodies(scenarios, model, long_context):
        path = out_dir / rel
        if not path.exists():
            problems.append(f"{path}: missing; {scenario.path} produces it")
        elif path.read_bytes() != prepared.body:
            problems.append(_body_problem(path, path.read_bytes(), prepared.body, scenario.path))
        elif stored.get(rel) != prepared.sha256:
            problems.append(f"{sums_file}: {rel}: sha256 is not the one of the body as sent ({prepared.sha256})")
    return problems


def _body_problem(path: Path, stored: bytes, expected: bytes, source: Path) -> str:
    try:
        order = order_difference(json.loads(stored), json.loads(expected))
    except ValueError:
        order = None
    if order is None:
        return f"{path}: stored sample differs from what {source} produces now"
    also = "" if _same_values(json.loads(stored), json.loads(expected)) else " (and its values differ too)"
    return f"{path}: key order differs from what {source} declares{also}: {order}"


def _same_values(a: Any, b: Any) -> bool:
    """Equal as JSON, key order aside, strings holding JSON compared as the JSON they hold."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_values(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str) and isinstance(b, str) and a != b:
        inner = _json_text(a), _json_text(b)
        return None not in inner and _same_values(*inner)
    return type(a) is type(b) and a == b


def order_difference(stored: Any, declared: Any, where: str = "") -> str | None:
    """The first key path (depth first, in declared order) where `stored` lists the same keys as
    `declared` in another order, with both orders; None when there is none (objects with other keys
    are not looked into). A string holding JSON (a tool call's `arguments`) is looked into when the
    two strings differ."""
    if isinstance(stored, dict) and isinstance(declared, dict):
        if stored.keys() != declared.keys():
            return None  # other keys: a difference of content, not of order
        if list(stored) != list(declared):
            return f"{where.lstrip('.') or '(top level)'}: stored {list(stored)}, declared {list(declared)}"
        pairs: Iterator[tuple[str, Any, Any]] = ((f"{where}.{k}", stored[k], v) for k, v in declared.items())
    elif isinstance(stored, list) and isinstance(declared, list):
        pairs = ((f"{where}[{i}]", a, b) for i, (a, b) in enumerate(zip(stored, declared, strict=False)))
    elif isinstance(stored, str) and isinstance(declared, str) and stored != declared:
        inner = _json_text(stored), _json_text(declared)
        return None if None in inner else order_difference(*inner, f"{where} (JSON text)")
    else:
        return None
    for path, a, b in pairs:
        found = order_difference(a, b, path)
        if found:
            return found
    return None


def _json_text(text: str) -> Any:
    """The object or array a string holds as JSON, else None."""
    if not text.lstrip().startswith(("{", "[")):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
