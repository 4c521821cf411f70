"""GPU memory judged as vLLM uses it (analysis/pillars/headroom/gpu_growth.py, stages.gpu_breaches, pillar_resources):
each GPU
against its own start-up baseline, never against the card; and the sim's memory model it is rehearsed on."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from k3load.analysis.pillars.headroom.gpu_growth import (
    gpu_growth,
    memory_before,
    reservation_text,
    soak_creep,
    stage_figures,
)
from k3load.analysis.pillars.headroom.pillar_resources import _memory_evidence, gpu_memory_judgment
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.headroom.stages import gpu_breaches
from k3load.analysis.pillars.pillar import thresholds
from k3load.analysis.run.down_spells import DownSpell
from k3load.analysis.run.record_columns import RecordColumns
from k3load.analysis.run.rundata import RunData, StageWindow
from k3load.sim.config import ProfileError, SimConfig, validate
from k3load.sim.gpu_memory import GpuMemory
from k3load.sim.server import startup_kv_lines

CARD = 294_912.0  # a 288 GiB card
RESERVED = 0.95 * CARD + 1536  # vLLM at --gpu-memory-utilization 0.95, plus its CUDA context: 95.5% used
LIMITS = thresholds(None)["resources"]


def _rows(used: dict[float, float], gpu: int = 0) -> list[dict[str, Any]]:
    return [{"ts": ts, "source": "dcgm:n1", "node": "n1", "gpu": gpu, "uuid": f"GPU-{gpu}", "memory_used_mib": u,
             "memory_total_mib": CARD, "simulated": False} for ts, u in used.items()]


def _data(rows: list[dict[str, Any]], first_send: float = 10.0, stages: list[StageWindow] | None = None) -> RunData:
    data = RunData(path=Path("."), columns=RecordColumns.of([{"send_ts": first_send}, {"send_ts": first_send + 1}]))
    data.gpu = pd.DataFrame(rows)
    data.stages = stages or [StageWindow("load", "load", first_send, 1000.0, 4)]
    return data


def _stage(data: RunData, t0: float, t1: float, spells: list[DownSpell] | None = None) -> StageRow:
    return StageRow.of(stage="load", **stage_figures(gpu_growth(data, spells or []), t0, t1))


def test_vllms_flat_reservation_is_never_pressure() -> None:
    """95.5% used from the first reading to the last: 4.5% headroom, under the plan's 5%, and no problem."""
    data = _data(_rows({float(t): RESERVED for t in range(0, 100)}))
    stats = _stage(data, 10, 100)
    assert stats.gpu_headroom_min_pct < 5 and stats.gpu_baseline_headroom_min_pct < 5
    assert stats.gpu_growth_max_mib == 0 and gpu_breaches(stats, LIMITS) == []
    text = reservation_text(gpu_growth(data, []), {"gpu_memory_utilization": "0.95", "num_gpu_blocks": "8192"})
    assert text == ("reserved at start: 95.5% of each card, vLLM's --gpu-memory-utilization 0.95, 8,192 KV blocks; "
                    "judged on what the load added to it")


def test_growth_over_the_baseline_fails_with_the_gpu_and_share_named() -> None:
    free = CARD - RESERVED
    used = {float(t): RESERVED for t in range(0, 10)} | {float(t): RESERVED + 0.6 * free for t in range(10, 40)}
    data = _data(_rows(used) + _rows({float(t): RESERVED for t in range(0, 40)}, gpu=1))
    (problem, *rest) = gpu_breaches(_stage(data, 10, 40), LIMITS)
    assert problem.id == "resources.gpu_growth" and problem.signal == "resource"
    assert "grew 7,926 MiB over its start-up baseline on n1 GPU 0 (60% of what was free after start-up) > 50%" \
        in problem.reason
    assert [p.id for p in rest] == ["resources.gpu_jump"]  # 7,926 MiB at once, 5,284 left: another won't fit


def test_the_headroom_floor_judges_only_what_the_load_took_below_it() -> None:
    """A card 80% used after start-up that the load takes to 97% fails the 5% floor (and the growth); the same
    97% reached at start-up is a reservation."""
    loaded = _data(_rows({float(t): 0.8 * CARD if t < 10 else 0.97 * CARD for t in range(0, 40)}))
    ids = {p.id for p in gpu_breaches(_stage(loaded, 10, 40), LIMITS)}
    assert {"resources.gpu_headroom", "resources.gpu_growth"} <= ids
    reserved = _data(_rows({float(t): 0.97 * CARD for t in range(0, 40)}))
    assert gpu_breaches(_stage(reserved, 10, 40), LIMITS) == []


def test_a_jump_that_would_not_fit_again_fails_even_under_the_growth_limit() -> None:
    """A 4 GB step on a card with 6 GB free after start-up: 67% growth... with growth allowed to 90%, the
    jump rule still says another one would not fit in the 2 GB left."""
    used = {float(t): CARD - 6000 for t in range(0, 20)} | {float(t): CARD - 2000 for t in range(20, 40)}
    stats = _stage(_data(_rows(used)), 10, 40)
    (problem,) = gpu_breaches(stats, LIMITS | {"max_gpu_growth_pct": 90.0})
    assert problem.id == "resources.gpu_jump" and problem.measured == 2000 and problem.limit == 4000


def test_the_start_up_climb_is_no_jump_and_the_baseline_is_the_last_reading_before_load() -> None:
    """The sampler started with the server: it read the weights loading (0 to the reservation) before the first
    request. The baseline is the reservation just before load; the climb is neither growth nor a jump."""
    climb = {float(t): min(t * 40_000.0, RESERVED) for t in range(0, 10)} | {float(t): RESERVED for t in range(10, 30)}
    growth = gpu_growth(_data(_rows(climb), first_send=12.0), [])
    (baseline,) = growth.baselines
    assert baseline.used_mib == RESERVED and baseline.source == "before load"
    assert gpu_breaches(_stage(_data(_rows(climb), first_send=12.0), 12, 30), LIMITS) == []


def test_a_restart_starts_a_new_life_with_its_own_baseline() -> None:
    """Down at 40, back at 60 with the reservation taken again: a card empty while down and reserved again
    after is not growth; growth after the restart is judged against the new baseline."""
    used = ({float(t): RESERVED for t in range(0, 40)} | {float(t): 500.0 for t in range(40, 60)}
            | {float(t): RESERVED for t in range(60, 100)})
    spells = [DownSpell(40.0, 60.0, 0, 0, 0)]
    data = _data(_rows(used), stages=[StageWindow("soak", "soak", 10, 100, 4)])
    data.columns = RecordColumns.of([{"send_ts": 10.0}, {"send_ts": 70.0}])
    growth = gpu_growth(data, spells)
    assert [b.life_start_ts for b in growth.baselines] == [-math.inf, 60.0]
    assert all(b.used_mib == RESERVED for b in growth.baselines)
    stats = StageRow.of(stage="soak", **stage_figures(growth, 60, 100))
    assert stats.gpu_growth_max_mib == 0 and gpu_breaches(stats, LIMITS) == []


def test_a_soak_creep_is_projected_and_a_step_is_not_a_creep() -> None:
    free = CARD - RESERVED
    soak = [StageWindow("soak", "soak", 100, 1900, 4)]
    creep = {float(t): RESERVED + 2.0 * max(t - 100, 0) for t in range(0, 1900, 5)}  # 120 MiB/min through the soak
    data = _data(_rows(creep), first_send=100.0, stages=soak)
    found = soak_creep(gpu_growth(data, []), [(100, 1900)])
    assert found is not None and found.mib_per_min == pytest.approx(120) and found.r2 > 0.99
    assert found.runway_s == pytest.approx((free - 3600) / 2, rel=0.01)  # about 80 min left
    numbers, reasons, _ = gpu_memory_judgment(data, gpu_growth(data, []), LIMITS)
    assert numbers["creep"]["runway_s"] == pytest.approx(found.runway_s)
    (reason,) = reasons
    assert reason.startswith("GPU memory creeps 120 MiB/min on n1 GPU 0 through the soak")
    assert "out of memory in 80 min" in reason and "under the 24 h runway required (min_gpu_runway_h)" in reason
    step = {float(t): RESERVED + (2000.0 if t >= 1000 else 0.0) for t in range(0, 1900, 5)}
    assert soak_creep(gpu_growth(_data(_rows(step), first_send=100.0, stages=soak), []), [(100, 1900)]) is None
    slow = {float(t): RESERVED + 0.01 * max(t - 100, 0) for t in range(0, 1900, 5)}  # 18 MiB in 30 min: noise
    assert soak_creep(gpu_growth(_data(_rows(slow), first_send=100.0, stages=soak), []), [(100, 1900)]) is None


def test_a_gentle_creep_is_said_with_the_pass_and_no_soak_means_not_judged() -> None:
    soak = [StageWindow("soak", "soak", 100, 1900, 4)]
    gentle = {float(t): RESERVED + 0.1 * max(t - 100, 0) for t in range(0, 1900, 5)}  # 6 MiB/min: days of runway
    data = _data(_rows(gentle), first_send=100.0, stages=soak)
    _, reasons, notes = gpu_memory_judgment(data, gpu_growth(data, []), LIMITS)
    assert reasons == [] and any(n.startswith("GPU memory creeps 6 MiB/min") for n in notes)
    no_soak = _data(_rows(gentle), first_send=100.0)
    _, reasons, notes = gpu_memory_judgment(no_soak, gpu_growth(no_soak, []), LIMITS)
    assert reasons == [] and "GPU memory creep not judged: no soak stage ran" in notes


def test_a_crash_has_memory_evidence_from_growth_never_from_the_reservation() -> None:
    free = CARD - RESERVED
    flat = gpu_growth(_data(_rows({float(t): RESERVED for t in range(0, 60)})), [])
    assert _memory_evidence(False, flat, 50.0, 50.0) is None and memory_before(flat, 50.0)["growth_mib"] == 0
    assert _memory_evidence(True, flat, 50.0, 50.0) == "OOM line in the server log"
    grown = gpu_growth(_data(_rows({float(t): RESERVED + (0.8 * free if t > 30 else 0) for t in range(0, 60)})), [])
    assert "grew 10,568 MiB over its start-up baseline on n1 GPU 0 (80%" in _memory_evidence(False, grown, 50.0, 50.0)
    assert memory_before(grown, 50.0)["free_min_mib"] == pytest.approx(0.2 * free)


def test_the_sims_memory_is_the_reservation_whatever_the_kv_fill() -> None:
    config = SimConfig(gpu_memory_utilization=0.95)
    memory = GpuMemory(config)
    assert memory.used_mib / memory.total_mib == pytest.approx(0.955, abs=0.001)
    config.faults.prefill_spike_mib_per_1k_tokens = 2000
    assert memory.prefill(4000) is None and memory.prefill(2000) is None  # 8 GB kept by the allocator, then reused
    assert memory.used_mib == pytest.approx(RESERVED + 8000)
    oom = memory.prefill(4000 + 3000)
    assert oom is not None and oom.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    config.faults.gpu_memory_creep_mib_per_s = 100
    memory = GpuMemory(config, serving_since=0.0)
    assert memory.creep_to(10.0) is None and memory.crept_mib == 1000
    assert "creeping" in (memory.creep_to(1000.0) or "")


@pytest.mark.parametrize("changes", [{"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.2},
                                     {"weights_mib_per_gpu": 290_000}, {"gpu_context_mib": 20_000}])
def test_a_memory_the_engine_could_not_start_with_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ProfileError):
        validate(SimConfig(**{"gpu_memory_utilization": 0.95} | changes))


def test_the_reason_quotes_what_vllm_said_it_reserved() -> None:
    """The start-up log's KV lines, as vLLM writes them (and the sim prints them), join cache_config_info's labels."""
    log = "\n".join(startup_kv_lines(SimConfig(gpu_memory_utilization=0.95)))
    growth = gpu_growth(_data(_rows({float(t): RESERVED for t in range(0, 20)})), [])
    text = reservation_text(growth, {"gpu_memory_utilization": "0.95"}, log)
    assert text is not None and text.startswith("reserved at start: 95.5% of each card, vLLM's "
                                                "--gpu-memory-utilization 0.95 (the start-up log says KV cache "
                                                "memory 1.07 GiB, GPU KV cache size 131,072 tokens)")
    assert "vllm:cache_config_info not scraped" in (reservation_text(growth, {}) or "")


def test_a_card_emptied_and_filled_again_is_no_jump() -> None:
    """NVML watches a restart the sampler did not see as a down spell (the card emptied, then the reservation taken
    again): the climb back to the baseline is no jump and no growth; a rise above it still is."""
    used = ({float(t): RESERVED for t in range(0, 20)} | {20.0: 500.0, 21.0: 120_000.0}
            | {float(t): RESERVED for t in range(22, 40)})
    stats = _stage(_data(_rows(used)), 10, 40)
    assert stats.gpu_largest_jump_mib == 0 and gpu_breaches(stats, LIMITS) == []
    used[30.0] = RESERVED + 3000
    assert _stage(_data(_rows(used)), 10, 40).gpu_largest_jump_mib == 3000


def test_a_baseline_taken_under_load_is_said_as_such() -> None:
    """The sampler started after the load did (no reading before the first request): the baseline is the first
    readings, and the reason says growth before them is unseen, rather than implying a clean start."""
    growth = gpu_growth(_data(_rows({float(t): RESERVED for t in range(20, 40)}), first_send=10.0), [])
    assert growth.baselines[0].source == "first readings"
    assert "growth before them is unseen" in (reservation_text(growth, {}) or "")
    before = gpu_growth(_data(_rows({float(t): RESERVED for t in range(0, 40)}), first_send=10.0), [])
    assert "unseen" not in (reservation_text(before, {}) or "")


def test_a_servers_odd_cache_labels_never_reach_the_reason_as_they_are() -> None:
    growth = gpu_growth(_data(_rows({float(t): RESERVED for t in range(0, 20)})), [])
    odd = reservation_text(growth, {"gpu_memory_utilization": "<b>" + "x" * 10**5, "num_gpu_blocks": "9" * 40})
    assert odd is not None and "<b>" not in odd and "vllm:cache_config_info not scraped" in odd and len(odd) < 300
    assert "--gpu-memory-utilization 0.95;" in (reservation_text(growth, {"gpu_memory_utilization": "0.95"}) or "")
