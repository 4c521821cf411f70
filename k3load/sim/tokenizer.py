"""Deterministic prompt rendering and tokenisation for the sim.

Why our own: the prefix cache must see exactly what a real server sees. A changed tool order, a
re-formatted JSON schema or a different system prompt must change the tokens from that point on,
and identical requests must produce identical tokens on every run and machine. The rendering
follows the shape of Kimi's chat template (role markers, tools first); ids are stable hashes.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

# About 4 characters per token on English text, as for a real BPE vocabulary.
_TOKEN_RE = re.compile(r" ?[A-Za-z]{1,6}| ?\d{1,3}| ?[^\sA-Za-z\d]|\s+")


def tokenize(text: str) -> list[str]:
    """Split text into token pieces; ''.join(pieces) == text."""
    return _TOKEN_RE.findall(text)


def token_id(piece: str) -> int:
    """A stable id for a piece (not Python's salted hash)."""
    return int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=4).digest(), "little")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return json.dumps(content)


def _render_message(message: dict[str, Any]) -> str:
    role = message.get("role", "user")
    text = _content_text(message.get("content"))
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        text = f"<|open|>think<|sep|>{reasoning}<|close|>think<|sep|>{text}"
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        text += f"<|tool_call_begin|>{call.get('id', '')}{fn.get('name', '')}{fn.get('arguments', '')}"
    if role == "tool":
        text = f"{message.get('tool_call_id', '')}\n{text}"
    return f"<|im_{role}|>{role}<|im_middle|>{text}<|im_end|>"


def render_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The prompt text for a chat request: tools (as given, order and formatting kept), then turns."""
    head = ""
    if tools:
        head = "<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools, ensure_ascii=False) + "<|im_end|>"
    return head + "".join(_render_message(m) for m in messages) + "<|im_assistant|>assistant<|im_middle|>"


def prompt_token_ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Token ids of the rendered prompt; the prefix cache hashes these in blocks."""
    return [token_id(piece) for piece in tokenize(render_prompt(messages, tools))]
