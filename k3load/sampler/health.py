"""vLLM `/health` as transitions: `server_down` (with the reason) and `server_up` (with how long it was down).

Why transitions and not one line per poll: the restart stage and the OOM analysis need *when* the
server went away and came back, and why (a 503 is a dead engine behind a live API server; refused is
a dead process; a timeout is a hung one). vLLM answers 200 or 503 (vllm/entrypoints/openai/api_server.py).

Why a timeout is not a crash at once: a loaded machine can take longer than the fetch timeout to answer
one poll, and a `server_down` is counted as a crash by the analysis and starts the restart command.
So an answer that says the server is gone (refused, reset, an HTTP error such as vLLM's 503) is down at
once, while polls that get no answer (a timeout, a gateway's 504) are down only once they last: at least
`down_after_polls` consecutive failed polls spanning at least `down_after_s` seconds. The event then
carries the first failed poll's ts, so the crash timing stays where the server stopped answering. A slow
spell that ends in an answer is one `health_slow` event, never a crash.

Why 3 polls over 5 s: the sampler polls /health in a loop of its own, once per interval
(`k3load/sampler/loop.py`; the metrics sources have theirs, so a slow replica never delays it), each
fetch bounded by a timeout of at least 2 s, so against a hung server polls end about 2 s apart and the
4th failed poll (6 s after the first) says it: a hung engine is said within ~10 s, a single slow poll never.
"""

from __future__ import annotations

from typing import Any

from k3load.events import Event, EventSink
from k3load.sampler.fetch import Fetched

DOWN_AFTER_POLLS = 3
DOWN_AFTER_S = 5.0
_NO_ANSWER_STATUSES = (504,)  # a gateway's "the upstream did not answer in time": a timeout one hop away


def no_answer(result: Fetched) -> bool:
    """True when the poll got no answer in time (the server may be slow, not gone); `fetch.reason` spells
    a timeout 'timeout after 2 s'."""
    return result.status in _NO_ANSWER_STATUSES or (result.status is None and
                                                   (result.error or "").startswith("timeout"))


class HealthWatch:
    """Remembers up/down and the current spell of failed polls; the first poll counts as a transition
    only when the server is down."""

    def __init__(self, url: str, event: EventSink, source: str, *, down_after_polls: int = DOWN_AFTER_POLLS,
                 down_after_s: float = DOWN_AFTER_S) -> None:
        self.url = url
        self.source = source
        self._event = event
        self.down_after_polls, self.down_after_s = down_after_polls, down_after_s
        self.up: bool | None = None
        self.down_since: float | None = None  # the first failed poll of the current spell, said or not
        self.failed_polls = 0
        self.transitions = 0
        self._spell_from_first_poll = False
        self._spell_reason: str | None = None

    def observe(self, result: Fetched, ts: float) -> None:
        """Feed one poll's result taken at wall time `ts`."""
        if result.ok:
            self._answered(ts)
            return
        since = self.down_since if self.down_since is not None else ts
        if self.failed_polls == 0:
            self._spell_from_first_poll, self._spell_reason = self.up is None, result.error
        self.down_since, self.failed_polls = since, self.failed_polls + 1
        if self.up is False:
            return  # already said
        unanswered_s = round(ts - since, 3)
        if no_answer(result) and (self.failed_polls < self.down_after_polls or unanswered_s < self.down_after_s):
            return  # maybe only slow: wait for more polls
        self._emit(Event.SERVER_DOWN, since, reason=result.error, http_status=result.status,
                   first_poll=self._spell_from_first_poll, failed_polls=self.failed_polls, unanswered_s=unanswered_s)
        self.up = False

    def _answered(self, ts: float) -> None:
        since = self.down_since
        if self.up is False:
            self._emit(Event.SERVER_UP, ts, down_s=None if since is None else round(ts - since, 3))
        elif since is not None:  # a slow spell that ended in an answer: said, never a crash
            self._event(Event.HEALTH_SLOW, since, source=self.source, reason=self._spell_reason,
                        failed_polls=self.failed_polls, unanswered_s=round(ts - since, 3))
        self.up, self.down_since, self.failed_polls = True, None, 0

    def _emit(self, name: Event, ts: float, **fields: Any) -> None:
        self.transitions += 1
        self._event(name, ts, source=self.source, **fields)
