"""The run's GPU memory curve (analysis/run/gpu_memory.py): every GPU once per sampling round, whichever
sources read it and whenever each stamped its reading; first on readings taken on a real H200."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pandas as pd

from k3load.analysis.pillars.headroom import pillar_resources
from k3load.analysis.pillars.headroom.gpu_growth import gpu_growth
from k3load.analysis.run.gpu_memory import STALE_INTERVALS, gpu_identity, memory_curve, sampling_round_s
from k3load.analysis.run.rundata import RunData

H200 = Path(__file__).parents[1] / "data" / "gpu" / "h200-beside-sim-gpu.jsonl.gz"
ALLOCATED = [(1796403639.29, 8192.0), (1796403654.30, 16384.0), (1796403669.30, 24576.0), (1796403684.31, 0.0)]


def _h200() -> pd.DataFrame:
    return pd.DataFrame([json.loads(line) for line in gzip.decompress(H200.read_bytes()).splitlines()])


def _row(ts: float, source: str, gpu: int, used: float, total: float = 1000.0, uuid: str | None = None,
         node: str = "n1") -> dict[str, Any]:
    return {"ts": ts, "source": source, "node": node, "gpu": gpu, "uuid": uuid, "memory_used_mib": used,
            "memory_total_mib": total}


def test_on_an_h200_beside_the_sims_exporter_every_round_holds_all_nine_gpus() -> None:
    gpu = _h200()
    sim = gpu[gpu["source"] != "nvml"]
    assert sorted(gpu["source"].unique())[1] == "nvml" and len(gpu_identity(gpu).unique()) == 9
    assert (gpu.groupby("ts")["source"].nunique() == 1).all()  # no two sources ever share a ts
    assert abs(sampling_round_s(gpu) - 1.0) < 0.01
    curve = memory_curve(gpu, float(gpu["ts"].min()), float(gpu["ts"].max()))
    assert len(curve) >= 78 and (curve["gpus"] == 9).all()
    # each round is the sim's eight GPUs plus the H200: the H200's part steps with the allocations
    sim_part = sim.groupby("ts")["memory_used_mib"].sum()
    assert sim_part.between(8 * 184_320, 8 * 184_600).all()
    h200_part = [used - float(sim_part[sim_part.index <= ts].iloc[-1]) for ts, used
                 in zip(curve["ts"], curve["memory_used_mib"], strict=True) if ts > sim_part.index.min()]
    assert min(h200_part) > 500 and max(h200_part) < 26_000
    for at, held in ALLOCATED:
        later = curve[(curve["ts"] > at + 1.5) & (curve["ts"] < at + 10)]
        nvml = gpu[(gpu["source"] == "nvml") & (gpu["ts"] > at + 1.5) & (gpu["ts"] < at + 10)]
        assert len(later) and nvml["memory_used_mib"].between(held + 600, held + 1300).all(), (at, held)
    # the curve is smooth: no point jumps between the two sources' totals as a sum per ts did
    jumps = (curve["memory_used_mib"].pct_change().abs().dropna())
    per_ts = gpu.groupby("ts")["memory_used_mib"].sum()
    assert jumps.max() < 0.02 and per_ts.max() / per_ts.min() > 50  # the largest real step: 24 GiB freed
    total = curve["memory_total_mib"].iloc[-1]
    assert total == 8 * 294_912 + 143_771


def test_one_gpu_read_by_two_sources_counts_once_and_nodes_read_apart_add_up() -> None:
    rows = []
    for r in range(5):
        t = 100.0 + r
        rows += [_row(t + 0.001, "nvml", 0, 300 + r, uuid="GPU-a"),
                 _row(t + 0.020, "dcgm:n1", 0, 301 + r, uuid="GPU-a"),  # the same GPU, through its exporter
                 _row(t + 0.040, "dcgm:n2", 0, 500, uuid="GPU-b", node="n2"),
                 _row(t + 0.060, "dcgm:n2", 1, 600, uuid=None, node="n2")]  # no UUID: source, node, index
    curve = memory_curve(pd.DataFrame(rows), 100.0, 105.0)
    assert list(curve["gpus"]) == [3] * 5
    assert list(curve["memory_used_mib"]) == [301 + r + 500 + 600 for r in range(5)]  # the round's last reading
    assert list(curve["memory_total_mib"]) == [3000.0] * 5
    assert list(curve["ts"]) == [100.06 + r for r in range(5)]


def test_a_gpu_missed_in_a_round_keeps_its_reading_for_a_while_then_is_gone() -> None:
    rows = [_row(10.0 + r, "dcgm:n1", 0, 100) for r in range(10)]
    rows += [_row(10.5 + r, "dcgm:n2", 0, 50, node="n2") for r in (0, 1)]  # n2 answers twice, then never
    curve = memory_curve(pd.DataFrame(rows), 10.0, 20.0, round_s=1.0)
    assert list(curve["gpus"]) == [2, 2] + [2] * STALE_INTERVALS + [1] * (8 - STALE_INTERVALS)
    assert list(curve["memory_used_mib"][:4]) == [150, 150, 150, 150]


def test_a_slow_exporter_beside_nvml_stays_in_every_round_until_it_stops() -> None:
    """dcgm-exporter answering every 4 s beside NVML's 1 s: its GPUs hold their readings between its
    answers (the sum never dips as if memory were freed), and go two of its own intervals after its last."""
    rows = [_row(100.01 + r, "nvml", 0, 100, uuid="GPU-n") for r in range(40)]
    rows += [_row(100.5 + r, "dcgm:n2", g, 500, uuid=f"GPU-d{g}", node="n2") for r in range(0, 24, 4) for g in (0, 1)]
    curve = memory_curve(pd.DataFrame(rows), 100.0, 140.0)
    assert list(curve["gpus"]) == [3] * 29 + [1] * 11  # last read at 120.5: carried to 128.5
    assert set(curve["memory_used_mib"][:29]) == {1100.0}


def test_no_readings_give_an_empty_curve() -> None:
    assert memory_curve(pd.DataFrame(), 0, 10).empty
    rows = pd.DataFrame([_row(1.0, "nvml", 0, None)])
    assert memory_curve(rows, 0, 10).empty


def test_a_crash_reads_the_memory_of_every_gpu_before_it(tmp_path: Path) -> None:
    """The crash's curve and its memory evidence on the H200 readings: all nine GPUs each second."""
    data = RunData(path=tmp_path)
    data.gpu = _h200()
    crash = 1796403680.0
    curve = pillar_resources._memory_curve(data, crash, span_s=10)
    assert len(curve) >= 19 and all(c["memory_used_mib"] > 8 * 184_320 + 25_000 for c in curve if -8 < c["t_rel_s"] < 4)
    growth = gpu_growth(data, [])
    # the H200 grew 25 GB over its first readings (18% of what was free): evidence under a 10% limit only;
    # the sim's eight cards at their flat 62% are no evidence whatever the limit
    evidence = pillar_resources._memory_evidence(False, growth, crash, growth_limit_pct=10.0)
    assert evidence is not None and "grew 25195 MiB over its start-up baseline on vm GPU 0" in evidence.replace(",", "")
    assert pillar_resources._memory_evidence(False, growth, crash, growth_limit_pct=50.0) is None
