"""A server whose tool-call arguments and structured outputs are hostile JSON, through a real Locust run
(issue 37 items 1, 2 and 7): no record lost, no traceback on the console, each answer judged in words.

The sim's `--hostile-json-rate 1` writes every tool call's arguments (and every JSON answer) nested 60,000
deep, with a 5,000-digit integer, NaN or a key given twice. The locustfile is the shipped one with one change,
made in a copy beside the run: validation first reads arguments with Python's lenient parser where they hold a
5,000-digit integer, so those answers raise ValueError inside validation, as every hostile answer did before
the strict parser. The run must still write one record per request the sim served, say the harness errors as
counted lines (never a traceback), keep httpx's request lines off the console, and name the count in the
agent pillar's reasons (its rule `agent.harness_errors` inconclusive); the other shapes are judged in words.
"""

from __future__ import annotations

import json

from k3load.evidence import records_file
from k3load.outcomes import HARNESS_ERROR
from k3load.records import read_records
from tests.sim.locust_runs import VERDICT_CODES, _assert_each_served_request_recorded_once, _plan, run_locust
from tests.sim.test_event_catalogue import events_file_problems

LENIENT_LOCUSTFILE = '''
import json

from locustfiles.agent import *  # noqa: F403 - the shipped users, shape and listeners
from k3load.workload import conversation

_strict = conversation.validate


def lenient_first(result, *args, **kwargs):
    for call in result.tool_calls:
        if "99999" in call.arguments:
            json.loads(call.arguments)  # ValueError: past Python's 4,300-digit limit, as before strict JSON
    return _strict(result, *args, **kwargs)


conversation.validate = lenient_first
'''
WORDS = {"nested 60,000 deep; at most 64 are read", "with NaN, which is not JSON", "twice in one object"}


def test_hostile_json_loses_no_record_and_prints_no_traceback(start_sim, tmp_path):
    sim = start_sim("--time-scale", "0.05", "--hostile-json-rate", "1", "--hostile-json-shape", "mixed")
    locustfile = tmp_path / "lenient.py"
    locustfile.write_text(LENIENT_LOCUSTFILE)
    out = tmp_path / "run"
    plan = _plan(tmp_path, [{"name": "load", "kind": "load", "duration_s": 5, "users": 4, "mix": {"agent": 1}}])
    run = run_locust(sim.base_url, out, plan, "-f", str(locustfile), timeout_s=120)
    console = run.stdout + run.stderr
    assert run.returncode in VERDICT_CODES, run.stderr[-3000:]
    attempts = read_records(records_file(out))
    _assert_each_served_request_recorded_once(attempts, sim)  # nothing lost
    assert "Traceback" not in console and "HTTP Request:" not in console, console[-3000:]

    unjudged = [a for a in attempts if any(f.check == HARNESS_ERROR for f in a.findings)]
    assert unjudged and all(a.status == "ok" and a.primary_layer == "client" and not a.valid for a in unjudged)
    assert all(a.findings[0].detail.startswith("ValueError while validating the answer (k3load/workload/") and
               "recorded as received: ok, HTTP 200, " in a.findings[0].detail for a in unjudged)
    said = [line for line in run.stderr.splitlines() if "answer: ValueError while validating" in line
            or "answers: ValueError while validating" in line]
    assert said and len(said) <= 4, said  # at 1, 10, 100 ...: never one line per answer
    assert f"the harness could not judge {len(unjudged):,} answer" in run.stdout

    details = [f.detail for a in attempts for f in a.findings
               if f.check in ("tool_call.arguments_json", "expect.json") and not f.ok]
    assert all(any(w in d for d in details) for w in WORDS), details[:5]
    layers = {f.layer for a in attempts for f in a.findings if f.check == "tool_call.arguments_json" and not f.ok}
    assert layers == {"model_output"}

    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["count"] for e in events if e["event"] == "answer_unjudged"][:2] == [1, 10][:len(said)]
    assert events_file_problems(out / "events.jsonl") == []
    agent = json.loads((out / "verdict.json").read_text())["pillars"]["agent_api"]
    # every tool call is hostile, so the judged answers fail the valid rate (the model's JSON, in words): that
    # failure is said first, the unjudged answers after it, as their own inconclusive rule
    assert agent["status"] == "fail"
    rules = {r["id"]: r for r in agent["numbers"]["rules"]}
    assert rules["agent.harness_errors"]["status"] == "inconclusive"
    assert rules["agent.harness_errors"]["measured"] == len(unjudged)
    assert agent["reasons"][-1].startswith(f"inconclusive, because the harness could not judge {len(unjudged):,} "
                                           "answers (ValueError while validating the answer (k3load/workload/")
    assert agent["numbers"]["unjudged"]["answers"] == len(unjudged)

