"""Shared fixtures. `import locust` first: it gevent-patches sockets before httpx/ssl load."""

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import locust  # noqa: F401  (must stay the first import)
import pytest

from k3load.sim.process import SimProcess

pytest_plugins = ["tests.target_fixtures"] if importlib.util.find_spec("tests.target_fixtures") else []

# A sim fast enough for tests: a tenth of model time, CPU-server-like cache geometry.
FAST_SIM = ["--time-scale", "0.1", "--model", "tiny", "--max-model-len", "2048", "--seed", "7"]


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., SimProcess]]:
    """Factory: start_sim(*extra_args) -> a running sim on a free port, stopped after the test."""
    started: list[SimProcess] = []

    def start(*args: str) -> SimProcess:
        sim = SimProcess([*FAST_SIM, *args], tmp_path / f"sim-{len(started)}.log").start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture
def sim(start_sim: Callable[..., SimProcess]) -> SimProcess:
    return start_sim()


@pytest.fixture
def client() -> Iterator[Any]:
    """An HTTP client for probing a server directly (sim tests); the conformance suite has its own.
    httpx is imported here, after locust's gevent patch above, never at the top of this file."""
    import httpx

    with httpx.Client(timeout=60) as c:
        yield c
