"""Each attempt as Locust request events: the live table's TTFT, ITL and e2e rows, one per family.

Why its own module: it is the Locust stats concern of a record (what Locust's table and --csv show), apart
from where the record itself goes (k3load.loadgen.session: records.jsonl, or the master by message). Judge
SLOs on these named entries, never on Aggregated (it mixes TTFT, ITL and e2e); exact timings stay in the
records (Locust rounds below 100 ms).
"""

from __future__ import annotations

from typing import Any

from k3load.records import Attempt


def fire_request_events(env: Any, attempt: Attempt) -> None:
    """TTFT, ITL and e2e as their own named entries (judge SLOs on these, never on Aggregated).
    A timeout-drill attempt is its own entry: its timeout is the expected outcome, not a failure."""
    if attempt.drill:
        env.events.request.fire(request_type="K3", name=f"{attempt.family}: timeout drill",
                                response_time=attempt.e2e_ms or 0, response_length=0, context={},
                                start_time=attempt.send_ts,
                                exception=None if attempt.status == "timeout" else Exception("did not time out"))
        return
    failure = None if attempt.valid else Exception(
        f"{attempt.status}: " + "; ".join(f"{f.check}[{f.layer}]" for f in attempt.findings if not f.ok))
    base = {"request_type": "K3", "context": {"scenario": attempt.scenario, "stage": attempt.stage},
            "start_time": attempt.send_ts}
    # the drill's stream:false twin is its own entry: a whole body's e2e is not a streamed one's
    e2e = f"{attempt.family}: e2e" + (" (stream: false twin)" if attempt.stream_role == "whole" else "")
    env.events.request.fire(name=e2e, response_time=attempt.e2e_ms or 0,
                            response_length=attempt.completion_tokens or 0, exception=failure, **base)
    if attempt.ttft_ms is not None:
        env.events.request.fire(name=f"{attempt.family}: ttft", response_time=attempt.ttft_ms,
                                response_length=0, exception=None, **base)
    if attempt.itl_mean_ms is not None:
        env.events.request.fire(name=f"{attempt.family}: itl", response_time=attempt.itl_mean_ms,
                                response_length=0, exception=None, **base)
