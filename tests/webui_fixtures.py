"""The web UI under test: `locust -f locustfiles/agent.py` with its UI on a free loopback port, driven over
HTTP (`WebUI`); the `web_ui` fixture starts it against a fresh sim and kills its process group after."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.sim.locust_runs import ROOT, _free_port, _locust_group, _plan

STATE_KEYS = {"run_id", "run_dir", "stage", "signals", "pillars", "verdict"}


class WebUI:
    """`locust -f locustfiles/agent.py` with its web UI on a free loopback port, driven over HTTP."""

    def __init__(self, base: str, out: Path) -> None:
        import httpx

        self.base, self.out = base, out
        self.http = httpx.Client(timeout=10)

    def wait_up(self, timeout_s: float = 30) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.http.get(self.base + "/").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError("the web UI never answered")

    def state(self) -> dict[str, Any]:
        return self.http.get(self.base + "/k3load/state").json()

    def swarm(self, users: int, host: str) -> None:
        answer = self.http.post(self.base + "/swarm", data={"user_count": users, "spawn_rate": 10, "host": host})
        assert answer.json()["success"], answer.text

    def wait_for(self, ok: Any, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        state = self.state()
        while not ok(state):
            assert time.monotonic() < deadline, f"{what}: never came; last state {json.dumps(state)[:2000]}"
            time.sleep(0.3)
            state = self.state()
        return state


def web_ui_cmd(host: str, port: int, out: Path, plan: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--host", host,
            "--web-host", "127.0.0.1", "--web-port", str(port), "--k3-out", str(out), "--k3-plan", str(plan),
            "--k3-recipe", "recipes/local-dev.yaml", "--stop-timeout", "5", "--k3-sample-interval", "0.5", *extra]


@pytest.fixture(name="web_ui")
def web_ui_fixture(start_sim, tmp_path) -> Iterator[Any]:
    """Factory: web_ui(*extra) -> (WebUI, sim); the Locust process group is killed after the test."""
    stack = contextlib.ExitStack()

    def start(*extra: str, plan_stages: list[dict] | None = None) -> tuple[WebUI, Any]:
        sim = start_sim("--time-scale", "0.05")
        port, out = _free_port(), tmp_path / "run"
        plan = _plan(tmp_path, plan_stages or [{"name": "load", "kind": "load", "duration_s": 600, "users": 2,
                                                "mix": {"agent": 1}}])
        log = stack.enter_context((tmp_path / "locust.log").open("w"))
        stack.enter_context(_locust_group(web_ui_cmd(sim.base_url, port, out, plan, *extra), log, log))
        ui = WebUI(f"http://127.0.0.1:{port}", out)
        ui.wait_up()
        return ui, sim

    with stack:
        yield start
