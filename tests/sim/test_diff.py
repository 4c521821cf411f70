"""`k3load diff A B` and a reference run, on three short real runs against the sim (issue 15, parts 1-2).

Why three runs once per module, one after the other: A and B are the same healthy sim run, C is a sim
whose model skips a share of tool calls, run with `--k3-reference A`. Not side by side: on two cores
two runs' stages never line up (their prechecks end a second apart), so one run's short c2 step
met the other's c6 step and its ITL doubled, a real change the diff rightly flagged (CI, stop 21).
Every test reads those three directories: the diff of a healthy pair (F1 near 1, nothing changed
beyond noise, exit 0), the diff against the skipping model (recall down, exit 6), the reference judged
inside C's acceptance, and `k3load analyze --reference` re-judging without new runs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3load.sampler.cpu_wait import read_run_queue_ns
from k3load.sim.process import SimProcess
from tests.conftest import FAST_SIM
from tests.sim.test_verdicts import ROOT, accept

pytestmark = pytest.mark.slow

# Short: about 8 s of stages per run; the agent family only (its tool-call turns are what is compared).
STAGES = [
    {"name": "load", "kind": "load", "duration_s": 4, "users": 4, "mix": {"agent": 1}},
    {"name": "concurrency", "kind": "concurrency", "duration_s": 2, "steps": [2, 6], "mix": {"agent": 1}},
]
SKIP = ["--skip-tool-call-rate", "0.8"]  # per request body at temperature 0: most of the 17 tool-call requests
# The plans' `thresholds.diff.min_relative_change` (default 0.25) set to this CI machine's run-to-run
# noise, as analysis/diff.py means it to be set: in a clean-clone run with nothing beside it, the e2e p95
# of the 2-s c2 step (about 30 answers) went from 95 to 126 ms (+33%) between the two identical runs,
# intervals apart. Within-run intervals cannot see such a shift; the knob is for the host's noise. A host
# that starves the load generator outright is another matter: the diff reads each run's recorded wait for a
# CPU and leaves such a stage unjudged (`max_load_generator_cpu_wait`), which the healthy pair asserts.
# The agreement thresholds at 85%, not the default 90%: every interval counts distinct requests
# (docs/verdict-rules.md), and these runs send the agent family's 27 distinct requests (17 of them tool-call
# turns) over and over at temperature 0. Perfect agreement over 17 requests has an F1 interval from 0.8985:
# it can clear 85%, never 90%. The skipping model's F1 must then fall clearly under 85%.
AGREE = 0.85
NOISE = {"diff": {"min_relative_change": 0.5, "min_trigger_f1": AGREE},
         "agent_api": {"min_reference_trigger_f1": AGREE, "min_valid_rate": AGREE}}


def _run(base: Path, name: str, sim_args: list[str], reference: Path | None = None) -> Path:
    """One acceptance run in its own directory, its sim stopped whatever happens."""
    where = base / name
    where.mkdir()
    sims: list[SimProcess] = []

    def start_sim(*args: str) -> SimProcess:
        sims.append(SimProcess([*FAST_SIM, *args], where / f"sim-{len(sims)}.log").start())
        return sims[-1]

    options = (lambda sim: ["--k3-reference", str(reference)]) if reference else (lambda sim: [])
    try:
        return accept(start_sim, where, sim_args, stages=STAGES, options=options, thresholds=NOISE)[2]
    finally:
        for sim in sims:
            sim.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A and B (healthy, one after the other), then C (skips tool calls) judged against A as its reference."""
    base = tmp_path_factory.mktemp("diff")
    dirs = {"a": _run(base, "a", []), "b": _run(base, "b", [])}
    dirs["c"] = _run(base, "c", SKIP, reference=dirs["a"])
    return dirs


def _diff(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3load", "diff", str(a), str(b), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_healthy_pair_agrees_with_nothing_changed_beyond_noise(runs):
    done = _diff(runs["a"], runs["b"], "--json")
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["exit_code"] == 0 and result["worse"] == [], result["worse"]
    assert result["thresholds"]["min_relative_change"] == NOISE["diff"]["min_relative_change"]
    trigger = result["agreement"]["trigger"]
    assert result["agreement"]["comparable"] >= 20 and trigger["tp"] > 0 and trigger["tn"] > 0
    assert trigger["f1"] >= 0.99 and trigger["f1_ci95"][0] >= AGREE and trigger["recall"]["rate"] >= 0.99, trigger
    assert result["agreement"]["tool_name_agreement"]["rate"] == 1.0
    schema = result["agreement"]["schema_accuracy"]
    assert schema["reference"]["n"] > 0 and schema["drop_ci95"][0] <= 0 <= schema["drop_ci95"][1]
    assert result["verdicts"]["a"] == result["verdicts"]["b"]
    assert {p: v["a"] for p, v in result["pillars"].items()} == {p: v["b"] for p, v in result["pillars"].items()}
    stages = {row["stage"]: row for row in result["stages"]}
    assert set(stages) == {"load", "concurrency-c2", "concurrency-c6"}
    assert all(r["in"] == "both" for r in stages.values())
    unjudged = {r["id"] for r in result["rules"] if r["status"] == "inconclusive"}
    for row in stages.values():
        waits = row["load_generator_cpu_wait_pct"]
        if read_run_queue_ns() is not None:  # this kernel counts run-queue time: both runs recorded the wait
            assert all(isinstance(w, float) and 0 <= w <= 100 for w in waits.values()), waits
        moved = {m: f for m, f in row["measures"].items() if f["changed_beyond_noise"]}
        if row["starved"]:
            # A load generator starved by its host (CI: a real vLLM warming up on the same two cores; stop 46 saw
            # B's c2 serve 29 answers to A's 52): the stage is shown, not judged, and the diff says whose wait.
            assert not moved and f"diff.stage.{row['stage']}" in unjudged and "short of CPU" in row["starved"]
        else:
            assert not moved, (row["stage"], moved, waits)
        assert row["measures"]["ttft_p95_ms"]["a"]["ci95"][0] <= row["measures"]["ttft_p95_ms"]["a"]["value"]
    text = _diff(runs["a"], runs["b"])
    assert text.returncode == 0 and "No regression of B" in text.stdout
    assert "| tool-call trigger F1 | 1.000" in text.stdout and "| load | ttft_p95_ms |" in text.stdout


def test_a_model_that_skips_tool_calls_loses_recall_and_fails_the_diff(runs):
    done = _diff(runs["a"], runs["c"], "--json")
    result = json.loads(done.stdout)
    assert done.returncode == 6 == result["exit_code"], result["worse"]
    trigger = result["agreement"]["trigger"]
    assert trigger["fn"] > 0 and trigger["recall"]["ci95"][1] < AGREE and trigger["precision"]["rate"] == 1.0, trigger
    assert any("trigger F1" in w for w in result["worse"])
    skipped = [t for t in result["agreement"]["by_turn"] if t["reference_label"] == "tool_call" and t["fn"]]
    assert skipped and result["agreement"]["disagreeing_by_layer"] == {"model_output": trigger["fn"]}
    assert result["agreement"]["finish_reasons"]["run"]["stop"]["rate"] > \
        result["agreement"]["finish_reasons"]["reference"]["stop"]["rate"]
    text = _diff(runs["a"], runs["c"])
    assert text.returncode == 6 and "B is worse than A beyond the plan's thresholds (exit 6)" in text.stdout
    assert "| trigger recall |" in text.stdout


def test_the_reference_run_is_judged_in_the_acceptance_and_named(runs):
    """C ran with --k3-reference A: reference.json names A; the agent pillar fails on recall, layer
    model_output; `k3load analyze` on a copy re-judges from the directory alone, byte for byte."""
    a, c = runs["a"], runs["c"]
    record = json.loads((c / "reference.json").read_text())
    assert record["run_id"] == json.loads((a / "run.json").read_text())["run_id"]
    assert record["manifest_sha256"] == hashlib.sha256((a / "manifest.sha256").read_bytes()).hexdigest()
    verdict = json.loads((c / "verdict.json").read_text())
    agent = verdict["pillars"]["agent_api"]
    assert agent["status"] == "fail"
    said = f"model_output: against reference {record['run_id']}: trigger F1"
    assert any(r.startswith(said) for r in agent["reasons"])
    reference = agent["numbers"]["reference"]
    assert reference["run_id"] == record["run_id"] and reference["trigger"]["fn"] > 0
    assert {r["id"]: r["status"] for r in agent["numbers"]["rules"]}["agent.reference_trigger_f1"] == "fail"
    assert "## Agreement with the reference run" in (c / "report.md").read_text()
    assert "Agreement with the reference run" in (c / "report.html").read_text()
    copy = c.parent / "c-copy"
    shutil.copytree(c, copy)
    before = (copy / "verdict.json").read_bytes()
    (copy / "verdict.json").unlink()
    again = subprocess.run([sys.executable, "-m", "k3load", "analyze", str(copy)], cwd=ROOT, capture_output=True,
                           text=True)
    codes = {"go": 0, "limited": 3, "rebuild": 4, "scale_up": 5}
    assert again.returncode == codes[verdict["verdict"]] and (copy / "verdict.json").read_bytes() == before


def test_analyze_reference_rejudges_a_run_without_running_it_again(runs, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(runs["b"], b)
    done = subprocess.run([sys.executable, "-m", "k3load", "analyze", str(b), "--reference", str(runs["a"])],
                          cwd=ROOT, capture_output=True, text=True)
    agent = json.loads((b / "verdict.json").read_text())["pillars"]["agent_api"]
    rules = {r["id"]: r for r in agent["numbers"]["rules"]}
    assert rules["agent.reference_trigger_f1"]["status"] == "pass", done.stdout
    assert rules["agent.reference_trigger_f1"]["interval"][0] >= AGREE
    assert agent["numbers"]["reference"]["path"] == str(runs["a"].resolve())
    assert "reference.json" in (b / "manifest.sha256").read_text()  # the reference record is signed with the run
    bad = subprocess.run([sys.executable, "-m", "k3load", "analyze", str(b), "--reference", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "not a judged run directory" in bad.stderr


def test_diff_refuses_what_is_not_a_run_directory(runs, tmp_path):
    missing = _diff(tmp_path / "nowhere", runs["b"])
    assert missing.returncode == 2 and "nowhere: no such directory" in missing.stderr  # the one check of all three
    empty = _diff(runs["a"], tmp_path)
    assert empty.returncode == 2 and "no records.jsonl" in empty.stderr and not empty.stdout


def test_a_reference_that_is_not_a_judged_run_stops_the_run_before_any_request(tmp_path):
    """Read before the server is even asked: exit 2, one line naming the reference, no run directory."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
                           "--host", "http://127.0.0.1:9", "--k3-out", str(out), "--k3-recipe",
                           "recipes/local-dev.yaml", "--k3-reference", str(tmp_path), "--only-summary"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"k3load: harness error: reference {tmp_path}: not a judged run directory" in \
        done.stderr, done.stderr[-2000:]
    assert not out.exists()
