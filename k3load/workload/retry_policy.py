"""When an attempt is retried, how long the user waits before it, and what is sent once the retries are
exhausted: the scenario's retry policy and its turn's `fallback:` read.

Why apart from the conversation: the policy is data the scenario declares (`retry.when`, `backoff_s`,
`first_timeout_s`, `fallback`) and the server's word (`Retry-After`); the conversation only asks "again?",
"after how long?" and "with what body?".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from k3load.client.result import (
    STATUS_HTTP_ERROR,
    STATUS_OK,
    STATUS_STREAM_ERROR,
    STATUS_TIMEOUT,
    STATUS_TRANSPORT_ERROR,
    STATUS_TRUNCATED,
    StreamResult,
)
from k3load.records import Finding
from k3load.workload.fallback import Fallback

if TYPE_CHECKING:
    from k3load.workload.scenario import Turn

RETRY_AFTER_MAX_S = 30.0  # the longest wait a server's Retry-After can impose on one retry


def retry_wait_s(policy: dict[str, Any], timeout_s: float, result: StreamResult) -> float:
    """Seconds to wait before the next attempt: the scenario's `backoff_s`, or longer when the server
    said so with `Retry-After`, but never more than RETRY_AFTER_MAX_S nor the turn's own `timeout_s`.

    Why bounded: a rate limiter's Retry-After is the server's word on when a retry can succeed, and
    retrying sooner only repeats the refusal (and counts as duplicate work); but a header of an hour
    (or a date far ahead) must not park a user for the rest of a stage. The turn's timeout is the
    time the scenario already grants one attempt, so the wait never exceeds what one more attempt
    could have taken. A wait shorter than `backoff_s` is never taken: the scenario's pace holds."""
    wait = float(policy["backoff_s"])
    if result.retry_after_s is not None:
        wait = max(wait, min(result.retry_after_s, RETRY_AFTER_MAX_S, timeout_s))
    return wait


def retry_reason(result: StreamResult, findings: list[Finding]) -> str | None:
    """The retry policy's name for what went wrong (None: nothing a retry could fix)."""
    if result.status == STATUS_TIMEOUT:
        return "timeout"
    if result.status == STATUS_HTTP_ERROR and result.http_status == 429:
        return "http_429"
    if result.status == STATUS_HTTP_ERROR and (result.http_status or 0) >= 500:
        return "http_5xx"
    reasons = {STATUS_TRANSPORT_ERROR: "transport_error", STATUS_TRUNCATED: "truncated",
               STATUS_STREAM_ERROR: "stream_error"}
    if result.status in reasons:
        return reasons[result.status]
    if result.status == STATUS_OK and not all(f.ok for f in findings):
        return "invalid"
    return None


def drill_deadline_s(policy: Mapping[str, Any], number: int) -> float | None:
    """The timeout drill's deliberately short deadline for attempt `number` (1-based), or None: the turn's own.
    The first `first_timeout_attempts` attempts (default 1) get `first_timeout_s`; as many as `max_attempts`
    exhausts the retries on purpose, the drill of the turn's `fallback`."""
    short = policy.get("first_timeout_s")
    return short if short and number <= policy.get("first_timeout_attempts", 1) else None


class AttemptPath(StrEnum):
    """How an attempt came to be sent (the record's `path`): the request's first try, a retry of the same bytes,
    or the one fallback sent with the turn's `fallback:` settings once its retries were exhausted."""

    FIRST_TRY = "first_try"
    RETRY = "retry"
    FALLBACK = "fallback"


def fallback_body(body: Mapping[str, Any], fallback: Fallback) -> dict[str, Any]:
    """The request body with the fallback applied and nothing else changed: each key the fallback sets takes its
    value where it stands (a key the body lacked goes last, in the order model, max_tokens, tool_choice), a
    dropped `response_format` is left out, every other key keeps its value and its place (key order is part
    of the prompt: k3load.workload.stored_requests)."""
    sets = fallback.body_keys()
    out = {k: sets.get(k, v) for k, v in body.items() if not (k == "response_format" and fallback.drop_response_format)}
    return out | {k: v for k, v in sets.items() if k not in out}


def judged_expectation(expect: Mapping[str, Any], fallback: Fallback) -> dict[str, Any]:
    """What a fallback answer is judged by: the turn's expectation minus what the fallback took away.

    - `tool_choice: none` forbids the call a `tool_call` turn expected: judged as an `answer` turn (content,
      no call);
    - no `response_format`: no structured output was asked for, so a `json` turn has no JSON-schema check:
      judged as an `answer` turn;
    - a smaller `max_tokens`, another `model`, or a choice that still allows calls take nothing away: the
      turn's own expectation."""
    kind = expect["kind"]
    if (kind == "tool_call" and fallback.tool_choice == "none") or (kind == "json" and fallback.drop_response_format):
        return {"kind": "answer"}
    return dict(expect)


def fallback_turn(turn: Turn, fallback: Fallback) -> Turn:
    """The turn as its fallback is sent and judged: its settings with the fallback's (the record's `max_tokens`
    is the fallback's) and its expectation as `judged_expectation` says (the record's `turn_kind` with it)."""
    settings = {**turn.settings, **{k: v for k, v in fallback.body_keys().items() if k != "model"}}
    if fallback.drop_response_format:
        settings.pop("response_format", None)
    return replace(turn, settings=settings, expect=judged_expectation(turn.expect, fallback))
