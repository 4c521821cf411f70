"""The unit of evidence: which attempts repeat one distinct request, so that rates count requests, not repeats.

Why: at temperature 0 the server answers the same bytes the same way (or nearly: batching can change a
token), so 4,373 attempts of 37 request bodies are 37 trials, not 4,373. An attempt's cluster is its
request: the exact bytes sent (`request_sha256`: scenario, turn, variant, salt and settings in one
hash), which a retry shares with its first try. At a temperature above 0 without a `seed` in the body
every attempt is its own draw, and its own cluster (`attempt_id`). A fixed seed makes a draw repeat
with its bytes, so it clusters by them again. Records written before `temperature` and `seed` existed
cluster by their bytes (the scenarios' default temperature is 0).

Usage: `rate_by_request(attempts, [a.valid for a in attempts])` -> a `stats.Rate` that says its distinct
requests. (The stage table's error rate says its distinct requests by their bytes alone: its records carry no
temperature, analysis/pillars/headroom/stages.py.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from k3load.analysis.run.record_columns import Rows, group_of
from k3load.analysis.run.stats import Rate, cluster_rate


def cluster_key(request_sha256: str, attempt_id: str, temperature: Any = None, seed: Any = None) -> str:
    """An attempt's cluster: its bytes, or the attempt itself when it was a fresh draw (module docstring)."""
    drawn = isinstance(temperature, int | float) and temperature > 0 and seed is None
    return attempt_id if drawn else request_sha256


def attempt_key(attempt: Any) -> str:
    """`cluster_key` of a record (whole or lean); a record without temperature or seed: by its bytes."""
    return cluster_key(attempt.request_sha256, attempt.attempt_id, getattr(attempt, "temperature", None),
                       getattr(attempt, "seed", None))


def distinct_requests(attempts: Iterable[Any]) -> int:
    return len({attempt_key(a) for a in attempts})


def rate_by_keys(keys: Sequence[Any], successes: Sequence[bool] | np.ndarray) -> Rate:
    """`cluster_rate` of per-attempt successes grouped by their keys."""
    if not len(keys):
        return cluster_rate([], [])
    codes, _ = pd.factorize(pd.Series(keys, dtype=object), sort=False)
    hits = np.asarray(successes, dtype=float)
    return cluster_rate(np.bincount(codes, weights=hits), np.bincount(codes))


def rate_by_request(attempts: Sequence[Any], successes: Sequence[bool] | np.ndarray) -> Rate:
    """The success rate of `attempts` (one success flag each) with its interval over their distinct requests."""
    return rate_by_keys([attempt_key(a) for a in attempts], successes)


def _drawn(temperature: Any, seed: Any) -> bool:
    return isinstance(temperature, int | float) and temperature > 0 and seed is None


def cluster_codes(rows: Rows) -> np.ndarray:
    """Each row's cluster (`cluster_key`) as a number, numbered in order of first appearance among these rows, as
    `rate_by_keys` numbers the keys: its bytes' code, or, for a fresh draw, its own id's group."""
    if rows.empty:
        return np.empty(0, dtype=np.intp)
    drawn_temperature = rows.code_where("temperature", lambda t: _drawn(t, None))
    drawn = drawn_temperature & rows.code_where("seed", lambda s: s is None)
    request = rows.ints("request_sha256").astype(np.int64)
    if drawn.any():
        _, own = group_of(rows.keys("attempt_id"))
        request = np.where(drawn, int(request.max()) + 1 + own, request)
    codes, _ = pd.factorize(request, sort=False)
    return codes


def rate_by_codes(codes: np.ndarray, successes: np.ndarray) -> Rate:
    """`cluster_rate` of per-row successes grouped by their cluster numbers (`cluster_codes`)."""
    if not len(codes):
        return cluster_rate([], [])
    return cluster_rate(np.bincount(codes, weights=successes.astype(float)), np.bincount(codes))
