"""The engine core dying behind a live API server, as vLLM 0.32 does it.

Why its own fault: an engine death is not a process death. vLLM's `/health` asks the engine client and answers
503 on `EngineDeadError` (`vllm/entrypoints/serve/instrumentator/health.py`); every request fails; the log says
`EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.`
(`vllm/v1/engine/exceptions.py`); and the API server's watchdog shuts the HTTP server down within 5 s
(`vllm/entrypoints/launchers/launcher.py` `watchdog_loop`, `terminate_if_errored`) unless
`VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1` keeps it answering 503. So the port stays open a while, or for good: the
harness must tell the death from the log line and the 503, not from a closed port (k3load.loadgen.recovery).
"""

from __future__ import annotations

import asyncio
import os
import sys

from aiohttp import web

ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class EngineDeath:
    """Counts chat requests; at the configured one the engine dies (said once in the log)."""

    def __init__(self, after_requests: int, exit_s: float) -> None:
        self.after_requests, self.exit_s = after_requests, exit_s
        self.requests = 0
        self.dead = False

    def on_chat(self) -> web.Response | None:
        """The refusal a dead engine's request gets (None while the engine lives)."""
        if not self.after_requests:
            return None
        self.requests += 1
        if not self.dead and self.requests >= self.after_requests:
            self._die()
        if not self.dead:
            return None
        return web.json_response({"error": {"message": ENGINE_DEAD_MESSAGE, "type": "EngineDeadError",
                                            "param": None, "code": 500}}, status=500)

    def health_status(self, otherwise: int) -> int:
        return 503 if self.dead else otherwise

    def _die(self) -> None:
        self.dead = True
        print("ERROR [core.py:700] EngineCore encountered a fatal error.", file=sys.stderr, flush=True)
        print(f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}", file=sys.stderr, flush=True)
        if self.exit_s > 0:  # the watchdog: the HTTP server goes, the process with it
            asyncio.get_running_loop().call_later(self.exit_s, _exit)


def _exit() -> None:
    print("INFO [launcher.py] [shutdown] API server: shutting down FastAPI HTTP server", file=sys.stderr, flush=True)
    os._exit(0)
