"""The verdict matrix: whole runs against the sim in the ways real servers and gateways misbehave,
each asserting the verdict, every pillar's status and the reason that decides it.

Why a matrix: each row is a wrong verdict a user met on a server we did not write (a weak model's
cache "fail", a scrape gap read as "no hits", a 502 storm sent to "buy GPUs", a gateway that hides
/metrics judged `rebuild`, a too-small context called a transport failure). The healthy row runs
under several seeds: the same deployment must get the same verdict every time.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from k3load.sim.process import SimProcess
from tests.conftest import FAST_SIM
from tests.nginx_proxy import NginxProxy, ProxyConfig
from tests.scenario_edits import short_control_prompt
from tests.sim.test_verdicts import accept

pytestmark = pytest.mark.slow

# test_verdicts.STAGES with each stage a little shorter: 33 runs, CI's time counts (about 18 s of stages).
STAGES = [
    {"name": "prefix-control", "kind": "prefix_control", "duration_s": 6, "users": 1, "mix": {"shared_prefix": 1},
     "iterations_per_user": 3},  # 24 pairs, about 4 s on a busy machine (the sign test needs 5: see below)
    {"name": "load", "kind": "load", "duration_s": 3, "users": 4, "mix": {"agent": 3, "shared_prefix": 1}},
    {"name": "long-input", "kind": "long_input", "duration_s": 2, "users": 1, "mix": {"long_input": 1}},
    {"name": "concurrency", "kind": "concurrency", "duration_s": 2, "steps": [2, 12],
     "mix": {"agent": 2, "shared_prefix": 1}},
    {"name": "soak", "kind": "soak", "duration_s": 3, "users": 4,
     "mix": {"agent": 2, "shared_prefix": 1, "cold": 1, "long_input": 1}},
]
# Why three passes of the control's 8 questions: the sim's cold prefill (about 1,600 tokens) costs some 15 ms of wall
# time at FAST_SIM's scale, the scheduling jitter of a 2-core machine four times oversubscribed about as much. With
# CPU hogs here a warm twin came out slower than 0.9 of its cold one in about 1 pair of 20, and the sign test wants
# 7 of 8 pairs faster: 2 slow of 8 (p=0.145) made a healthy row's cache latency inconclusive in CI on Dec 7 2026
# (1 row in 20 at that rate, 1 in 5 where 1 pair in 10 is slow). 24 pairs want 17 faster: 1 row in 600 even then.
ALL_PASS = {"compat": "pass", "resources": "pass", "prefix_cache": "pass", "agent_api": "pass"}
# Every row's plan: the agent valid rate against 90%, not the default 95%. Its interval counts distinct requests
# (docs/verdict-rules.md, the unit of evidence): 100% valid clears 95% only from 73 distinct requests, and these
# short rows send 47-88 (the salted cold family's requests are most of them, fewer on a slower machine), so a
# healthy row would hang on the machine's speed; 90% needs 35. The rows judge the verdict's logic, not the default.
BASE_THRESHOLDS = {"agent_api": {"min_valid_rate": 0.9}}
# A healthy row's verdict: every pillar passes, but its plan has no restart stage (a restart drill per row would
# cost CI a minute), so the seed's restart check is not proven and the verdict is at best `limited`, its first
# reason saying so (issue 38). `go` itself is proven where the restart drill runs: tests/sim/test_verdicts.py.
HEALTHY = "limited"


@dataclass
class Case:
    sim: list[str]
    verdict: str
    statuses: dict[str, str]  # every pillar's status ("*": any)
    reason: tuple[str, str]  # (pillar, or "verdict" for the next action's reasons; a substring)
    options: Callable[[Any], list[str]] = lambda sim: []
    thresholds: dict[str, dict[str, float]] = field(default_factory=dict)
    short_prompt: bool = False
    check: Callable[[dict], None] = lambda verdict: None  # more to assert about this row
    # Debian's nginx between the run and the sim (tests/nginx_proxy.py), its ProxyConfig but the upstream
    # (`{}`: nginx's default proxy, the stream buffered); None: the run talks to the sim straight.
    proxy: dict[str, Any] | None = None


def _oom_details(verdict: dict) -> None:
    crashes = verdict["pillars"]["resources"]["numbers"]["crashes"]
    assert crashes and crashes[0]["stage"] == "concurrency-c12" and "after a concurrency step" in crashes[0]["phase"]
    assert crashes[0]["conditions"]["requests_in_flight"] > 0
    assert crashes[0]["oom"] and "CUDA out of memory" in crashes[0]["log_lines"][0]  # from the tailed server log
    assert crashes[0]["restart"]["recovered"] is False


def _context_details(verdict: dict) -> None:
    refusals = verdict["pillars"]["agent_api"]["numbers"]["context_length_refusals"]
    assert refusals and all(v["max_model_len"] == 1024 and v["prompt_tokens_min"] > 1024 for v in refusals.values())
    # The sim says "at least 1025", as vLLM 0.32 does: the size a lead needs is the estimate from the bytes.
    assert all(v["counted_only_to_the_limit"] and v["prompt_tokens_estimated"] > 1024 for v in refusals.values())
    assert verdict["limits"]["max_model_len"] == 1024
    assert verdict["pillars"]["agent_api"]["numbers"]["failed_by_layer"]["server"] > 0


def _streaming_path_under_concurrency(verdict: dict) -> None:
    """The streaming parser's fault shows only where 6+ requests were in flight: never at c2."""
    by_stage = verdict["pillars"]["agent_api"]["numbers"]["stream_equivalence"]["by_stage"]
    assert by_stage["concurrency-c2"]["streaming path wrong"] == 0, by_stage["concurrency-c2"]
    assert by_stage["concurrency-c12"]["streaming path wrong"] > 0, by_stage["concurrency-c12"]
    assert by_stage["concurrency-c12"]["stream_path_failure_rate"]["ci95"][0] > 0


def _parallel_details(verdict: dict) -> None:
    numbers = verdict["pillars"]["agent_api"]["numbers"]
    failed = numbers["parallel_calls"]["failed_checks"]
    assert {"expect.calls", "tool_call.unique_ids", "tool_call.arguments_json"} <= set(failed), failed
    assert numbers["parallel_calls"]["by_primary_layer"].get("parser", 0) > 0
    assert numbers["stream_equivalence"]["outcomes"]["streaming path wrong"] > 0  # the dropped call, named


def _cadence_details(verdict: dict) -> None:
    cadence = verdict["pillars"]["agent_api"]["numbers"]["tool_call_cadence"]
    assert cadence["over_limit"] > 0 and cadence["max_gap_ms"]["max"] > 900, cadence  # 20,000 model ms at 0.05


def _reservation_is_not_pressure(verdict: dict) -> None:
    """vLLM's reservation at 0.95 leaves 4.5% of each card free from start to end: below the plan's 5% floor,
    never judged as pressure; the load added nothing (the KV fill shows in kv_cache_usage_perc only)."""
    numbers = verdict["pillars"]["resources"]["numbers"]
    stages = numbers["stages"]
    assert all(s["gpu_headroom_min_pct"] < 5 and s["gpu_baseline_headroom_min_pct"] < 5 for s in stages)
    assert all(s["gpu_growth_max_mib"] < 64 for s in stages) and not any(s["problems"] for s in stages)
    assert numbers["gpu_memory"]["judged"] and numbers["gpu_memory"]["creep"] is None


def _creep_details(verdict: dict) -> None:
    creep = verdict["pillars"]["resources"]["numbers"]["gpu_memory"]["creep"]
    assert creep["mib_per_min"] > 60 * 100 and creep["r2"] >= 0.9 and creep["runway_s"] < 24 * 3600


def _prefill_spike_details(verdict: dict) -> None:
    (crash, *_) = verdict["pillars"]["resources"]["numbers"]["crashes"]
    assert crash["stage"] == "long-input" and crash["oom"] and "after a long input" in crash["phase"]
    assert "CUDA out of memory" in crash["log_lines"][0] and "prefill" in crash["log_lines"][0]
    assert crash["memory_curve"] and crash["memory_before"] is not None
    # the earlier long prefills' high water (PyTorch's allocator keeps what it freed), where one was answered before
    # it: a user's scenario is drawn per process, so on some runs the first long prefill is the one that OOMs
    stage = next(s for s in verdict["pillars"]["resources"]["numbers"]["stages"] if s["stage"] == "long-input")
    if stage["max_prompt_tokens_ok"]:
        assert crash["memory_before"]["growth_mib"] > 0, (crash["memory_before"], stage["max_prompt_tokens_ok"])


def _thinking_details(verdict: dict) -> None:
    """Every stage timed its first answer tokens, after the reasoning (TTFT does not show the thinking)."""
    stages = [s for s in verdict["pillars"]["resources"]["numbers"]["stages"] if s["attempts"]]
    assert stages and all(s["ttfa_p95_ms"] > s["ttft_p95_ms"] and s["ttfa_p50_ms"] >= 150 for s in stages), stages
    assert any(p["id"] == "slo.ttfa_p95" for s in stages for p in s["problems"])


def _rebuild_first(verdict: dict) -> None:
    """rebuild is decided first (issue 38): the run stops before any load, saying so."""
    because = verdict["next_action"]["because"]
    assert any(b.startswith("no load ran: the precheck's outcome is rebuild") for b in because), because
    assert verdict["pillars"]["resources"]["reasons"] == ["no request was recorded"]


def _buffered_stream(verdict: dict) -> None:
    """Behind nginx's default proxy the blocks are named as the gateway's, with the fix; no latency SLO is
    judged on them: every TTFT or ITL breach left stands on the server's own histogram."""
    resources = verdict["pillars"]["resources"]
    delivery = resources["numbers"]["stream_delivery"]
    assert delivery["delivery"] == "buffered" and delivery["layer"] == "gateway", delivery
    assert delivery["events_per_read_p50"] >= 6 and delivery["bytes_per_read_p50"] >= 2048, delivery
    assert "proxy_buffering off" in resources["reasons"][0]
    for stage in resources["numbers"]["stages"]:
        for problem in stage["problems"]:
            if problem["id"] in ("slo.ttft_p95", "slo.itl_p95"):
                assert "by the server's vllm:" in problem["reason"], problem
            assert problem["id"] != "slo.ttfa_p95", problem  # vLLM has no series for it: never judged on blocks
    cache = verdict["pillars"]["prefix_cache"]  # the blocks hide the cache's gain: never a fail on them
    latency = [r for r in cache["numbers"].get("rules", []) if r["id"] == "cache.latency"]
    assert cache["status"] != "fail" and all("proxy's blocks" in r["reason"] for r in latency), cache["reasons"]


def _straight_stream(verdict: dict) -> None:
    delivery = verdict["pillars"]["resources"]["numbers"]["stream_delivery"]
    assert delivery["delivery"] == "straight" and delivery["events_per_read_p50"] < 3, delivery


def _fully_reproducible(verdict: dict) -> None:
    """A deterministic server reads 100% reproducible: every request repeated at temperature 0 answered alike."""
    repro = verdict["pillars"]["agent_api"]["numbers"]["reproducibility"]
    assert repro["repeated_requests"] > 0 and repro["share"] == 1.0 and not repro["differences"], repro


def _batch_dependent_details(verdict: dict) -> None:
    """The repeats agree at the lowest concurrency and differ at 12 users: named batch-dependent, with the switch."""
    repro = verdict["pillars"]["agent_api"]["numbers"]["reproducibility"]
    by_stage = repro["by_stage"]
    lowest = min((s for s in by_stage if by_stage[s]["users"] is not None), key=lambda s: by_stage[s]["users"])
    assert by_stage[lowest]["agreeing"] == by_stage[lowest]["repeated_requests"] > 0, by_stage
    assert by_stage["concurrency-c12"]["agreeing"] < by_stage["concurrency-c12"]["repeated_requests"], by_stage
    assert repro["batch_dependent"] is True and repro["differences"], repro
    reason = next(r for r in verdict["pillars"]["agent_api"]["reasons"] if "non-reproducible tool calls" in r)
    assert "batch-dependent" in reason and "VLLM_BATCH_INVARIANT=1" in reason, reason


def _statuses(**changed: str) -> dict[str, str]:
    return ALL_PASS | changed


CASES = {
    "healthy-seed-1": Case(["--seed", "1"], HEALTHY, ALL_PASS, ("prefix_cache", "cold/warm pairs"),
                           check=_fully_reproducible),
    # issue 33: an engine that is not batch-invariant (vLLM by default): the same temperature-0 request's tool-call
    # arguments change once 9 requests share the engine (only at 12 users: 4 users and their stream twins hold 8)
    "batch-dependent-tool-calls": Case(
        ["--batch-dependent-args-rate", "1", "--batch-dependent-args-min-running", "9"], "limited",
        _statuses(agent_api="fail"), ("agent_api", "non-reproducible tool calls"), check=_batch_dependent_details),
    # the second seed at the K3 recipe's --gpu-memory-utilization 0.95 (issue 25): vLLM's reservation leaves 4.5%
    # of each card free from the first scrape, under the plan's 5% floor, and is never read as pressure
    "healthy-seed-2-at-0.95": Case(["--seed", "2", "--gpu-memory-utilization", "0.95"], HEALTHY, ALL_PASS,
                                   ("resources", "reserved at start: 95.5% of each card, vLLM's "
                                                 "--gpu-memory-utilization 0.95"),
                                   check=_reservation_is_not_pressure),
    # A server started with a tool-call parser that is not the model's (the K3 recipe names kimi_k3): the
    # model's call stays as markup in content. The real small model never writes markup in auto turns, so
    # this attribution is proven here (docs/real-server-results.md says why).
    "wrong-parser-leaves-tool-markup": Case(["--raw-tool-markup-rate", "0.3"], "limited", _statuses(agent_api="fail"),
                                            ("agent_api", "parser")),
    "weak-model-cache-still-passes": Case(
        ["--weak-answer-rate", "0.6"], "limited", _statuses(agent_api="fail"), ("agent_api", "model_output")),
    # Kimi's known tool-call failures (issue 13): each ends in the parser layer with a reason naming it.
    "streaming-parser-empties-calls-under-concurrency": Case(  # vllm#54701
        ["--stream-empty-tool-calls-rate", "0.5", "--stream-empty-tool-calls-min-running", "6"], "limited",
        _statuses(agent_api="fail"), ("agent_api", "parser (streaming path)"),
        check=_streaming_path_under_concurrency),
    "parallel-calls-dropped-merged-duplicated": Case(  # vllm#24478
        ["--parallel-call-drop-rate", "0.3", "--parallel-call-merge-rate", "0.3", "--parallel-call-duplicate-rate",
         "0.3"], "limited", _statuses(agent_api="fail"), ("agent_api", "parser (streaming path)"),
        check=_parallel_details),
    "tool-arguments-held-back-then-one-burst": Case(  # vllm#50604
        ["--tool-args-burst-rate", "0.3", "--tool-args-burst-ms", "20000"], "limited",
        _statuses(agent_api="fail"), ("agent_api", "tool-call cadence"),
        thresholds={"agent_api": {"max_tool_call_gap_ms": 500}}, check=_cadence_details),
    "no-think-to-answer-transition": Case(  # vllm#53246
        ["--missing-think-transition-rate", "0.3"], "limited", _statuses(agent_api="fail"),
        ("agent_api", "never left the reasoning")),
    "cache-never-hits": Case(["--prefix-cache-never-hits"], "limited", _statuses(prefix_cache="fail"),
                             ("prefix_cache", "no prefix-cache hits")),
    "prompt-under-one-block": Case(["--block-size", "256"], "limited", _statuses(prefix_cache="inconclusive"),
                                   ("prefix_cache", "shorter than one cache block (block_size 256"),
                                   short_prompt=True),
    "parser-malformed-arguments": Case(["--malformed-tool-args-rate", "0.3"], "limited", _statuses(agent_api="fail"),
                                       ("agent_api", "parser")),
    "oom-at-a-concurrency-step": Case(["--oom-kv-demand-tokens", "13000"], "scale_up",
                                      _statuses(resources="fail", prefix_cache="*", agent_api="*"),
                                      ("verdict", "after a concurrency step"), check=_oom_details),
    "html-502-storm-is-not-scale-up": Case(
        ["--http-error-rate", "0.5", "--http-error-status", "502", "--http-error-style", "html"], "limited",
        _statuses(resources="fail", prefix_cache="*", agent_api="fail"), ("verdict", "by layer gateway")),
    "429-rate-limiter-is-the-gateway": Case(
        ["--http-error-rate", "0.4", "--http-error-status", "429", "--http-error-retry-after-s", "2"], "limited",
        _statuses(resources="fail", prefix_cache="*", agent_api="fail"), ("verdict", "by layer gateway")),
    "vllm-503-storm-is-the-server": Case(
        ["--http-error-rate", "0.4", "--http-error-status", "503"], "limited",
        _statuses(resources="fail", prefix_cache="*", agent_api="fail"), ("verdict", "by layer server")),
    "connection-resets": Case(["--connection-reset-rate", "0.3"], "limited",
                              _statuses(resources="fail", prefix_cache="*", agent_api="fail"),
                              ("verdict", "by layer gateway")),
    "cut-streams": Case(["--midstream-reset-rate", "0.3"], "limited",
                        _statuses(resources="fail", prefix_cache="*", agent_api="fail"), ("verdict", "gateway")),
    "flapping-health-is-not-a-crash": Case(["--health-flap-period-s", "1.5"], "limited",
                                           _statuses(resources="fail"), ("resources", "flapping health check")),
    "metrics-404-behind-a-gateway-is-not-rebuild": Case(
        ["--metrics-http-status", "404"], "limited",
        _statuses(compat="*", resources="inconclusive", prefix_cache="inconclusive"),
        ("prefix_cache", "metrics missing")),
    "metrics-from-a-separate-port": Case(
        ["--metrics-http-status", "404", "--metrics-port", "-1"], HEALTHY, ALL_PASS,
        ("prefix_cache", "cold/warm pairs"), options=lambda sim: ["--k3-metrics-url", sim.metrics_url]),
    "metrics-disabled": Case(["--metrics-disabled"], "limited",  # compat: serve flags cannot be read either
                             _statuses(compat="inconclusive", resources="inconclusive", prefix_cache="inconclusive"),
                             ("prefix_cache", "metrics missing")),
    # Scrapes time out while the control runs; a good one right after it still brackets the window exactly.
    # The stall opens after the third request: after the first, a busy machine (two rows at once) could
    # let the sampler's first scrape reach the sim after the first chat request, and nothing was bracketed.
    "scrape-stall-during-the-control": Case(
        ["--metrics-stall-ms", "4000", "--metrics-stall-after-requests", "3", "--metrics-stall-requests", "12"],
        HEALTHY, ALL_PASS, ("prefix_cache", "cold/warm pairs"), options=lambda sim: ["--k3-scrape-timeout", "1"]),
    # ... and when no good scrape comes for long after it, the window is unbracketed: inconclusive, never a fail.
    "scrape-gap-after-the-control": Case(
        ["--metrics-stall-ms", "4000", "--metrics-stall-after-requests", "3", "--metrics-stall-requests", "0"],
        "limited", _statuses(resources="*", prefix_cache="inconclusive"),
        ("prefix_cache", "do not cover the control window"), options=lambda sim: ["--k3-scrape-timeout", "1"]),
    "context-too-small": Case(
        ["--max-model-len", "1024"], "limited", _statuses(prefix_cache="*", agent_api="fail"),
        ("verdict", "max_model_len 1024"), check=_context_details),
    "latency-slo-without-a-queue": Case(
        [], "limited", _statuses(resources="fail"), ("verdict", "resources: fail"),
        thresholds={"slo": {"ttft_p95_ms": 1.0}}),
    # K3 thinks before it answers (issue 25): 4,000 model ms of thinking (0.2 s at 0.05) is judged on TTFA, not TTFT
    # (the slower answers leave fewer distinct requests: agent_api may not decide, and need not here).
    "long-thinking-judged-on-ttfa": Case(
        ["--think-ms", "4000"], "limited", _statuses(resources="fail"), ("resources", "TTFA p95"),
        thresholds={"slo": {"ttfa_p95_ms": 150.0}}, check=_thinking_details),
    # GPU memory as vLLM uses it (issue 25): the reservation is flat from the first scrape; only what the load
    # adds is judged. The sim's DCGM gauges are read from its /metrics (labelled simulated).
    "gpu-memory-creeps-under-load": Case(
        ["--gpu-memory-creep-mib-per-s", "300"], "limited", _statuses(resources="fail"),
        ("resources", "GPU memory creeps"), options=lambda sim: ["--k3-sample-interval", "0.2"],
        check=_creep_details),
    "long-prefill-spike-ooms": Case(
        ["--prefill-spike-mib-per-1k-tokens", "6000"], "scale_up",
        _statuses(resources="fail", prefix_cache="*", agent_api="*"), ("verdict", "after a long input"),
        check=_prefill_spike_details),
    # Real topology (issue 26): nginx's default proxy buffers the stream; a tight TTFT SLO the client's blocks
    # break (about 60 ms) and the engine's first tokens keep (under 10 ms on the sim) is judged on the server's.
    "nginx-default-proxy-buffers-the-stream": Case(
        [], "limited", _statuses(resources="fail", prefix_cache="*"), ("resources", "gateway: the stream is buffered"),
        thresholds={"slo": {"ttft_p95_ms": 40.0}}, check=_buffered_stream, proxy={}),
    "nginx-unbuffered-streams-straight": Case([], HEALTHY, ALL_PASS, ("prefix_cache", "cold/warm pairs"),
                                              check=_straight_stream, proxy={"buffering": False}),
    # nginx's proxy_read_timeout (1 s) cuts the answers whose first token stalls 2 s (40,000 model ms at 0.05):
    # the gateway's 504s and cut streams, never capacity
    "nginx-read-timeout-cuts-stalled-answers": Case(
        ["--slow-first-token-rate", "0.3", "--slow-first-token-ms", "40000"], "limited",
        _statuses(resources="fail", prefix_cache="*", agent_api="fail"), ("verdict", "gateway"),
        proxy={"buffering": False, "read_timeout_s": 1.0}),
    "production-recipe-on-the-sim": Case([], "rebuild", _statuses(compat="fail", resources="not_run",
                                                                  prefix_cache="not_run", agent_api="not_run"),
                                         ("compat", "target_not_sim"), check=_rebuild_first),
}


# Three rows at once: a row keeps about 0.4 of a core (its sim 5.5 s and Locust 5 s of CPU over its 28 s), so three
# use about 1.1 of CI's two cores. Measured Dec 7 2026 on this 2-core machine: the 33 rows in 311 s (454 s two at a
# time in CI's last run), and in 310 s with a CPU hog beside them, every row passing both times.
ROWS_AT_ONCE = 3


def _run_case(name: str, case: Case, base: Path) -> tuple[dict, int]:
    """One row: its own sim and run directory, the sim stopped whatever happens."""
    tmp_path = base / name
    tmp_path.mkdir()
    sims: list[SimProcess] = []
    proxies: list[NginxProxy] = []

    def start_sim(*args: str) -> SimProcess:
        sim = SimProcess([*FAST_SIM, *args], tmp_path / f"sim-{len(sims)}.log").start()
        sims.append(sim)
        return sim

    def options(sim: SimProcess) -> list[str]:
        """The row's options; behind its nginx, the run's host is the proxy (Locust takes the last --host)."""
        if case.proxy is None:
            return case.options(sim)
        proxies.append(NginxProxy(ProxyConfig(upstreams=(sim.base_url,), **case.proxy), tmp_path / "nginx").start())
        return ["--host", proxies[-1].base_url, *case.options(sim)]

    try:
        scenarios = short_control_prompt(tmp_path / "scenarios") if case.short_prompt else "scenarios/*.yaml"
        recipe = "recipes/kimi-k3.yaml" if name == "production-recipe-on-the-sim" else "recipes/local-dev.yaml"
        verdict, code, _ = accept(start_sim, tmp_path, case.sim, recipe=recipe, scenarios=scenarios, stages=STAGES,
                                  options=options,
                                  thresholds={k: BASE_THRESHOLDS.get(k, {}) | case.thresholds.get(k, {})
                                              for k in BASE_THRESHOLDS.keys() | case.thresholds.keys()})
        return verdict, code
    finally:
        for proxy in proxies:
            proxy.stop()
        for sim in sims:
            sim.stop()


@pytest.fixture(scope="module")
def verdicts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Future[tuple[dict, int]]]:
    """The selected rows' runs (all, or those `-k` chose), ROWS_AT_ONCE at a time (gevent-patched
    threads: the runs are subprocesses)."""
    chosen = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    base = tmp_path_factory.mktemp("matrix")
    with ThreadPoolExecutor(max_workers=ROWS_AT_ONCE) as pool:
        futures = {name: pool.submit(_run_case, name, case, base) for name, case in CASES.items() if name in chosen}
        for future in futures.values():
            future.exception()  # wait for all: the sims are stopped before any row is judged
        return futures


@pytest.mark.parametrize("name", list(CASES))
def test_verdict_matrix(name: str, verdicts: dict[str, Future[tuple[dict, int]]]):
    case = CASES[name]
    verdict, code = verdicts[name].result()
    pillars = verdict["pillars"]
    because = verdict["next_action"]["because"]
    summary = {p: (v["status"], v["reasons"][:2]) for p, v in pillars.items()} | {"because": because}
    assert verdict["verdict"] == case.verdict, summary
    assert {p: v["status"] for p, v in pillars.items() if case.statuses[p] != "*"} == \
        {p: s for p, s in case.statuses.items() if s != "*"}, summary
    where, text = case.reason
    reasons = because if where == "verdict" else pillars[where]["reasons"]
    assert any(text in r for r in reasons), summary
    assert code == {"go": 0, "limited": 3, "rebuild": 4, "scale_up": 5}[case.verdict]
    case.check(verdict)
    # the verdict and the signed record's checklist never disagree: an open line is never `go`
    opened = [i for i in verdict["checklist"] if i["status"] == "open"]
    assert not (opened and verdict["verdict"] == "go"), opened
    assert any(i["item"].startswith("Restart check") and i["status"] == "open" for i in opened)  # no drill here
    if case.verdict == HEALTHY and case.statuses == ALL_PASS:
        assert because[0].startswith("not proven: Restart check (back and serving the same load) (restart not "
                                     "proven: the restart drill not run, because the plan has no restart stage)")
    if case.verdict != "scale_up":
        assert not any("more or larger GPUs" in b for b in because)
