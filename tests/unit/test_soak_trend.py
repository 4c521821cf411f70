"""A long soak reported by window, each figure's trend judged (issue 31, item 4), on the stored scale run with its
soak stretched to 30 minutes (bench/scale_run.py), as a run writes it: five whole windows of five minutes."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import numpy as np

from k3load.analysis.analyze import analyze
from k3load.analysis.outputs.soak_panels import soak_panels
from k3load.analysis.pillars.headroom.soak_trend import FIGURES, MIN_WINDOWS, _t99, fit, trend
from k3load.evidence import records_file
from tests.sim.scale_run import _unpack
from tests.sim.test_analysis_scale import _bench as bench

SOAK_S = 1800.0


def _stretched(tmp_path: Path) -> Path:
    run = tmp_path / "long"
    # 12 copies of the stored run's records spread over the soak: about two in each window
    assert bench().build_run(_unpack(tmp_path / "src"), run, 13 * 743, SOAK_S) == 13 * 743
    return run


def _soak(run: Path) -> tuple[str, float]:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e.get("event") == "stage_start" and e.get("kind") == "soak")
    return start["stage"], start["ts"]


def _creep(run: Path, ms_per_h: float) -> None:
    """Every soak answer's TTFT and TTFA later by `ms_per_h` per hour into the soak (a server slowing down)."""
    name, t0 = _soak(run)
    path = records_file(run)
    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    for row in rows:
        if row["stage"] == name:
            late = (row["send_ts"] - t0) / 3600 * ms_per_h
            for key in ("ttft_ms", "ttfa_ms"):
                if row.get(key) is not None:
                    row[key] += late
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))


def _resources(run: Path) -> dict:
    analyze(run)
    return json.loads((run / "verdict.json").read_text())["pillars"]["resources"]


def test_the_line_and_its_interval_are_least_squares_with_students_t():
    rng = random.Random(7)
    hours = [i / 12 for i in range(12)]
    values = [400 + 300 * h + rng.gauss(0, 20) for h in hours]
    slope, (low, high), r2, intercept = fit(hours, values)
    (ref_slope, ref_intercept), cov = np.polyfit(hours, values, 1, cov=True)
    assert math.isclose(slope, ref_slope) and math.isclose(intercept, ref_intercept)
    assert math.isclose((high - low) / 2, _t99(10) * math.sqrt(cov[0][0]), rel_tol=1e-9)
    assert low < 300 < high and r2 > 0.9
    assert fit(hours[:MIN_WINDOWS - 1], values[:MIN_WINDOWS - 1]) is None and fit([1, 1, 1], [1, 2, 3]) is None
    ttft = FIGURES[0]
    # the cautious slope: about 240 ms/h from ~3.6 s at the end, 3 s limit already passed; 10 s within 24 h
    assert trend(ttft, hours, values, 1.0, 600.0, 24.0).crosses_in_h == 0.0
    later = trend(ttft, hours, values, 1.0, 5000.0, 24.0)
    assert later.crosses_in_h is not None and 0 < later.crosses_in_h < 24
    assert trend(ttft, hours, values, 1.0, 1e6, 24.0).crosses_in_h is None  # past the horizon
    flat = [400 + rng.gauss(0, 20) for _ in hours]
    assert trend(ttft, hours, flat, 1.0, 3000.0, 24.0).crosses_in_h is None  # no clear rise: nothing named
    assert trend(ttft, hours, flat, 1.0, 300.0, 24.0).crosses_in_h is None  # over, but flat: the stage row's to say


def test_a_long_soak_is_cut_in_windows_and_a_creeping_ttft_is_named_with_when_it_crosses(tmp_path):
    run = _stretched(tmp_path)
    steady = _resources(run)
    (soak,) = steady["numbers"]["soak_windows"]
    # whole windows of the load time (the soak's users stopped a moment before its 1,800 s): five
    assert soak["window_s"] == 300.0 and len(soak["windows"]) == 5 and soak["horizon_h"] == 24.0
    assert [w["offset_s"] for w in soak["windows"]] == [i * 300.0 for i in range(5)]
    assert all(w["attempts"] > 0 and w["ttft_p95_ms"] is not None for w in soak["windows"])
    assert set(soak["trends"]) >= {"ttft_p95_ms", "error_rate", "kv_usage_max"}
    assert not [r for r in steady["reasons"] if r.startswith("soak ")], steady["reasons"]

    _creep(run, 2000.0)  # 2 s an hour: past the 3 s SLO well within a day
    creeping = _resources(run)
    said = [r for r in creeping["reasons"] if r.startswith(f"soak {soak['stage']}: TTFT p95 moves +")]
    assert len(said) == 1 and "it reaches slo.ttft_p95_ms (3,000 ms) " in said[0] and \
        "after the soak's end, within the 24 h horizon (resources.soak_horizon_h;" in said[0], creeping["reasons"]
    ttft = creeping["numbers"]["soak_windows"][0]["trends"]["ttft_p95_ms"]
    assert 1000 < ttft["slope_ci99"][0] <= ttft["slope_per_h"] <= ttft["slope_ci99"][1] and ttft["crosses_in_h"] < 24
    assert creeping["status"] == "fail"
    _the_plot_draws_the_windows_and_the_judged_trends(run, creeping["numbers"]["soak_windows"][0])


def _the_plot_draws_the_windows_and_the_judged_trends(run: Path, soak: dict) -> None:
    """The report's soak plot, panel by panel: each window's figure at its midpoint, the judged line through them
    (ending at the trend's value at the soak's end, with its slope), red where it reaches its limit, the limit."""
    panels = {p.ylabel: p for p in soak_panels(soak)}
    latency = panels["ms (p95)"]
    ttft = next(s for s in latency.series if s.key == "ttft_p95_ms")
    assert ttft.x == [(i * 300 + 150) / 3600 for i in range(5)]
    assert ttft.y == [w["ttft_p95_ms"] for w in soak["windows"]]
    line = next(t for t in latency.trends if t.key == "ttft_p95_ms")
    found = soak["trends"]["ttft_p95_ms"]
    assert line.x == (ttft.x[0], 5 * 300 / 3600) and math.isclose(line.y[1], found["fitted_at_end"])
    assert math.isclose((line.y[1] - line.y[0]) / (line.x[1] - line.x[0]), found["slope_per_h"])
    assert line.rising_to_limit and ("TTFT p95 limit", 3000.0) in latency.limits
    errors = panels["error rate"].series[0]
    assert errors.band == ([w["error_rate_ci95"][0] for w in soak["windows"]],
                           [w["error_rate_ci95"][1] for w in soak["windows"]])
    assert f'alt="soak_{soak["stage"]}"' in (run / "report.html").read_text()  # drawn into the report
    assert soak_panels({"stage": "s", "window_s": 300.0, "windows": [], "trends": {}}) == []


def test_a_short_soak_has_no_windows(tmp_path):
    run = _unpack(tmp_path / "run")
    assert "soak_windows" not in _resources(run)["numbers"]


def test_a_tiny_window_is_widened_to_at_most_max_windows(tmp_path, monkeypatch):
    """A plan may set soak_window_s to a hundredth of a second: a day's soak would be millions of windows; the
    window widens so the soak has at most MAX_WINDOWS, and the entry says the width used."""
    import k3load.analysis.pillars.headroom.soak_trend as soak_trend

    monkeypatch.setattr(soak_trend, "MAX_WINDOWS", 100)
    run = _stretched(tmp_path)
    plan = run / "plan.yaml"
    text = plan.read_text().replace("stages:", "thresholds:\n  resources:\n    soak_window_s: 0.01\nstages:", 1)
    plan.write_text(text)
    (soak,) = _resources(run)["numbers"]["soak_windows"]
    assert len(soak["windows"]) == 100 and 17 < soak["window_s"] < 18.1  # not the default's 5 of 300 s
