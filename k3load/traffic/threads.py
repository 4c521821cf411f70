"""Logged requests -> the conversations they were: each request that continues an earlier one is its next turn.

    conversations, duplicates = rebuild(exchanges)

Why by prefix: an agent resends the whole history each turn, so a request whose `messages` are an
earlier request's `messages` followed by an assistant message (that request's answer, as the agent sent
it back) and whatever came after it (tool results, the user's next message) is that conversation's next
turn. Messages are compared as JSON values (key order aside: an SDK may re-serialise a message it
sends back). Each conversation's tail is found through a hash of every prefix of the new request's
messages, so a log of N requests of M messages costs O(N·M), not O(N²).

A request that continues a conversation whose tail has already moved on (a fork: two continuations of
one turn) starts a conversation of its own, holding the shared history as its first turn. A request
identical to an earlier one (the same body as JSON values: a retry, a duplicate log line) is counted
once: `duplicates` counts it against the conversation that holds the first.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from k3load.traffic.exchanges import Exchange


@dataclass
class Conversation:
    """One conversation: its turns (logged requests, in log order) and the messages each added."""

    turns: list[Exchange] = field(default_factory=list)
    added: list[list[dict[str, Any]]] = field(default_factory=list)
    duplicates: int = 0


def canonical(value: Any) -> bytes:
    """JSON bytes of a value, key order aside: how two logged messages or bodies are compared."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def prefix_hashes(messages: list[dict[str, Any]]) -> list[bytes]:
    """hashes[k]: the hash of messages[:k] (hashes[0] of none), chained so each costs one message."""
    hashes = [b""]
    for message in messages:
        hashes.append(hashlib.sha256(hashes[-1] + canonical(message) + b"\x00").digest())
    return hashes


def rebuild(exchanges: Iterable[Exchange]) -> tuple[list[Conversation], int]:
    """The conversations, in the order of their first request, and how many requests were duplicates."""
    conversations: list[Conversation] = []
    tails: dict[bytes, int] = {}  # hash of a conversation's last messages -> its index
    seen: dict[bytes, int] = {}  # body hash -> the conversation holding it
    duplicates = 0
    for exchange in exchanges:
        body_key = hashlib.sha256(canonical(exchange.body)).digest()
        if body_key in seen:
            duplicates += 1
            conversations[seen[body_key]].duplicates += 1
            continue
        messages = exchange.body["messages"]
        hashes = prefix_hashes(messages)
        index = _continued(messages, hashes, tails)
        if index is None:
            index = len(conversations)
            conversations.append(Conversation())
            added = list(messages)
        else:
            del tails[hashes[len(_tail_messages(conversations[index]))]]
            added = messages[len(_tail_messages(conversations[index])):]
        conversations[index].turns.append(exchange)
        conversations[index].added.append(added)
        tails[hashes[-1]] = index
        seen[body_key] = index
    return conversations, duplicates


def _continued(messages: list[dict[str, Any]], hashes: list[bytes], tails: dict[bytes, int]) -> int | None:
    """The conversation `messages` continue: the longest earlier tail that is their prefix and is followed
    by an assistant message (the earlier request's answer)."""
    for k in range(len(messages) - 1, 0, -1):
        index = tails.get(hashes[k])
        if index is not None and messages[k].get("role") == "assistant":
            return index
    return None


def _tail_messages(conversation: Conversation) -> list[dict[str, Any]]:
    return conversation.turns[-1].body["messages"]
