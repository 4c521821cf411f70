"""Credentials never follow a redirect to another origin (issue 36, items 4 and 6): every client of the harness.

Two real servers on loopback, on their own ports: A answers every request with a redirect to B, B records the
headers of every request it gets. Whatever the harness asks A for — the sampler's /metrics, /health, dcgm and
Prometheus GETs, chat over both transports, /tokenize, the precheck's /version, /v1/models and /metrics, a
Locust run's first /v1/models — B never sees the bearer key or the gateway header's value; the sampler says
each redirect once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from k3load.client import result as res
from k3load.client.chat import ChatClient
from k3load.client.origin import origin
from k3load.client.transport import TRANSPORTS
from k3load.events import Event
from k3load.precheck import run_precheck
from k3load.sampler import Sampler
from k3load.sampler.fetch import CREDENTIALS_DROPPED, FOLLOWED
from k3load.workload.reuse_design import TokenizerUnavailable, http_tokenizer
from tests.sim.redirect_servers import CHAT, KEY, ROOT, SECRETS, Server, _redirector, b, servers
from tests.sim.test_event_catalogue import undeclared

__all__ = ["b", "servers"]  # the servers' fixtures


# -- the sampler: every source, and the event said once --------------------------------------------------
def _wait(until: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert until(), "timed out"


def test_the_sampler_never_sends_credentials_off_origin_and_says_each_redirect_once(
        tmp_path: Path, b: Server, servers: Callable[..., Server]) -> None:
    """/metrics and /health of the target, a dcgm-exporter and Prometheus, all redirected to B."""
    a = servers(_redirector(b.url))
    sampler = Sampler(tmp_path, a.url + "/metrics", gpu_metrics_urls=[a.url + "/dcgm/metrics"], interval_s=0.05,
                      api_key=KEY, headers=dict(SECRETS.headers), prometheus_url=a.url, clock=time.time)
    with sampler:
        _wait(lambda: b.paths().count("/metrics") >= 4 and b.paths().count("/health") >= 4
              and b.paths().count("/dcgm/metrics") >= 2)
    assert "/api/v1/query_range" in b.paths()  # Prometheus is read 5 s behind: at the latest by the final read
    assert b.credentials_seen() == []
    assert {"GET /metrics", "GET /health"} == set(a.credentials_seen())  # the target's own origin only
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert undeclared(lines) == []
    said = [json.loads(line) for line in lines if json.loads(line)["event"] == Event.REDIRECT]
    got = sorted((e["source"], e["to_origin"], e["http_status"], e["action"]) for e in said)
    assert got == sorted([(a.url + "/metrics", b.url, 302, CREDENTIALS_DROPPED),
                          (a.url + "/health", b.url, 302, CREDENTIALS_DROPPED),
                          (a.url + "/dcgm/metrics", b.url, 302, FOLLOWED),
                          (a.url + "/api/v1/query_range", b.url, 302, FOLLOWED)])
    assert KEY not in (tmp_path / "events.jsonl").read_text()


# -- chat, /tokenize, the precheck (httpx and geventhttpclient: never followed) ---------------------------
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_chat_never_follows_a_redirect_and_its_record_names_it(b: Server, servers: Callable[..., Server],
                                                               transport: str, stream: bool) -> None:
    a = servers(_redirector(b.url, 307))
    body = json.dumps({**json.loads(CHAT), "stream": stream}).encode()
    with ChatClient(a.url, transport=transport, secrets=SECRETS) as client:
        got = client.send(body, 10.0)
    assert got.status == res.STATUS_HTTP_ERROR and got.http_status == 307
    assert got.error.startswith(f"HTTP 307: redirect to {b.url} not followed"), got.error
    assert b.seen == [] and a.credentials_seen() == ["POST /v1/chat/completions"]


def test_tokenize_never_follows_a_redirect_even_from_a_client_that_would(b: Server,
                                                                        servers: Callable[..., Server]) -> None:
    a = servers(_redirector(b.url, 307))
    for follow in (False, True):
        tokenize = http_tokenizer(lambda f=follow: httpx.Client(headers=SECRETS.request_headers(), follow_redirects=f),
                                  a.url, "m")
        with pytest.raises(TokenizerUnavailable, match=f"HTTP 307: redirect to {b.url} not followed"):
            tokenize({"messages": [{"role": "user", "content": "hi"}]})
    assert b.seen == []


def test_the_precheck_follows_no_redirect(tmp_path: Path, b: Server, servers: Callable[..., Server]) -> None:
    a = servers(_redirector(b.url))
    run_precheck(tmp_path / "run", ROOT / "recipes" / "local-dev.yaml", a.url, use_local_nvml=False, secrets=SECRETS)
    assert b.seen == []
    fetched = json.loads((tmp_path / "run" / "evidence" / "server" / "fetch.json").read_text())
    assert {e["status"] for e in fetched["endpoints"].values()} == {302}


def test_a_run_whose_models_answer_redirects_stops_naming_it_and_sends_nothing_elsewhere(
        b: Server, servers: Callable[..., Server], tmp_path: Path) -> None:
    """The Locust run's first request (/v1/models, k3load.loadgen.session) never follows: one line, exit 2."""
    from tests.sim.locust_runs import SHORT_PLAN, _plan, run_locust

    a = servers(_redirector(b.url + "/v1/models"))
    run = run_locust(a.url, tmp_path / "run", _plan(tmp_path, SHORT_PLAN[:1]), "--k3-api-key", KEY, timeout_s=60)
    said = run.stdout + run.stderr
    assert run.returncode == 2 and f"redirect to {origin(b.url)} not followed" in said, said[-2000:]
    assert not b.seen and "Traceback" not in said and KEY not in said
