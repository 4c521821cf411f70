"""Goodput: the share of requests, and of sessions, that met every SLO of the plan, and their rates.

Why per request and not per stage percentile: a p95 within the SLO says nothing of the 5% above it,
and a planner sizes for agents served well, not for a percentile (DistServe's and AIPerf's goodput:
a request counts when it met every objective). The plan's p95 limits are read here as each request's
limit: TTFT, time to first answer token (after the reasoning), mean inter-token latency and e2e, and
a valid answer. A latency unknown for a request (a request not streamed has no TTFT) is not held
against it; a failed request never meets the SLO.

A request is a chain of attempts (its retries): it met the SLO only when every attempt did, since a
retried request kept its agent waiting through the failed try. A session is one playing of a scenario
(records' `session_id`), counted in the stage it started in; it met the SLO when every request of it in
that stage did. Attempts our own
client raised on (`client_raised`: nothing is known of the answer) are left out of both counts.

The same test, `attempt_good`, serves the live search (k3load.loadgen) and the judgment, so the search
and the report can never disagree on what a good request is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
from k3load.analysis.run.record_columns import NO_KEY, Rows, all_by_group, group_of
from k3load.analysis.run.stats import wilson

STATUS_OK = "ok"
STATUS_CLIENT_RAISED = "client_raised"
DEFAULT_MIN_GOODPUT = 0.99


@dataclass(frozen=True)
class Slo:
    """Each request's latency limits, in ms (the plan's `slo` p95 limits)."""

    ttft_ms: float
    ttfa_ms: float
    itl_ms: float
    e2e_ms: float

    @classmethod
    def from_limits(cls, limits: dict[str, dict[str, float]]) -> Slo:
        slo = DEFAULT_THRESHOLDS["slo"] | (limits.get("slo") or {})
        return cls(ttft_ms=float(slo["ttft_p95_ms"]), ttfa_ms=float(slo["ttfa_p95_ms"]),
                   itl_ms=float(slo["itl_p95_ms"]), e2e_ms=float(slo["e2e_p95_ms"]))


def _within(value: float | None, limit: float) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value <= limit


def attempt_good(slo: Slo, status: str, valid: bool, ttft_ms: float | None, ttfa_ms: float | None,
                 itl_mean_ms: float | None, e2e_ms: float | None) -> bool:
    """One attempt met every SLO: answered, valid, and each known latency within its limit."""
    return (status == STATUS_OK and bool(valid) and _within(ttft_ms, slo.ttft_ms) and _within(ttfa_ms, slo.ttfa_ms)
            and _within(itl_mean_ms, slo.itl_ms) and _within(e2e_ms, slo.e2e_ms))


def good_attempts(rows: Rows, slo: Slo) -> np.ndarray:
    """`attempt_good` over records' columns, vectorised (the same test, row by row; `valid` counts when it is
    True as `valid == True` tests it: None or NaN is not valid)."""
    good: np.ndarray = rows.code_is("status", STATUS_OK) & rows.flag("valid")
    for column, limit in (("ttft_ms", slo.ttft_ms), ("ttfa_ms", slo.ttfa_ms), ("itl_mean_ms", slo.itl_ms),
                          ("e2e_ms", slo.e2e_ms)):
        values = rows.number(column)
        good &= np.isnan(values) | (values <= limit)
    return good


@dataclass(frozen=True)
class Goodput:
    """A stage's goodput: shares with their 95% intervals (Wilson, over the requests and sessions really
    sent), and the rates of what met the SLO over the stage's load time."""

    requests: int
    good_requests: int
    share: float | None
    share_ci95: tuple[float, float] | None
    sessions: int | None  # None: records without session ids (written before they existed)
    good_sessions: int | None
    session_share: float | None
    session_share_ci95: tuple[float, float] | None
    requests_per_s: float
    output_tokens_per_s: float
    sessions_per_s: float | None
    # The attempts that missed, by what they missed first: not answered (an error), answered but not valid
    # (the model's or the parser's answer), or answered valid but late (a latency limit): which one says
    # whether load or the answers' quality holds the goodput down.
    misses: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"goodput": self.share, "goodput_ci95": list(self.share_ci95) if self.share_ci95 else None,
                "goodput_requests": self.requests, "goodput_good_requests": self.good_requests,
                "goodput_sessions": self.sessions, "goodput_good_sessions": self.good_sessions,
                "session_goodput": self.session_share,
                "session_goodput_ci95": list(self.session_share_ci95) if self.session_share_ci95 else None,
                "goodput_requests_per_s": self.requests_per_s,
                "goodput_output_tokens_per_s": self.output_tokens_per_s,
                "goodput_sessions_per_s": self.sessions_per_s, "goodput_misses": self.misses}


def _share(good: int, total: int) -> tuple[float | None, tuple[float, float] | None]:
    if total <= 0:
        return None, None
    rate = wilson(good, total)
    return rate.value, (rate.low, rate.high)


def stage_goodput(rows: Rows, slo: Slo, duration_s: float) -> Goodput:
    """`rows`: the stage's attempts (drill attempts already left out); `duration_s`: its load time."""
    rows = rows[~rows.code_is("status", STATUS_CLIENT_RAISED)]
    good = good_attempts(rows, slo)
    chains = rows.keys("chain_id")
    named = chains["kind"] != NO_KEY  # an attempt without a chain id belongs to no request (groupby drops it)
    count, chain_of = group_of(chains[named])
    chain_good = all_by_group(count, chain_of, good[named])
    good_chains = int(np.count_nonzero(chain_good))
    requests_share = _share(good_chains, count)
    in_good_chain = np.zeros(len(rows), dtype=bool)
    in_good_chain[np.flatnonzero(named)] = chain_good[chain_of]
    tokens = float(np.nan_to_num(rows.number("completion_tokens")[good & in_good_chain], nan=0.0).sum())
    duration = max(duration_s, 1e-9)
    answered = rows.code_is("status", STATUS_OK)
    valid = answered & rows.flag("valid")
    misses = {"error": int((~answered).sum()), "invalid": int((answered & ~valid).sum()),
              "latency": int((valid & ~good).sum())}
    sessions = good_sessions = None
    session_share: tuple[float | None, tuple[float, float] | None] = (None, None)
    per_s = None
    ids = rows.keys("session_id")
    if (ids["kind"] != NO_KEY).any():
        # a session counts in the stage it started in (its first turn's first attempt): one that goes on into
        # the next stage or step is not counted twice, nor one that came in from the last
        groups, session_of = group_of(ids)
        first = (rows.ints("turn") == 0) & (rows.ints("attempt") == 1) & (ids["kind"] != NO_KEY)
        started = np.zeros(groups, dtype=bool)
        started[session_of[first]] = True
        known = started[session_of]
        session_good = all_by_group(groups, session_of[known], good[known])[started]
        sessions, good_sessions = int(started.sum()), int(np.count_nonzero(session_good))
        session_share = _share(good_sessions, sessions)
        per_s = good_sessions / duration
    return Goodput(requests=count, good_requests=good_chains, share=requests_share[0],
                   share_ci95=requests_share[1], sessions=sessions, good_sessions=good_sessions,
                   session_share=session_share[0], session_share_ci95=session_share[1],
                   requests_per_s=good_chains / duration, output_tokens_per_s=tokens / duration,
                   sessions_per_s=per_s, misses=misses)
