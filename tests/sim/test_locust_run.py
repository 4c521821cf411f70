"""The locustfile end to end: `locust -f locustfiles/agent.py --headless` against a real sim, checked on
its run directory (records of every family, stages, samples) and on the sim's injected fault rates; a second
run into the same directory, the web UI's live path, the clear errors of a dead server or a bad scenario, and
Locust's own outputs beside the manifest. The runs over several processes are in test_locust_run_processes.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from k3load.analysis.outputs.manifest import verify
from k3load.evidence import lines, records_file
from k3load.loadgen.options import LOCUST_CSV_SUFFIXES
from k3load.records import read_records
from k3load.rundir_lock import LOCK_NAME
from tests.sim.locust_runs import (
    ROOT,
    SHORT_PLAN,
    VERDICT_CODES,
    _assert_each_served_request_recorded_once,
    _free_port,
    _locust_group,
    _plan,
    run_locust,
)
from tests.sim.test_event_catalogue import events_file_problems


def test_headless_run_writes_records_for_every_family(start_sim, tmp_path):
    sim = start_sim("--time-scale", "0.05")
    out = tmp_path / "run"
    run = run_locust(sim.base_url, out, _plan(tmp_path, SHORT_PLAN), "--k3-api-key", "sk-test-SECRET-123")
    assert run.returncode in VERDICT_CODES, run.stderr[-3000:]
    attempts = read_records(records_file(out))
    assert {a.family for a in attempts} == {"agent", "shared_prefix", "cold", "long_input"}
    assert {a.stage for a in attempts} >= {"prefix-control", "load", "long-input", "ramp-c2", "ramp-c6", "soak"}
    _assert_each_served_request_recorded_once(attempts, sim)
    control = [a for a in attempts if a.stage == "prefix-control"]
    # One user, one pass of 8 cold/warm pairs in sequence: a fresh prefix per pair, shared by its twins.
    assert [a.control_role for a in control] == ["cold", "warm"] * 8 and len({a.prefix_sha256 for a in control}) == 8
    assert all(c.request_sha256 == w.request_sha256 for c, w in zip(control[::2], control[1::2], strict=True))
    assert all(a.send_ts >= b.end_ts for a, b in zip(control[1:], control, strict=False))
    assert all(a.end_ts >= a.send_ts for a in attempts) and all(a.ttft_ms for a in attempts if a.status == "ok")
    drill = [a for a in attempts if a.scenario == "agent_timeout_retry" and a.turn == 0]
    assert any(a.status == "timeout" and a.will_retry for a in drill)
    assert any(a.attempt == 2 and a.status == "ok" for a in drill)
    for name in ("run.json", "plan.yaml", "samples.sha256", "events.jsonl", "validation_summary.json"):
        assert (out / name).exists(), name
    stages = [json.loads(x)["stage"] for x in (out / "events.jsonl").read_text().splitlines()
              if '"stage_start"' in x]
    assert stages[:2] == ["prefix-control", "load"]
    assert events_file_problems(out / "events.jsonl") == []  # every line as k3load/events.py declares it
    files = [p for p in out.rglob("*") if p.is_file()]  # compressed ones read as text (k3load.evidence)
    everything = "".join("".join(lines(p, errors="replace")) for p in files) + run.stdout + run.stderr
    assert "sk-test-SECRET-123" not in everything
    assert (out / "locust_stats.csv").exists()  # --csv inside the run directory, as an operator may put it
    assert verify(out) == []  # Locust's CSV writer ends after the manifest is signed: its files are not covered


FAULTS = {"malformed_tool_args_rate": 0.10, "empty_tool_calls_rate": 0.05, "reasoning_leak_rate": 0.10,
          "http_error_rate": 0.05, "http_error_status": 503, "slow_first_token_rate": 0.05,
          "slow_first_token_ms": 4000}


def _rate(hits: int, total: int) -> float:
    assert total >= 200, f"only {total} attempts"
    return hits / total


@pytest.mark.slow
def test_injected_fault_rates_show_up_with_their_layers(start_sim, tmp_path):
    profile = tmp_path / "faults.yaml"
    profile.write_text(yaml.safe_dump({"faults": FAULTS}))
    sim = start_sim("--time-scale", "0.05", "--profile", str(profile))
    out = tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "soak", "kind": "soak", "duration_s": 40, "users": 12,
                             "mix": {"agent": 3, "shared_prefix": 1}}])
    run = run_locust(sim.base_url, out, plan, timeout_s=240)
    assert run.returncode in VERDICT_CODES, run.stderr[-3000:]
    attempts = [a for a in read_records(records_file(out)) if a.scenario != "agent_timeout_retry"]
    failed = Counter((f.check, f.layer) for a in attempts for f in a.findings if not f.ok)
    http = [a for a in attempts if a.status == "http_error"]
    assert abs(_rate(len(http), len(attempts)) - 0.05) <= 0.03
    # vLLM-style 503 bodies are the server's own answer, not a proxy's: layer `server`, counted once.
    assert all(a.http_status == 503 and a.failed_layers == ["server"] and a.primary_layer == "server" for a in http)
    answered = [a for a in attempts if a.status == "ok"]
    planned_calls = [a for a in answered if a.tool_calls or a.finish_reason == "tool_calls"]
    malformed = sum(1 for a in planned_calls if any(f.check == "tool_call.arguments_json" and not f.ok
                                                    for f in a.findings))
    assert abs(_rate(malformed, len(planned_calls)) - 0.10 * 0.95) <= 0.03
    empty = sum(1 for a in planned_calls if not a.tool_calls)
    assert abs(_rate(empty, len(planned_calls)) - 0.05) <= 0.03
    leaks = sum(1 for a in answered if any(f.check == "content.reasoning_leak" and not f.ok for f in a.findings))
    assert abs(_rate(leaks, len(answered)) - 0.10) <= 0.03
    stalled = sum(1 for a in answered if a.ttft_ms and a.ttft_ms >= 200)  # 4000 model ms x 0.05
    assert abs(_rate(stalled, len(answered)) - 0.05) <= 0.03
    assert failed[("tool_call.arguments_json", "parser")] == malformed
    assert failed[("tool_call.present", "parser")] == empty
    assert failed[("content.reasoning_leak", "parser")] == leaks


@pytest.mark.slow
def test_a_second_run_into_the_same_directory_sets_the_first_aside(start_sim, tmp_path):
    """--k3-out reused (its default is runs/latest): the first run moves whole to a sibling named after
    its run id and still verifies; the second run's logs, verdict and manifest hold only its own run.
    Locust's --csv and --logfile outputs, open before the run starts, stay where they are."""
    sim = start_sim("--time-scale", "0.05")
    out, plan = tmp_path / "latest", _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 4, "users": 2,
                                                       "mix": {"agent": 1}}])
    logfile = ("--logfile", str(out / "locust.log"))
    first = run_locust(sim.base_url, out, plan, "--k3-run-id", "first", *logfile, timeout_s=90)
    assert first.returncode in VERDICT_CODES, first.stderr[-3000:]
    first_files = {p.relative_to(out) for p in out.rglob("*") if p.is_file()} - {Path("locust.log"), Path(LOCK_NAME)}
    first_records = records_file(out).read_bytes()
    second = run_locust(sim.base_url, out, plan, "--k3-run-id", "second", *logfile, timeout_s=90)
    assert second.returncode in VERDICT_CODES, second.stderr[-3000:]
    previous = tmp_path / "latest.previous-first"
    assert f"moved it to {previous}" in (out / "locust.log").read_text()
    records = read_records(records_file(out))
    assert records and {a.run_id for a in records} == {"second"}
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["run_id"]) for e in events if "run_id" in e] == [("run_start", "second")]
    assert events[0]["previous_run_moved_to"] == str(previous)
    assert [e["attempts"] for e in events if e["event"] == "run_end"] == [len(records)]
    agent = json.loads((out / "verdict.json").read_text())["pillars"]["agent_api"]["numbers"]
    assert agent["attempts"] + agent["timeout_drill"]["drills"] == len(records)
    assert json.loads((out / "run.json").read_text())["previous_run_moved_to"] == str(previous)
    assert verify(out) == []
    assert records_file(previous).read_bytes() == first_records
    assert json.loads((previous / "run.json").read_text())["run_id"] == "first"
    locust_csvs = {Path(f"locust{suffix}") for suffix in LOCUST_CSV_SUFFIXES}  # Locust's: stay in latest/
    assert {p.relative_to(previous) for p in previous.rglob("*") if p.is_file()} == first_files - locust_csvs
    assert verify(previous) == []


def test_web_ui_shows_the_options_and_runs_the_plan(start_sim, tmp_path):
    """The live-ramping path: the web UI starts, lists the k3 options, a swarm runs the shape."""
    import time

    sim = start_sim("--time-scale", "0.05")
    port = _free_port()
    out = tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 30, "users": 2, "mix": {"agent": 1}}])
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--host", sim.base_url,
           "--web-host", "127.0.0.1", "--web-port", str(port), "--k3-out", str(out), "--k3-plan", str(plan),
           "--k3-recipe", "recipes/local-dev.yaml"]  # the production recipe fails on the sim: rebuild, no load
    with _locust_group(cmd, subprocess.DEVNULL, subprocess.DEVNULL) as proc:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10) as client:
            for _ in range(100):
                try:
                    page = client.get(base + "/")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            # the live options only: the key, commands, URLs and paths are fixed at start (k3load.loadgen.ui_guard)
            assert page.status_code == 200 and "k3_plan" in page.text and "k3_api_key" not in page.text
            started = client.post(base + "/swarm", data={"user_count": 1, "spawn_rate": 1, "host": sim.base_url})
            assert started.status_code == 200
            deadline = time.monotonic() + 30
            names: set[str] = set()
            while time.monotonic() < deadline and "agent: e2e" not in names:
                time.sleep(0.5)
                names = {row["name"] for row in client.get(base + "/stats/requests").json()["stats"]}
            assert "agent: ttft" in names and "agent: e2e" in names
            client.post(base + "/stop")
        proc.terminate()
        proc.wait(30)
    assert read_records(records_file(out))


def test_a_dead_server_or_a_bad_scenario_is_a_clear_error_and_no_verdict(start_sim, tmp_path):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    run = run_locust(dead, tmp_path / "dead", _plan(tmp_path, SHORT_PLAN[:1]), timeout_s=60)
    assert run.returncode == 2 and "does not answer /v1/models" in run.stdout + run.stderr
    assert not (tmp_path / "dead" / "verdict.json").exists()
    bad = tmp_path / "bad_scenarios"
    bad.mkdir()
    (bad / "broken.yaml").write_text("name: broken\nfamily: agent\nsystem_prompt: s\n"
                                     "turns: [{expect: {kind: maybe}}]\n")
    sim = start_sim()
    run = run_locust(sim.base_url, tmp_path / "bad", _plan(tmp_path, SHORT_PLAN[:1]), "--k3-scenarios",
                     str(bad / "*.yaml"), timeout_s=60)
    assert run.returncode == 2 and "broken.yaml: turns[0].expect.kind" in run.stdout + run.stderr


def test_locust_outputs_inside_the_run_dir_are_left_out_of_the_manifest(tmp_path):
    """--csv / --json-file / --logfile inside the run directory: Locust writes them after the manifest is
    signed, so run.json names them `unsigned_files`; verify passes, and still sees every other file."""
    from argparse import Namespace

    from k3load.analysis.outputs import manifest
    from k3load.loadgen.options import locust_late_outputs

    run = tmp_path / "run"
    opts = Namespace(csv_prefix=str(run / "locust"), json_file=str(tmp_path / "outside"),
                     logfile=str(run / "locust.log"))
    unsigned = locust_late_outputs(opts, run)
    assert unsigned == sorted(["locust_stats.csv", "locust_stats_history.csv", "locust_failures.csv",
                               "locust_exceptions.csv", "locust.log"])
    # Locust writes --json-file X to X.json (locust/stats.py save_stats_json)
    assert locust_late_outputs(Namespace(csv_prefix=None, json_file=str(run / "stats"), logfile=None), run) == \
        ["stats.json"]
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"unsigned_files": unsigned}))
    (run / "records.jsonl").write_text("{}\n")
    (run / "locust_stats_history.csv").write_text("t\n")
    manifest.write(run)
    (run / "locust_stats_history.csv").write_text("t\n1\n")  # Locust's writer, after the signature
    assert manifest.verify(run) == []
    (run / "records.jsonl").write_text("{}\n{}\n")
    assert manifest.verify(run) == ["changed: records.jsonl"]
