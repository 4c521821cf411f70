"""When an attempt is retried, and how long the user waits before it: the scenario's retry policy read.

Why apart from the conversation: the policy is data the scenario declares (`retry.when`, `backoff_s`) and
the server's word (`Retry-After`); the conversation only asks "again?" and "after how long?".
"""

from __future__ import annotations

from typing import Any

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
