"""vLLM `/health` as transitions: `server_down` (with the reason) and `server_up` (with how long it was down).

Why transitions and not one line per poll: the restart stage and the OOM analysis need *when* the
server went away and came back, and why (a 503 is a dead engine behind a live API server; refused is
a dead process; a timeout is a hung one). vLLM answers 200 or 503 (vllm/entrypoints/openai/api_server.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3load.sampler.fetch import Fetched

EventSink = Callable[..., None]  # event(name, ts, **fields) -> one events.jsonl line


class HealthWatch:
    """Remembers up/down; the first poll counts as a transition only when the server is down."""

    def __init__(self, url: str, event: EventSink, source: str) -> None:
        self.url = url
        self.source = source
        self._event = event
        self.up: bool | None = None
        self.down_since: float | None = None
        self.transitions = 0

    def observe(self, result: Fetched, ts: float) -> None:
        """Feed one poll's result taken at wall time `ts`."""
        if result.ok:
            if self.up is False:
                down_s = None if self.down_since is None else round(ts - self.down_since, 3)
                self._emit("server_up", ts, down_s=down_s)
            self.up, self.down_since = True, None
            return
        if self.up is not False:
            self.down_since = ts
            self._emit("server_down", ts, reason=result.error, http_status=result.status,
                       first_poll=self.up is None)
        self.up = False

    def _emit(self, name: str, ts: float, **fields: Any) -> None:
        self.transitions += 1
        self._event(name, ts, source=self.source, **fields)
