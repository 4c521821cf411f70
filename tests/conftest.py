"""Shared fixtures. `import locust` first: it gevent-patches sockets before httpx/ssl load."""

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import locust  # noqa: F401  (must stay the first import)
import pytest
from hypothesis import HealthCheck, settings

from k3load.sim.process import SimProcess

pytest_plugins = ["tests.target_fixtures", "tests.beside"] if importlib.util.find_spec("tests.target_fixtures") \
    else []

# Property tests (every parser of outside bytes has some): in `make test` derandomised, so CI draws the same
# examples every run, a bounded number each; `make fuzz SECONDS=N` (scripts/fuzz.py) runs them under the
# `fuzz` profile, random seeds round after round, until the time is spent. A failure found there stays as an
# `@example` on its test. Tests may ask for fewer examples with their own @settings.
settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=5000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("K3_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every Hypothesis test is also marked `fuzz`: `pytest -m fuzz` is the property suite alone."""
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.fuzz)


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
