"""Two sims behind Debian's real nginx (tests/nginx_proxy.py), both /metrics scraped: round-robin scatters the
cache pairs over the replicas and the cache pillar names the router, not eviction; nginx keyed on the session
header (`hash $http_x_session_id consistent`, `--k3-session-header X-Session-Id`) keeps each pair on one
replica and the cache passes.

Why these sim timings: a control request must outlast a scrape interval (`--k3-sample-interval 0.2`) for the
per-source counters to place it (analysis/pillars/cache/replicas.py); the sim at time scale 1 with 8 ms steps answers in
about half a second, and a 0.2 ms/token prefill keeps the warm twins' gain clear. One module-scoped pair of
sims, two short runs (CI time is scarce)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k3load.sim.process import SimProcess
from tests.conftest import FAST_SIM
from tests.nginx_proxy import NginxProxy, ProxyConfig
from tests.sim.test_verdicts import accept

pytestmark = pytest.mark.slow

SLOW_ANSWERS = ["--time-scale", "1", "--step-base-ms", "8", "--prefill-ms-per-token", "0.2", "--max-model-len",
                "8192"]


def _control(passes: int) -> list[dict[str, Any]]:
    """The control stage alone: `passes` of the control scenario's 8 pairs, one user, about 1.2 s a pair."""
    return [{"name": "prefix-control", "kind": "prefix_control", "duration_s": 8 + 10 * passes, "users": 1,
             "mix": {"shared_prefix": 1}, "iterations_per_user": passes}]


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimProcess, SimProcess]]:
    folder = tmp_path_factory.mktemp("replicas")
    started = [SimProcess([*FAST_SIM, *SLOW_ANSWERS], folder / f"sim-{n}.log").start() for n in range(2)]
    try:
        yield started[0], started[1]
    finally:
        for sim in started:
            sim.stop()


def _run(sims: tuple[SimProcess, SimProcess], tmp_path: Path, affinity: str | None, passes: int = 1
         ) -> dict[str, Any]:
    """The control stage through nginx in front of both sims, each sim's /metrics scraped; the cache pillar."""
    config = ProxyConfig(upstreams=tuple(s.base_url for s in sims), buffering=False, affinity_header=affinity)
    with NginxProxy(config, tmp_path / "nginx") as proxy:
        def options(sim: SimProcess) -> list[str]:  # Locust takes the last --host: the proxy
            return ["--host", proxy.base_url, "--k3-sample-interval", "0.2",
                    *[arg for s in sims for arg in ("--k3-metrics-url", f"{s.base_url}/metrics")],
                    *(["--k3-session-header", affinity] if affinity else [])]

        start: Callable[..., SimProcess] = lambda *args: sims[0]  # noqa: E731  (already running)
        verdict, _, _ = accept(start, tmp_path, [], stages=_control(passes), options=options)
    return verdict["pillars"]["prefix_cache"]


def test_round_robin_is_named_as_the_router_and_affinity_passes(sims, tmp_path):
    # nginx also forwards the sampler's /health polls, so a pair splits about one time in two. Routing fails when
    # the pairs split and lost are above 5% with 95% confidence: 4 of 24 are (3 are not), and 24 pairs leave 3 or
    # fewer split about once in 7,000 runs.
    cache = _run(sims, tmp_path / "round-robin", None, passes=3)
    routing = cache["numbers"]["routing"]
    assert routing["split"] >= 1, routing
    assert cache["status"] == "fail", cache["reasons"]
    assert "warm twins to another replica than their cold twin" in cache["reasons"][0], cache["reasons"]
    assert "routing is not prefix-affine" in cache["reasons"][0]
    assert not any("evicted" in r or "more pairs would decide" in r for r in cache["reasons"])
    assert {r["source"] for r in cache["numbers"]["replicas"]} == {f"{s.base_url}/metrics" for s in sims}
    assert all(r["requests"] for r in cache["numbers"]["replicas"])  # both replicas served

    cache = _run(sims, tmp_path / "affinity", "X-Session-Id")
    routing = cache["numbers"]["routing"]
    assert routing["split"] == 0 and routing["same"] >= 1, routing
    assert cache["status"] == "pass", cache["reasons"]
    assert "pairs' twins met one replica" in cache["reasons"][0]
