"""Traffic no one here wrote (issue 28 item 4): BFCL's live tool definitions and questions written out as an
agent's request log (with answers, two turns per conversation, interleaved, with planted secrets), imported
with `k3load import` and played against the sim, directly and through Locust with `--k3-scenarios 'DIR/*.yaml'`.

What it holds the import to: the secrets are nowhere on disk; every request reaches the server as logged
(the served model in place of the logged one, the secrets replaced: `request_sha256` of each record is the
hash of exactly those bytes, and the server's own prompt token count is its tokenization of those
messages and tools); BFCL's own non-standard schemas (`"type": "dict"`) are sent as logged.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from k3load.cli import main
from k3load.client.chat import ChatClient
from k3load.evidence import records_file
from k3load.records import Attempt, read_records
from k3load.traffic.redact import LogRedactor
from k3load.workload.conversation import RunContext, run_scenario
from k3load.workload.scenario import load_scenarios
from k3load.workload.stored_requests import build_request, compact

ROOT = Path(__file__).resolve().parents[2]
BFCL = ROOT.parent / "shared" / "data" / "bfcl"
if not BFCL.is_dir():  # a clean clone's checkout sits beside shared/ as here; say so where it does not
    BFCL = Path("/work/shared/data/bfcl")
PICKS = {"BFCL_v4_live_multiple.json": 5, "BFCL_v4_live_parallel.json": 3}

SECRETS = {  # planted where an agent's traffic carries them: prompts, user text, tool results, answers
    "api_key": "sk-proj-Q7vX2mLp9RtY4wZb8NcK3hJf6DsA1eGu",
    "bearer": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhZ2VudC0xMiJ9.dBjftJeZ4CVPmB92K27uhbUJU1p1r_wW1gFWFOEjXk",
    "email": "maria.lopez@corp-example.com",
    "phone": "+1 415-555-0199",
    "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEAx7Yk9m2Qq1WdQbZ0m4X9Yt8uT3pLkV6nR2sF5jH1aG0cE\n"
           "-----END RSA PRIVATE KEY-----",
}
SYSTEM = f"You are the ordering assistant. Internal key {SECRETS['api_key']}; escalate to {SECRETS['email']}."


def _entries() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out = []
    for name, count in PICKS.items():
        questions = [json.loads(line) for line in (BFCL / name).read_text().splitlines()[:count]]
        answers = [json.loads(line) for line in (BFCL / "possible_answer" / name).read_text().splitlines()[:count]]
        out += list(zip(questions, answers, strict=True))
    return out


def _arguments(accepted: dict[str, list[Any]]) -> dict[str, Any]:
    """BFCL lists the acceptable values of each argument; "" marks an argument that may be left out."""
    return {k: v[0] for k, v in accepted.items() if v and v[0] != ""}


def _conversation(n: int, entry: dict[str, Any], answer: dict[str, Any]) -> list[dict[str, Any]]:
    """Two logged turns: the question (tools offered as BFCL wrote them) answered by its ground-truth calls,
    then the calls' results answered in text."""
    tools = [{"type": "function", "function": f} for f in entry["function"]]
    question = entry["question"][0]
    messages = [{"role": "system", "content": SYSTEM}, *question]
    messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']} (auth: Bearer {SECRETS['bearer']})"}
    calls = [{"id": f"call_{n}_{i}", "type": "function",
              "function": {"name": name, "arguments": json.dumps(_arguments(args))}}
             for i, truth in enumerate(answer["ground_truth"]) for name, args in truth.items()]
    first = {"model": "kimi-k3-prod", "messages": messages, "tools": tools, "tool_choice": "auto",
             "temperature": 0.6, "max_tokens": 96, "stream": True, "stream_options": {"include_usage": True}}
    said = {"role": "assistant", "content": None, "tool_calls": calls}
    results = [{"role": "tool", "tool_call_id": c["id"],
                "content": json.dumps({"status": "ok", "contact": SECRETS["phone"], "key": SECRETS["pem"]})}
               for c in calls]
    second = {**first, "messages": [*messages, said, *results]}
    final = {"role": "assistant", "content": f"Done; a receipt went to {SECRETS['email']}."}
    return [{"request": first, "response": {"object": "chat.completion", "choices": [{"message": said}]}},
            {"request": second, "response": {"object": "chat.completion", "choices": [{"message": final}]}}]


def _log_lines(conversations: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [c[0] for c in conversations] + [c[1] for c in conversations]  # interleaved: every first turn first


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("bfcl")
    conversations = [_conversation(n, e, a) for n, (e, a) in enumerate(_entries())]
    log = folder / "agent-log.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in _log_lines(conversations)))
    assert main(["import", str(log), "--name", "bfcl", "--out", str(folder / "scenarios")]) == 0
    return folder / "scenarios", conversations


def test_bfcl_log_imports_without_a_secret_on_disk(imported: tuple[Path, list[dict[str, Any]]]) -> None:
    out, conversations = imported
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(written) == len(conversations) + 1  # a scenario per conversation, and import.json
    for value in SECRETS.values():
        for form in {value, json.dumps(value)[1:-1], *value.splitlines()[1:2]}:
            assert not any(form.encode() in data for data in written.values()), form[:20]
    summary = json.loads(written["import.json"])
    replaced = summary["redaction"]["replaced"]
    assert all(replaced[kind] > 0 for kind in ("api_key", "email", "phone", "private_key", "bearer_token")), replaced
    assert summary["conversations"] == len(conversations) and summary["turns"] == 2 * len(conversations)
    assert summary["tool_schemas_normalised_for_validation"]  # BFCL's "dict" types, validated as objects
    assert not re.search(rb"\d{3}-\d{4}", written["import.json"])  # counts, never values


def _redacted_as_imported(conversations: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """The logged bodies as the import redacts them: one redactor over the log's lines in file order (each
    line's body, then its answer), so the same secret gets the same placeholder."""
    redactor = LogRedactor()
    bodies: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(_log_lines(conversations)):
        bodies[i] = redactor.value(line["request"])
        redactor.value(line["response"]["choices"][0]["message"])
    n = len(conversations)
    return [[bodies[c], bodies[n + c]] for c in range(n)]


def test_bfcl_requests_are_sent_as_logged(imported: tuple[Path, list[dict[str, Any]]]) -> None:
    """Each body played is the logged one byte for byte (compact JSON, key order included), the secrets
    replaced and the served model's name in place of the logged one."""
    out, conversations = imported
    scenarios = load_scenarios(sorted(out.glob("*.yaml")))
    for scenario, logged, raw in zip(scenarios, _redacted_as_imported(conversations), conversations, strict=True):
        for turn, original, line in zip(scenario.turns, logged, raw, strict=True):
            assert build_request(scenario, turn.index, "tiny").body == compact({**original, "model": "tiny"})
            assert original["tools"] == line["request"]["tools"]  # BFCL's own schemas, as logged
            assert '"type": "dict"' in json.dumps(original["tools"])
            assert SECRETS["api_key"] not in json.dumps(original) and SECRETS["email"] not in json.dumps(original)
        assert scenario.turns[0].kind == "tool_call" and scenario.turns[1].kind == "answer"


def test_bfcl_scenarios_play_against_the_sim(imported: tuple[Path, list[dict[str, Any]]], sim: Any) -> None:
    out, _ = imported
    scenarios = load_scenarios(sorted(out.glob("*.yaml")))
    attempts: list[Attempt] = []
    with ChatClient(sim.base_url) as client, httpx.Client(timeout=30) as probe:
        for scenario in scenarios:
            run_scenario(client, RunContext(run_id="bfcl", model="tiny", user_id="u"), scenario, attempts.append)
        assert len(attempts) == sum(len(s.turns) for s in scenarios)
        for attempt, (scenario, turn) in zip(attempts, [(s, t) for s in scenarios for t in s.turns], strict=True):
            body = build_request(scenario, turn.index, "tiny").body
            assert attempt.status == "ok" and attempt.request_sha256 == hashlib.sha256(body).hexdigest()
            data = json.loads(body)  # the server's own count of the prompt it rendered from exactly these
            tokens = probe.post(f"{sim.base_url}/tokenize", json={"model": "tiny", "messages": data["messages"],
                                                                   "tools": data["tools"]}).json()
            assert attempt.prompt_tokens == tokens["count"], scenario.name
            assert not {f.layer for f in attempt.findings if not f.ok} & {"client", "gateway", "server", "parser"}
    judged = {f.check for a in attempts for f in a.findings}
    assert {"expect.tool_call", "expect.answer", "tool_call.arguments_schema"} <= judged


@pytest.mark.slow
def test_imported_scenarios_play_through_locust(imported: tuple[Path, list[dict[str, Any]]], sim: Any,
                                                tmp_path: Path) -> None:
    """`--k3-scenarios 'DIR/*.yaml'` plays the import as it is, in a real headless Locust run."""
    out, _ = imported
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "imported", "thresholds": {"agent_api": {"min_valid_rate": 0.0}},
                                    "stages": [{"name": "own-traffic", "kind": "load", "duration_s": 6, "users": 3,
                                                "spawn_rate": 3, "mix": {"agent": 1}}]}))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
           "--host", sim.base_url, "--k3-out", str(run), "--k3-plan", str(plan), "--k3-recipe",
           "recipes/local-dev.yaml", "--k3-scenarios", str(out / "*.yaml"), "--only-summary"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert (run / "verdict.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    attempts = read_records(records_file(run))
    scenarios = {s.name: s for s in load_scenarios(sorted(out.glob("*.yaml")))}
    assert attempts and {a.scenario for a in attempts} <= set(scenarios)
    for attempt in attempts:
        expected = build_request(scenarios[attempt.scenario], attempt.turn, "tiny").body
        assert attempt.request_sha256 == hashlib.sha256(expected).hexdigest()
    files = [gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
             for p in run.rglob("*") if p.is_file()]
    for value in SECRETS.values():  # as written, as a JSON string holds it, and a PEM's inner line
        for form in {value, json.dumps(value)[1:-1], *value.splitlines()[1:2]}:
            assert not any(form.encode() in data for data in files), form[:20]
