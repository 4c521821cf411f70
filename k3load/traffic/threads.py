"""Logged requests -> the conversations they were: each request that continues an earlier one is its next turn.

    conversations, duplicates = rebuild(exchanges)

Why by prefix: an agent resends the whole history each turn, so a request whose `messages` are an
earlier request's `messages` followed by an assistant message (that request's answer, as the agent sent
it back) and whatever came after it (tool results, the user's next message) is that conversation's next
turn. Messages are compared as JSON values (key order aside: an SDK may re-serialise a message it
sends back). Each conversation's tail is found through a hash of every prefix of the new request's
messages, so a log of N requests of M messages costs O(N·M), not O(N²).

A request that continues a conversation whose tail has already moved on (a fork: two continuations of
one turn) starts a conversation of its own, holding the shared history as its first turn. Where several
conversations end in the same messages (sessions of one agent that open alike: a cron-triggered agent's
system prompt and first question), the continuation goes to the one whose last request has the same
session keys (`model`, `user`, `metadata`, `tools`: SESSION_KEYS), else to the most recent of them. A request
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

SESSION_KEYS = ("model", "user", "metadata", "tools")  # what a session's requests share, turn after turn


@dataclass
class Conversation:
    """One conversation: its turns (logged requests, in log order) and the messages each added."""

    turns: list[Exchange] = field(default_factory=list)
    added: list[list[dict[str, Any]]] = field(default_factory=list)
    duplicates: int = 0
    key: bytes = b""  # session_key of its last request


def session_key(body: dict[str, Any]) -> bytes:
    return hashlib.sha256(canonical([body.get(k) for k in SESSION_KEYS])).digest()


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
    tails: dict[bytes, list[int]] = {}  # hash of a conversation's last messages -> the conversations ending so
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
        key = session_key(exchange.body)
        index = _continued(messages, hashes, tails, key, conversations)
        if index is None:
            index = len(conversations)
            conversations.append(Conversation())
            added = list(messages)
        else:
            ended = hashes[len(_tail_messages(conversations[index]))]
            tails[ended].remove(index)
            if not tails[ended]:
                del tails[ended]
            added = messages[len(_tail_messages(conversations[index])):]
        conversations[index].key = key
        conversations[index].turns.append(exchange)
        conversations[index].added.append(added)
        tails.setdefault(hashes[-1], []).append(index)
        seen[body_key] = index
    return conversations, duplicates


def _continued(messages: list[dict[str, Any]], hashes: list[bytes], tails: dict[bytes, list[int]], key: bytes,
               conversations: list[Conversation]) -> int | None:
    """The conversation `messages` continue: the longest earlier tail that is their prefix and is followed
    by an assistant message (the earlier request's answer); among conversations ending alike, the one of the
    same session keys, else the most recent."""
    for k in range(len(messages) - 1, 0, -1):
        candidates = tails.get(hashes[k])
        if candidates and messages[k].get("role") == "assistant":
            same = [i for i in candidates if conversations[i].key == key]
            return (same or candidates)[-1]
    return None


def _tail_messages(conversation: Conversation) -> list[dict[str, Any]]:
    return conversation.turns[-1].body["messages"]
