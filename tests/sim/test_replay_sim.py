"""A Mooncake-format trace replayed against the sim, end to end (issue 28): its rows go out at the trace's
pace, open-loop, each record keeping its intended time, and the trace's prefix sharing reaches the sim's prefix
cache: its /metrics counters grow by what the shared hash_ids predict, and by nothing when the same rows carry
ids of their own. One run of two replay stages, about 20 s of wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from k3load.evidence import records_file
from k3load.records import read_records
from k3load.workload.trace import TraceRow, shared_prefix_blocks
from tests.sim.test_trace import mooncake_trace, write_trace

ROOT = Path(__file__).resolve().parents[2]
BLOCK, SIM_BLOCK = 64, 16  # the trace's block_tokens, the sim's KV block (its prefix-cache hash unit)
STAGE_S = 7.0

pytestmark = pytest.mark.slow


def _counters(client: Any, base_url: str) -> dict[str, float]:
    text = client.get(f"{base_url}/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _unshared(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same rows, each with ids of its own: nothing to share."""
    out, next_id = [], 10_000
    for row in rows:
        ids = list(range(next_id, next_id + len(row["hash_ids"])))
        next_id += len(ids)
        out.append({**row, "hash_ids": ids})
    return out


def _predicted_hits(rows: list[dict[str, Any]], header: int) -> int:
    """The sim's hit tokens if every earlier row's blocks were cached: the shared blocks and the chat template's
    header before them, in whole sim blocks, never the whole prompt (the last token is recomputed)."""
    parsed = [TraceRow(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]), 0) for r in rows]
    total = 0
    for row, shared in zip(parsed, shared_prefix_blocks(parsed), strict=True):
        tokens = min(header + min(shared * BLOCK, row.input_length), header + row.input_length - 1)
        total += tokens // SIM_BLOCK * SIM_BLOCK
    return total


def test_a_trace_replays_at_its_pace_with_its_prefix_sharing(start_sim, client, tmp_path: Path) -> None:
    sim = start_sim("--time-scale", "0.05")
    rows = mooncake_trace(sessions=8, turns=5, block_tokens=BLOCK, span_ms=5000, seed=3)
    for i, row in enumerate(rows):
        row["output_length"] = 90 + i  # longer than the sim's own answers: only min_tokens makes them this long
    write_trace(tmp_path / "shared.jsonl", rows)
    write_trace(tmp_path / "unshared.jsonl.gz", _unshared(rows))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "replay", "stages": [
        {"name": "shared", "kind": "replay", "trace": "shared.jsonl", "block_tokens": BLOCK, "users": 16,
         "duration_s": STAGE_S},
        {"name": "unshared", "kind": "replay", "trace": "unshared.jsonl.gz", "block_tokens": BLOCK, "users": 16,
         "duration_s": STAGE_S}]}))
    before = _counters(client, sim.base_url)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
           "--host", sim.base_url, "--k3-out", str(out), "--k3-plan", str(plan), "--k3-recipe",
           "recipes/local-dev.yaml", "--only-summary"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert (out / "verdict.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    after = _counters(client, sim.base_url)
    attempts = read_records(records_file(out))
    assert {a.family for a in attempts} == {"replay"}
    by_stage = {name: sorted((a for a in attempts if a.stage == name), key=lambda a: a.turn)
                for name in ("shared", "unshared")}
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    ends = {e["stage"]: e for e in events if e["event"] == "replay_end"}
    for name, played in by_stage.items():
        # every row sent once, at the trace's pace from the stage's entry: intended times keep the trace's gaps
        assert [a.turn for a in played] == list(range(len(rows))), name
        t0 = played[0].intended_send_ts - (rows[0]["timestamp"] - rows[0]["timestamp"]) / 1000
        assert [a.intended_send_ts - t0 for a in played] == \
            pytest.approx([(r["timestamp"] - rows[0]["timestamp"]) / 1000 for r in rows], abs=1e-6)
        assert all(a.send_ts >= a.intended_send_ts - 0.01 for a in played)
        late = sum(a.send_ts - a.intended_send_ts > 1.0 for a in played)
        end = ends[name]
        assert (end["rows_due"], end["rows_sent"], end["rows_not_played"], end["rows_late"]) == \
            (len(rows), len(rows), 0, late), end
        assert (end["fell_behind"] is None) == (late == 0), end
        assert end["min_tokens"] is True and end["rows_short"] == 0, end  # the sim honours min_tokens, as vLLM does
        assert end["tokenizer"] == "server /tokenize" and end["verified_tokens_min"] == \
            end["verified_tokens_max"] == BLOCK, end
        ok = [a for a in played if a.status == "ok"]
        assert len(ok) >= len(rows) - 2, [a.error for a in played if a.status != "ok"]
        # each prompt is its input_length through the sim's tokenizer, plus one constant chat template
        headers = {a.prompt_tokens - rows[a.turn]["input_length"] for a in ok}
        assert len(headers) == 1, headers
        assert all(a.completion_tokens == rows[a.turn]["output_length"] for a in ok)  # min_tokens honoured
    header = headers.pop()
    cached = {name: sum(a.cached_tokens or 0 for a in played) for name, played in by_stage.items()}
    predicted = _predicted_hits(rows, header)
    assert predicted > 0.3 * sum(r["input_length"] for r in rows)  # the trace shares a good part of its prompts
    # (above it by at most a sim block or two: where two rows' blocks part, their first words may agree by chance)
    assert 0.85 * predicted <= cached["shared"] <= predicted + 2 * SIM_BLOCK, (cached, predicted)
    assert cached["unshared"] <= 0.02 * predicted, cached  # the same rows without shared ids hit nothing
    # the sim's own counters moved by exactly what the records say they were served
    hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0)
    queries = after["vllm:prefix_cache_queries_total"] - before.get("vllm:prefix_cache_queries_total", 0)
    assert hits == cached["shared"] + cached["unshared"]
    assert queries == sum(a.prompt_tokens or 0 for a in attempts)
    stages = {s["stage"]: s for s in json.loads((out / "verdict.json").read_text())["pillars"]["resources"]
              ["numbers"]["stages"]}
    assert stages["shared"]["scheduled_turns"] == len(rows) and stages["shared"]["late_turns"] == ends["shared"][
        "rows_late"], stages["shared"]
    replayed = stages["shared"]["replay"]  # the replay_end facts in the stage's row
    assert (replayed["rows_due"], replayed["rows_sent"], replayed["rows_not_played"], replayed["tokenizer"]) == \
        (len(rows), len(rows), 0, ["server /tokenize"]), replayed
