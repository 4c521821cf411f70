"""The designed reuse of each request: the run's send order replayed against `reuse_design.json`.

Why apart from analysis/pillars/cache/reuse.py (which judges designed against achieved reuse): the replay is the one
part of the reuse pillar that walks every request of the run, and at an hour's soak that is 360,000
requests against a few dozen variants, so it keeps its maxima per variant (`_Seen`) instead of comparing
each request with every variant seen before it. See analysis/pillars/cache/reuse.py's module doc for what "designed"
means and how salts decide which variants two requests are.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from k3load.analysis.run.lean import AnyAttempt, designed_body
from k3load.analysis.run.rundata import send_order

DEFAULT_BLOCK = 16  # vLLM's default block size, used only when vllm:cache_config_info was not scraped


@dataclass
class Geometry:
    """How the server can reuse: whole blocks, and for a hybrid model only up to a checkpoint."""

    block: int
    align: int | None = None
    block_known: bool = True

    def floor(self, tokens: int) -> int:
        tokens -= tokens % self.block
        if self.align:
            tokens -= tokens % self.align
        return max(tokens, 0)


def salt_key(attempt: AnyAttempt, kind: str) -> tuple[Any, ...]:
    """Requests with equal keys carry the same salt (see the module doc)."""
    if kind == "request":
        return ("request", attempt.stream_pair or attempt.chain_id)
    if kind == "pair":
        return ("pair", attempt.user_id, attempt.control_pair)
    return (kind,)


def _ready_ts(attempt: AnyAttempt) -> float | None:
    """When the attempt's prompt was in the cache: its first token (or a whole answer's end)."""
    if attempt.first_token_ts is not None:
        return attempt.first_token_ts
    return attempt.end_ts if attempt.status == "ok" else None


SaltKey = tuple[Any, ...]


class _Seen:
    """The variants whose prompts were in the cache when a request was sent, by salt key, and the best
    prefix a request can share with them: under its own salt (the same variant family), or with a
    variant seen under another salt (its B twin). Why the maxima are cached: a request is compared
    with every variant seen so far, and an hour's soak sends 360,000 requests against a few dozen
    variants whose salt keys change only when a variant is first seen under a new key."""

    def __init__(self, matrix: list[list[int]], other: dict[int, int]) -> None:
        self.matrix, self.other = matrix, other
        self.same: dict[SaltKey, set[int]] = {}
        self.keys: dict[int, set[SaltKey]] = {}  # variant -> up to two salt keys it was seen with
        self.version = 0  # bumped whenever a variant's keys change: the maxima below are then recomputed
        self._across: dict[int, tuple[int, int | None, int | None, SaltKey | None, int | None]] = {}

    def add(self, variant: int, key: SaltKey) -> None:
        self.same.setdefault(key, set()).add(variant)
        keys = self.keys.setdefault(variant, set())
        if len(keys) < 2 and key not in keys:
            keys.add(key)
            self.version += 1

    def within(self, me: int, key: SaltKey) -> int:
        """The longest prefix `me` shares with a variant seen under the same salt key (0: none)."""
        group = self.same.get(key)
        return max(self.matrix[me][v] for v in group) if group else 0  # designed_tokens keeps the result

    def across(self, me: int, key: SaltKey) -> int | None:
        """The longest prefix `me` shares with the B twin of a variant seen under a key other than `key`
        (None: no such variant)."""
        cached = self._across.get(me)
        if cached is None or cached[0] != self.version:
            cached = self._across[me] = (self.version, *self._maxima(me))
        _, multi, single, single_key, second = cached
        found = single if single_key != key else second
        if multi is None:
            return found
        return multi if found is None else max(multi, found)

    def _maxima(self, me: int) -> tuple[int | None, int | None, SaltKey | None, int | None]:
        """Over the variants seen under two keys (one of them differs from any key), and over those seen
        under one: the best, its key, and the best under any other key."""
        row, multi = self.matrix[me], None
        single: dict[SaltKey, int] = {}
        for variant, keys in self.keys.items():
            value = row[self.other[variant]]
            if len(keys) > 1:
                multi = value if multi is None else max(multi, value)
                continue
            (key,) = keys
            if key not in single or value > single[key]:
                single[key] = value
        if not single:
            return multi, None, None, None
        best_key = max(single, key=single.__getitem__)
        second = max((v for k, v in single.items() if k != best_key), default=None)
        return multi, single[best_key], best_key, second


def designed_tokens(attempts: list[AnyAttempt], design: dict[str, Any], geometry: Geometry) -> dict[str, int]:
    """attempt_id -> designed reused tokens, for the attempts whose scenario and turn were measured.

    The loop runs once per request of the run (360,000 at an hour's soak), so it is written for that: a
    (variant, salt key) already among the seen is not queued again (adding it again would change
    nothing), a scenario's salt key that is the same for every request is built once, and a request's
    best prefix is kept per (variant, salt key) until what it depends on changes (`best`, below)."""
    index = {key: i for i, key in enumerate(design.get("variants") or [])}
    matrix: list[list[int]] = design.get("shared_prefix_tokens") or []
    lengths: list[int] = design.get("prompt_tokens") or []
    kinds = {name: s.get("prefix_salt", "none") for name, s in (design.get("scenarios") or {}).items()}
    other = {i: index.get(key[:-1] + "B", i) for key, i in index.items()}  # variant A -> its B (or itself)
    seen = _Seen(matrix, other)
    within, across, add, same = seen.within, seen.across, seen.add, seen.same
    block, align = geometry.block, geometry.align
    pending: list[tuple[float, int, int, SaltKey]] = []
    added: set[tuple[int, SaltKey]] = set()  # the (variant, salt key) pairs already in `seen`
    push, pop = heapq.heappush, heapq.heappop
    out: dict[str, int] = {}
    # (scenario, turn) -> (variant, salt kind, the salt key when every request of the scenario shares it)
    measured: dict[tuple[str, int], tuple[int, str, SaltKey | None] | None] = {}
    # (variant, salt key) -> (seen.version, the size of the key's group, the best shared prefix): `within`
    # reads only the key's group (a set that only grows, so its size names its content), `across` only
    # the variants' keys (seen.version counts their changes), so the best stays while both are unchanged
    best_of: dict[tuple[int, SaltKey], tuple[int, int, int]] = {}
    for order, attempt in enumerate(_in_send_order(attempts)):
        send = attempt.send_ts
        while pending and pending[0][0] <= send:
            _, _, variant, key = pop(pending)
            if (variant, key) not in added:
                added.add((variant, key))
                add(variant, key)
        turn = (attempt.scenario, attempt.turn)
        if turn in measured:
            found = measured[turn]
        else:
            first = index.get(f"{attempt.scenario}/{attempt.turn}/A")
            kind = kinds[attempt.scenario] if first is not None and attempt.scenario in kinds else ""
            found = measured[turn] = (first, kind, None if kind in ("request", "pair") else (kind,)) \
                if first is not None and attempt.scenario in kinds else None
        if found is None or not designed_body(attempt):
            continue
        me, kind, shared_key = found
        key = shared_key if shared_key is not None else salt_key(attempt, kind)
        group = same.get(key)
        size = len(group) if group else 0
        mine = (me, key)
        kept = best_of.get(mine)
        if kept is not None and kept[0] == seen.version and kept[1] == size:
            best = kept[2]
        else:
            best = within(me, key)
            if (shared := across(me, key)) is not None and shared > best:
                best = shared
            best_of[mine] = (seen.version, size, best)
        prompt = attempt.prompt_tokens
        tokens = min(best, (prompt if prompt is not None else lengths[me]) - 1)
        tokens -= tokens % block  # Geometry.floor, written out: once per request
        if align:
            tokens -= tokens % align
        out[attempt.attempt_id] = tokens if tokens > 0 else 0
        ready = attempt.first_token_ts  # _ready_ts, written out
        if ready is None and attempt.status == "ok":
            ready = attempt.end_ts
        if ready is not None and mine not in added:
            push(pending, (ready, order, me, key))
    return out


def _in_send_order(attempts: list[AnyAttempt]) -> list[AnyAttempt]:
    """By (send_ts, attempt_id), ties in list order (a stable sort on both): by numpy's argsort where every
    send time is a float (`send_order`), which ranks no attempt id but among equal send times."""
    order = send_order([a.send_ts for a in attempts], [a.attempt_id for a in attempts])
    if order is None:
        return sorted(attempts, key=attrgetter("send_ts", "attempt_id"))
    return [attempts[i] for i in order.tolist()]
