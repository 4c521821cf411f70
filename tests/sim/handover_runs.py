"""The hand-made run directories of the hand-over tests (test_handover.py): a plan, its stage events, vLLM
0.32's real /metrics capture (tests/data/wire) with each stage's KV usage and queue, dcgm-exporter rows of a
reserved node, and answered records, written as a Locust run would leave them so `analyze()` judges them as
after a real run. Also the lookup of the real `promtool` / `prometheus` binaries (skip here, fail on CI)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3load.records import Attempt
from k3load.sampler.prom import parse
from k3load.workload.plan import parse_plan
from tests.probes import WIRE

THRESHOLDS = {"slo": {"ttft_p95_ms": 2500, "itl_p95_ms": 200, "e2e_p95_ms": 45000},
              "resources": {"max_kv_usage": 0.95, "max_preemptions_per_min": 3, "min_gpu_headroom_pct": 8}}
LONG = {"name": "long-input", "kind": "long_input", "duration_s": 4, "users": 1, "mix": {"long_input": 1}}
LOAD = {"name": "load", "kind": "load", "duration_s": 4, "users": 1, "mix": {"agent": 1}}


def _steps(*users: int) -> dict[str, Any]:
    return {"name": "concurrency", "kind": "concurrency", "duration_s": 4, "steps": list(users), "mix": {"agent": 1}}


# name: (plan stages, KV usage per stage, prompt tokens of the answered requests per stage)
RUNS = {
    "held": ([LONG, _steps(2, 4)], {"long-input": 0.31, "concurrency-c2": 0.38, "concurrency-c4": 0.4231},
             {"long-input": [1500, 1800]}),
    "limited": ([LONG, _steps(2, 4, 8)], {"long-input": 0.3, "concurrency-c2": 0.35, "concurrency-c4": 0.5512,
                                          "concurrency-c8": 0.99}, {"long-input": [2400]}),
    "unloaded": ([LOAD, _steps(2, 4)], {"load": 0.0, "concurrency-c2": 0.99, "concurrency-c4": 0.99},
                 {"load": [None]}),
}


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail(f"{name} is missing on CI: `make test` installs Debian's prometheus (it ships promtool)")
    pytest.skip(f"{name} is not installed here (make prometheus installs Debian's prometheus, with promtool)")


def _attempt(stage: str, n: int, ts: float, prompt: int | None) -> str:
    return Attempt(run_id="r", attempt_id=f"{stage}-{n}", chain_id=f"{stage}-{n}", attempt=1, stage=stage,
                   scenario="s", family="agent", turn=0, turn_kind="answer", user_id="u", request_sha256="x",
                   prefix_sha256="y", transport="stream", status="ok", send_ts=ts, end_ts=ts + 0.5, ttft_ms=100.0,
                   e2e_ms=500.0, prompt_tokens=prompt, completion_tokens=8).to_json()


def _scrape(base: dict[str, float | None], ts: float, kv: float, running: int) -> str:
    """vLLM 0.32's real exposition (tests/data/wire), with this moment's KV usage and queue."""
    samples = {k: (kv if k.startswith("vllm:kv_cache_usage_perc{") else running
                   if k.startswith("vllm:num_requests_running{") else 0.0
                   if k.startswith("vllm:num_requests_waiting{") else v) for k, v in base.items()}
    return json.dumps({"ts": ts, "ok": True, "vllm_series": len(samples), "samples": samples})


CARD_MIB, RESERVED_MIB = 294_912.0, 281_702.0  # a 288 GiB card at vLLM's 0.95 plus its CUDA context: 95.5% used


def _reserved(t0: float, t1: float) -> list[dict[str, Any]]:
    """Two GPUs as dcgm-exporter shows a healthy vLLM node: the start-up reservation, flat every second."""
    return [{"ts": float(ts), "source": "dcgm:http://gpu-node-1:9400/metrics", "node": "gpu-node-1", "gpu": g,
             "uuid": f"GPU-{g}", "memory_used_mib": RESERVED_MIB, "memory_total_mib": CARD_MIB,
             "memory_free_mib": CARD_MIB - RESERVED_MIB, "simulated": False} for ts in range(int(t0) - 3, int(t1) + 1)
            for g in (0, 1)]


def _write_run(run: Path, raw_stages: list[dict[str, Any]], kv: dict[str, float],
               prompts: dict[str, list[int | None]]) -> None:
    base = parse((WIRE / "metrics_end.txt").read_text()).samples
    plan = {"name": run.name, "stages": raw_stages, "thresholds": THRESHOLDS}
    run.mkdir()
    (run / "plan.yaml").write_text(yaml.safe_dump(plan))
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "model": "tiny", "started_ts": 1000}))
    events, metrics, records = [], [], []
    for stage in parse_plan(plan, "plan").stages:
        t0 = 1000 + stage.start_s
        events.append({"ts": t0, "event": "stage_start", "stage": stage.name, "kind": stage.kind, "users": stage.users})
        metrics += [_scrape(base, t0 + s + 0.5, kv[stage.name], stage.users) for s in range(int(stage.duration_s))]
        records += [_attempt(stage.name, n, t0 + 1 + n, p) for n, p in enumerate(prompts.get(stage.name, []))]
    end = 1000 + parse_plan(plan, "plan").duration_s
    events.append({"ts": end, "event": "run_end"})
    (run / "gpu.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _reserved(1000, end)))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(m + "\n" for m in metrics))
    (run / "records.jsonl").write_text("".join(r + "\n" for r in records))
