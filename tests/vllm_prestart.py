"""vLLM servers started while the tiers before the real one run, and handed to the tests that declared them.

Why: a server takes 30-90 s to start on two cores, and the real tier used to wait for its first servers one
module at a time (the session's KV-starved tiny server, then the real model's two) about two minutes of CI's
45. Started when the warm-up has the venv and models ready (during the unit or sim tier), niced so the tests
running beside them keep the cores first, they are healthy and idle (about 1 s of CPU a minute) by the time
the real tier asks for them, and each is put back to normal priority when a test takes it, so the real tier
measures the same server it always did.

A test module declares what it wants started early as ``PRESTART = {"name": ServerConfig(...)}`` (the names its
``vllm_pool.start`` uses); the session's ``vllm_server`` is declared here. A server nobody claims is stopped at
the session's end; a prestarted server that died while it waited is stopped and the test starts a fresh one,
as it would have without this.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from k3load.targets.vllm_cpu import VllmCpuServer

PRESTART_NICE = 10  # below the tests beside it, as the warm-up is
SESSION = ("", "session")  # the session's vllm_server, claimed by that fixture


@dataclass
class Prestarted:
    """The servers wanted early, (module name, server name) -> (its configuration, a factory), and those
    launched, with the configuration each was launched with."""

    wanted: dict[tuple[str, str], tuple[object, Callable[[], VllmCpuServer]]] = field(default_factory=dict)
    launched: dict[tuple[str, str], tuple[object, VllmCpuServer]] = field(default_factory=dict)
    done: bool = False

    def launch_all(self) -> None:
        """Launch every wanted server now (Popen only: the start-up runs while the tests go on). Only as root
        (`_renice`): elsewhere nothing is launched early and each test starts its servers as before."""
        if os.geteuid() != 0:
            return
        for key, (config, make) in self.wanted.items():
            server = make()
            server.launch()
            _renice(server, PRESTART_NICE)
            self.launched[key] = (config, server)

    def claim(self, module: str, name: str, config: object) -> VllmCpuServer | None:
        """The server launched for (module, name) with this configuration, at normal priority again, or None
        (never launched, launched otherwise, or it died while it waited: stopped then, and the caller starts
        one as it would have)."""
        launched, server = self.launched.pop((module, name), (None, None))
        if server is None:
            return None
        if launched != config:
            server.stop()
            return None
        if server.proc is not None and server.proc.poll() is not None:
            server.stop()
            return None
        _renice(server, 0)
        return server

    def stop_unclaimed(self) -> None:
        for _, server in self.launched.values():
            with contextlib.suppress(Exception):
                server.stop()
        self.launched.clear()


def _renice(server: VllmCpuServer, nice: int) -> None:
    """Every process of the server's group (its API server and engine core) to `nice`. Only as root: raising a
    priority again needs it, and a server left niced would measure otherwise than the suite's others."""
    if server.pid is None:
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, server.pid, nice)

