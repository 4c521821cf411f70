"""Who plays a conversation, in which run and stage: the `RunContext` every attempt is recorded under, the
client interface it sends through, the streaming-equivalence drill a user plays, and the request id it sends.

Why apart from `k3load.workload.conversation` (which plays the turns and re-exports these names): this is
the state a user is built with once (k3load.loadgen.users, the replay, tests), not the logic of a turn; the
conversation reads it at send time.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from k3load.client.access import PER_REQUEST_HEADER
from k3load.client.result import StreamResult
from k3load.records import Attempt
from k3load.workload.scenario import Scenario, Turn


class Client(Protocol):
    """What the conversation needs of a client: the name of its transport (recorded) and a send."""

    @property
    def transport(self) -> str: ...

    def send(self, body: bytes, deadline_s: float, *, headers: Mapping[str, str] | None = None
             ) -> StreamResult: ...


REQUEST_ID_HEADER = PER_REQUEST_HEADER  # declared once, where the client keeps it out of its cached heads


def request_id_of(attempt_id: str) -> str:
    """The `X-Request-Id` an attempt sends: its own id, marked as ours, so one grep finds the record, vLLM's
    log line (`chatcmpl-k3load-…`) and the gateway's (production-facts.md, "Request ids")."""
    return f"k3load-{attempt_id}"


def one_after_other(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run both, in order: the fallback where nothing can run them at once (a plain thread)."""
    return first(), second()


@dataclass
class StreamDrill:
    """The streaming-equivalence drill of one user: which turns it plays both ways (a plan's
    `stream_equivalence`, drawn from the user's seeded RNG) and how the two twins run at once
    (`concurrently`: gevent under Locust, so both are in flight inside the stage's concurrency)."""

    turns: tuple[str, ...] = ("tool_call",)
    share: float = 0.5
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    concurrently: Callable[[Callable[[], Any], Callable[[], Any]], tuple[Any, Any]] = one_after_other

    def chooses(self, scenario: Scenario, turn: Turn) -> bool:
        """Only turns whose two answers must agree: temperature 0, streamed as written, neither a
        control pair (its cold/warm timing is the point) nor a timeout drill (its deadline is)."""
        eligible = turn.kind in self.turns and scenario.prefix_salt != "pair" and turn.settings["stream"] and \
            not turn.settings["temperature"] and not turn.retry.get("first_timeout_s")
        return eligible and self.rng.random() < self.share


@dataclass
class RunContext:
    """Who is sending, in which run and stage; `stage` is read at send time (the shape moves it)."""

    run_id: str
    model: str
    user_id: str
    stage: Callable[[], str] = lambda: "default"
    long_context: Callable[[Scenario], str | None] = lambda scenario: None
    sleep: Callable[[float], None] = time.sleep
    max_tool_call_gap_ms: float | None = None  # the plan's silence limit inside a streamed tool call
    drill: StreamDrill | None = None  # the streaming-equivalence drill (None: not played)
    # Told of each attempt recorded with a `harness.error` finding, after its sink (k3load.loadgen.console)
    on_unjudged: Callable[[Attempt], Any] = lambda attempt: None
    # The header a session-affinity router keys on (--k3-session-header): each conversation sends one
    # stable id in it, so its turns (a control pair's cold and warm twins among them) meet one replica.
    session_header: str | None = None
    _requests: itertools.count[int] = field(default_factory=itertools.count)
    _pairs: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def salt(self, scenario: Scenario) -> str:
        if scenario.prefix_salt == "run":
            return self.run_id
        if scenario.prefix_salt == "request":
            return f"{self.run_id}/{self.user_id}/{next(self._requests)}"
        return ""

    def next_pair(self) -> tuple[int, str]:
        """A control pair's number (1-based, counted per user over the run) and its fresh salt: the
        run and user in it keep every pair's prefix new to the cache, even across runs and users."""
        number = next(self._pairs)
        return number, f"pair-{number}/{self.run_id}/{self.user_id}"
