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
from typing import Any

import numpy as np

from k3load.analysis.run.record_columns import Rows, designed_body_rows, group_of, in_send_order

DEFAULT_BLOCK = 16  # vLLM's default block size, used only when vllm:cache_config_info was not scraped
# Rows the replay reads as lists at a time, in send order: a dozen fields of every row as Python lists at once were
# the reuse pillar's peak (+108 MB over an hour's 360,000 rows, 2.6 GB a day); a chunk's are a few MB
REPLAY_CHUNK = 65_536


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


def designed_tokens(rows: Rows, design: dict[str, Any], geometry: Geometry) -> list[Any]:
    """Each row's designed reused tokens (None where its scenario and turn were not measured), in row order.
    An attempt id recorded twice takes, on every row of it, the value its last row in send order was given
    (what a table keyed by the id holds).

    The loop runs once per request of the run (360,000 at an hour's soak), so it is written for that: a
    (variant, salt key) already among the seen is not queued again (adding it again would change
    nothing), a scenario's salt key that is the same for every request is built once, and a request's
    best prefix is kept per (variant, salt key) until what it depends on changes (`best`, below). It reads
    the record columns (analysis/run/record_columns.py), a few fields of every row.

    Salt keys (see the module doc of reuse.py): a `request`-salted request's is its stream pair, else its
    chain (the ids as recorded); a `pair`'s its user and control pair; any other scenario's its salt kind."""
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
    out: list[Any] = [None] * len(rows)
    # (scenario code, turn) -> (variant, salt kind, the salt key when every request of the scenario shares it)
    measured: dict[tuple[int, int], tuple[int, str, SaltKey | None] | None] = {}
    # (variant, salt key) -> (seen.version, the size of the key's group, the best shared prefix): `within`
    # reads only the key's group (a set that only grows, so its size names its content), `across` only
    # the variants' keys (seen.version counts their changes), so the best stays while both are unchanged
    best_of: dict[tuple[int, SaltKey], tuple[int, int, int]] = {}
    scenarios, pairs, users = rows.table("scenario"), rows.table("stream_pair"), rows.table("user_id")
    numbers = rows.table("control_pair")
    chain_ids = rows.columns.columns["chain_id"]
    order_all = in_send_order(rows)
    for start in range(0, len(order_all), REPLAY_CHUNK):  # the rows in send order, a chunk's fields as lists at a time
        positions = order_all[start:start + REPLAY_CHUNK]
        chunk = rows.take(positions)
        scenario, turn, pair = chunk.ints("scenario").tolist(), chunk.ints("turn").tolist(), \
            chunk.ints("stream_pair").tolist()
        user, control = chunk.ints("user_id").tolist(), chunk.ints("control_pair").tolist()
        designed = designed_body_rows(chunk).tolist()
        prompts = _recorded(chunk, "prompt_tokens")
        first, end = chunk.number("first_token_ts"), chunk.number("end_ts")
        ready_at = np.where(np.isnan(first), np.where(chunk.code_is("status", "ok"), end, np.nan), first).tolist()
        unpaired = (~chunk.code_where("stream_pair", bool)).tolist()  # salted by their chain (its id as recorded)
        chain_keys = chunk.keys("chain_id")
        send = chunk.number("send_ts").tolist()
        for j, i in enumerate(positions.tolist()):
            sent = send[j]
            while pending and pending[0][0] <= sent:
                _, _, variant, key = pop(pending)
                if (variant, key) not in added:
                    added.add((variant, key))
                    add(variant, key)
            code, number = scenario[j], turn[j]
            if (code, number) in measured:
                found = measured[code, number]
            else:
                name = scenarios[code]
                first_variant = index.get(f"{name}/{number}/A")
                kind = kinds[name] if first_variant is not None and name in kinds else ""
                found = measured[code, number] = (first_variant, kind,
                                                  None if kind in ("request", "pair") else (kind,)) \
                    if first_variant is not None and name in kinds else None
            if found is None or not designed[j]:
                continue
            me, kind, shared_key = found
            if shared_key is not None:
                key = shared_key
            elif kind == "request":
                key = ("request", chain_ids.key_text(chain_keys[j]) if unpaired[j] else pairs[pair[j]])
            else:
                key = ("pair", users[user[j]], numbers[control[j]])
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
            prompt = prompts[j]
            tokens = min(best, (prompt if prompt is not None else lengths[me]) - 1)
            tokens -= tokens % block  # Geometry.floor, written out: once per request
            if align:
                tokens -= tokens % align
            out[i] = tokens if tokens > 0 else 0
            ready = ready_at[j]  # when the prompt was in the cache: its first token (or a whole answer's end)
            if ready == ready and mine not in added:  # not NaN
                push(pending, (ready, start + j, me, key))  # ties in send order
    return _last_by_id(rows, out)


def _recorded(rows: Rows, name: str) -> list[Any]:
    """A NUMBER field's values as recorded (an integer where a record held one), None where unknown."""
    values = rows.recorded(name)
    listed = values.tolist() if isinstance(values, np.ndarray) else values
    return [None if v != v else v for v in listed]  # NaN: unknown


def _last_by_id(rows: Rows, values: list[Any]) -> list[Any]:
    """Each row's value as a table keyed by the attempt id holds it after every row was written in send order:
    the last value given (not None) to a row of that id."""
    _, group = group_of(rows.keys("attempt_id"))
    if len(np.unique(group)) == len(group):
        return values  # every id once: nothing to merge
    last: dict[int, Any] = {}
    for i in in_send_order(rows).tolist():
        if values[i] is not None:
            last[int(group[i])] = values[i]
    return [last.get(g) for g in group.tolist()]
