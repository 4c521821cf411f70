"""An answer the harness could not judge: its record as received, with a `harness.error` finding.

Why: one record per request sent, always. An exception in our own code while the client reads the answer,
while it is timed, validated or compared, or while its record is built, would otherwise leave the turn
(Locust logs a traceback and moves on) and the answer the server finished would never reach
records.jsonl.gz: 398 of 1,230 requests were lost that way in one stage, and the verdict was computed on the
survivors. The turn (k3load.workload.conversation) catches it instead and records the answer as received:
the status the transport gave, the assembled answer's size and sha256, and one failed finding

    check harness.error, layer client, detail
    "RecursionError while validating the answer (k3load/workload/validate.py:175 check_tool_calls): maximum
     recursion depth exceeded ...; recorded as received: ok, HTTP 200, 120,345 answer bytes, sha256 9f86..."

whose text before the first ": " is the error's kind (`kind_of`): the exception's class, the phase and the
deepest frame of k3load it passed through. The analysis (analysis/pillars/agent/pillar_agent.py) counts such an answer
neither as valid nor as the server's failure and says "inconclusive, because the harness could not judge N
answers (...)" while any exist; the console says each kind once (k3load.loadgen.console).
"""

from __future__ import annotations

import hashlib
import json
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from k3load.client.result import STATUS_CLIENT_RAISED, StreamResult
from k3load.outcomes import CLIENT, HARNESS_ERROR
from k3load.records import Finding

# What the harness was doing when it raised, in the words of the finding.
PHASE_SEND: Final = "sending the request or reading the answer"
PHASE_TIMING: Final = "timing the answer"
PHASE_VALIDATE: Final = "validating the answer"
PHASE_COMPARE: Final = "comparing the streamed and whole twins"
PHASE_RECORD: Final = "building the record"

MESSAGE_CHARS = 150  # of the exception's own message, in the finding
_PACKAGE = Path(__file__).resolve().parents[1]  # k3load/


@dataclass(frozen=True)
class HarnessFault:
    """One exception of ours, described: its class, the phase, where it was raised, its message."""

    exception: str
    phase: str
    where: str
    message: str

    @classmethod
    def of(cls, exc: BaseException, phase: str) -> HarnessFault:
        return cls(type(exc).__name__, phase, raised_at(exc), _one_line(str(exc), MESSAGE_CHARS))

    @property
    def kind(self) -> str:
        """`RecursionError while validating the answer (k3load/workload/validate.py:175 check_tool_calls)`:
        what the console counts and the verdict names; it never holds ": "."""
        return f"{self.exception} while {self.phase} ({self.where})".replace(": ", ":")


def raised_at(exc: BaseException) -> str:
    """`k3load/workload/validate.py:175 check_tool_calls`: the deepest frame of k3load the exception passed
    through (a library's frame where none is ours), or "unknown" without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    ours = [f for f in frames if _is_ours(f.filename)]
    if not frames:
        return "unknown"
    frame = (ours or frames)[-1]
    return f"{_shown(frame.filename)}:{frame.lineno} {frame.name}"


def _is_ours(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        return False


def _shown(filename: str) -> str:
    path = Path(filename)
    try:
        return str(path.resolve().relative_to(_PACKAGE.parent))
    except (OSError, ValueError):
        return path.name


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def received(result: StreamResult | None) -> str:
    """`ok, HTTP 200, 120,345 answer bytes, sha256 9f86...`: the status the transport gave and the size and
    hash of the answer as assembled (reasoning, content, tool calls and error body as one JSON document;
    the client keeps no copy of the wire bytes). Never raises: what cannot be read is said so."""
    if result is None:
        return "nothing (the client gave no result)"
    status = getattr(result, "status", None) or "no status"
    http = getattr(result, "http_status", None)
    said = f"{status}, HTTP {http}" if http is not None else f"{status}, no HTTP status"
    try:
        document = {"reasoning": result.reasoning, "content": result.content, "error_body": result.error_body,
                    "tool_calls": [[c.id, c.name, c.arguments] for c in result.tool_calls]}
        data = json.dumps(document, ensure_ascii=True, separators=(",", ":"), default=repr).encode()
    except Exception as exc:  # the answer itself may be what is broken
        return f"{said}, answer unreadable ({type(exc).__name__})"
    return f"{said}, {len(data):,} answer bytes, sha256 {hashlib.sha256(data).hexdigest()}"


def finding(fault: HarnessFault, result: StreamResult | None) -> Finding:
    """The `harness.error` finding (layer client) of an answer recorded as received."""
    detail = f"{fault.kind}: {fault.message}; recorded as received: {received(result)}"
    return Finding(HARNESS_ERROR, False, CLIENT, detail[:500])


def kind_of(detail: str) -> str:
    """The error's kind from a `harness.error` finding's detail (the text before the first ": ")."""
    return detail.split(": ", 1)[0]


def is_unjudged(findings: list[Finding] | tuple[Finding, ...]) -> bool:
    return any(f.check == HARNESS_ERROR for f in findings)


def unanswered(transport: str, send_ts: float, end_ts: float, fault: HarnessFault) -> StreamResult:
    """The result of a send that raised instead of returning one: status `client_raised`, nothing received."""
    return StreamResult(status=STATUS_CLIENT_RAISED, transport=transport, send_ts=send_ts, end_ts=end_ts,
                        error=f"the client raised {fault.exception}: {fault.message}"[:300])
