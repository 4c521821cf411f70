"""`--sample N`: a representative subset of the conversations, by tool set and length.

Why stratified: a log is dominated by its commonest agent; the first N conversations (or N at random)
would drop the rare tool set or the long conversation that breaks a deployment. Conversations are
grouped by the tools they offer (names, sorted) and their length (the power of two of their last
request's characters, so 3 KB and 5 KB fall together, 5 KB and 40 KB apart). Each group gets a share of
N in proportion to its size (largest remainders; every group at least one while N allows), and within a
group the picks are spread evenly over the log's order. Deterministic: the same log gives the same
subset.
"""

from __future__ import annotations

import math
from typing import Any

from k3load.traffic.threads import Conversation
from k3load.workload import logged


def stratum(conversation: Conversation) -> tuple[tuple[str, ...], int]:
    tools: set[str] = set()
    for exchange in conversation.turns:
        tools |= {n for t in logged.request_tools(exchange.body) if (n := logged.tool_name(t))}
    size = sum(len(str(m.get("content") or "")) for m in conversation.turns[-1].body["messages"])
    return tuple(sorted(tools)), int(math.log2(size + 1))


def quotas(sizes: list[int], n: int) -> list[int]:
    """Largest-remainder shares of `n` over groups of `sizes`, each group at least one while n allows."""
    total = sum(sizes)
    if n >= total:
        return list(sizes)
    base = [1 if n >= len(sizes) else 0 for _ in sizes]
    left = n - sum(base)
    exact = [left * s / total for s in sizes]
    shares = [min(b + math.floor(e), s) for b, e, s in zip(base, exact, sizes, strict=True)]
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - math.floor(exact[i])), -sizes[i], i))
    while sum(shares) < n:
        for i in order:
            if sum(shares) >= n:
                break
            if shares[i] < sizes[i]:
                shares[i] += 1
    return shares


def representative(conversations: list[Conversation], n: int) -> list[Conversation]:
    """At most `n` conversations, in log order (see the module docstring)."""
    if n >= len(conversations):
        return list(conversations)
    groups: dict[Any, list[int]] = {}
    for i, conversation in enumerate(conversations):
        groups.setdefault(stratum(conversation), []).append(i)
    members = list(groups.values())
    picked: list[int] = []
    for indices, share in zip(members, quotas([len(m) for m in members], n), strict=True):
        step = len(indices) / share if share else 0
        picked += [indices[int(k * step)] for k in range(share)]
    return [conversations[i] for i in sorted(picked)]
