"""Scenario turns -> exact request bytes, stored canonically with their sha256.

Why canonical bytes: a run must be able to prove it sent what the last run sent, and a warm request
must be shown to share the cold one's prefix byte for byte. The history of a conversation is built
from the scenario's scripted replies and deterministic tool results, never from what the server
answered, so every request of every run is known before the run starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3load.private_files import open_private
from k3load.workload.scenario import Scenario, Turn, execute_tool

STORED_REQUEST_SALT = "SAMPLE"


def canonical(obj: Any) -> bytes:
    """Sorted keys, fixed separators, UTF-8: one byte string per value."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


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
    `pair` the salt also opens the first tool's description (its first key as sent), making the whole
    prefix new to the cache while the warm twin, same salt, repeats it byte for byte. `request` (the
    cold family) is salted there too: with the salt only in the system prompt, every cold request
    shared the whole tool head with every other (23% of its prompt reused, issue 15)."""
    tools = [dict(t) for t in scenario.tools]
    if scenario.prefix_salt in ("pair", "request") and tools:
        function = dict(tools[0]["function"])
        function["description"] = f"[session {salt}] {function.get('description', '')}".rstrip()
        tools[0] = {**tools[0], "function": function}
    return tools


def _replay_turn(scenario: Scenario, turn: Turn, messages: list[dict[str, Any]]) -> None:
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
                   "function": {"name": c["name"], "arguments": canonical(c["arguments"]).decode()}}
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
    fixed = fixed_messages(scenario, salt, long_context)
    messages = [dict(m) for m in fixed]
    if scenario.mode == "conversation":
        for earlier in scenario.turns[:turn_index]:
            _replay_turn(scenario, earlier, messages)
    turn = scenario.turns[turn_index]
    if turn.user is not None:
        messages.append({"role": "user", "content": turn.user})
    tools = _tools(scenario, salt)
    body = _body(scenario, turn, model, messages, tools)
    prefix = canonical({"messages": fixed, "tools": tools})
    data = canonical(body)
    return PreparedRequest(scenario.name, turn_index, data, sha256(data), sha256(prefix))


def _body(scenario: Scenario, turn: Turn, model: str, messages: list[dict[str, Any]],
          tools: list[dict[str, Any]]) -> dict[str, Any]:
    s = turn.settings
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": s["max_tokens"],
                            "temperature": s["temperature"], "stream": s["stream"]}
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
    """Differences between the stored requests and what the scenarios produce now (empty: identical)."""
    stored = {}
    sums_file = out_dir / "SHA256SUMS"
    if sums_file.exists():
        for line in sums_file.read_text().splitlines():
            sha, rel = line.split("  ", 1)
            stored[rel] = sha
    problems = []
    for rel, prepared, scenario in _bodies(scenarios, model, long_context):
        path = out_dir / rel
        if not path.exists() or path.read_bytes() != prepared.body or stored.get(rel) != prepared.sha256:
            problems.append(f"{rel}: stored sample differs from what {scenario.path} produces now")
    return problems
