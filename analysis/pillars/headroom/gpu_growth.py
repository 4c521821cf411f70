"""GPU memory judged as vLLM uses it: what the load adds to each card's start-up baseline, never the reservation.

Why a baseline: vLLM reserves its whole KV pool at start-up. `Worker.determine_available_memory`
(vllm/v1/worker/gpu_worker.py) sizes the pool so the process holds `--gpu-memory-utilization` of each
card (default 0.9, the K3 recipe's 0.95); NVML and dcgm-exporter show that from the first scrape, flat
under any load, and the cache's own fill shows only in `vllm:kv_cache_usage_perc`
(../shared/notes/production-facts.md). Judged against the card, every healthy K3 node would read as out
of headroom ("4.5% < 5%": buy GPUs). What does move "used" is memory outside the pool: a prefill larger
than the profiled one (PyTorch's caching allocator then keeps the high-water mark: a step that stays),
CUDA graphs captured late, fragmentation, a leak. So each GPU is measured against itself:

- its **baseline**: the last readings before the first request of each server life (the idle readings
  the sampler took after start-up: the run's scrapes before its first stage, or `k3load sample`'s
  before traffic), else its first readings; a restart (a down spell
  that is not a health-check flap) starts a new life with a new baseline, as the restarted engine
  reserves its pool again;
- **growth**: a reading's use over its baseline, in MiB and as a share of what was free at the baseline;
- the **largest jump**: the largest rise between two successive readings of one GPU (a transient the
  allocator kept); the free memory left at a peak must still hold one more as large;
- the **creep**: the trend through the soak (steady load), its first fifth left out while the allocator
  reaches the mix's high-water mark; a clear trend (a line that explains >= 90% of the variance, a rise
  above the readings' noise) is projected to when the free memory would be gone.

Readings shorter-lived than the sampling interval are not seen: an OOM line in the server log is the
evidence there (pillar_resources).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from k3load.analysis.run.down_spells import DownSpell
from k3load.analysis.run.gpu_memory import gpu_identity
from k3load.analysis.run.rundata import RunData

GPU_NOISE_MIB = 64.0  # whole-MiB readings, NVML's own context and allocator rounding stay under it
BASELINE_READINGS = 3
CREEP_MIN_READINGS = 6
CREEP_MIN_R2 = 0.9  # a single step in the middle of the soak fits a line at R² 0.75: not a creep
CREEP_SKIP_SHARE = 0.2


@dataclass(frozen=True)
class Baseline:
    """One GPU's use after start-up, in one server life."""

    gpu: str
    life_start_ts: float
    used_mib: float
    total_mib: float
    source: str  # "before load" (readings before the life's first request) or "first readings" (load already on)

    @property
    def free_mib(self) -> float:
        return max(self.total_mib - self.used_mib, 0.0)

    @property
    def used_share(self) -> float:
        return self.used_mib / self.total_mib if self.total_mib else math.nan


@dataclass(frozen=True)
class Creep:
    """The steepest clear trend of one GPU's use through the soak."""

    gpu: str
    mib_per_min: float
    r2: float
    readings: int
    span_s: float
    free_mib_at_end: float

    @property
    def runway_s(self) -> float:
        return self.free_mib_at_end / (self.mib_per_min / 60) if self.mib_per_min > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"runway_s": None if math.isinf(self.runway_s) else self.runway_s}


@dataclass
class GpuGrowth:
    """Every reading with its GPU, life and growth; computed once per run, read by each stage and crash."""

    readings: pd.DataFrame  # ts, gpu, label, used, total, growth_mib, base_free_mib, base_used_mib, jump_mib
    baselines: list[Baseline]
    simulated: bool

    @property
    def empty(self) -> bool:
        return bool(self.readings.empty)

    def window(self, t0: float, t1: float) -> pd.DataFrame:
        r = self.readings
        return r[(r["ts"] >= t0) & (r["ts"] <= t1)]


def gpu_label(gpu: pd.DataFrame) -> pd.Series:
    node = gpu["node"].astype(str) if "node" in gpu else pd.Series("", index=gpu.index)
    index = gpu["gpu"].astype(str) if "gpu" in gpu else pd.Series("?", index=gpu.index)
    return ("GPU " + index).where(node.isin(["", "None", "nan"]), node + " GPU " + index)


def _lives(spells: list[DownSpell]) -> list[float]:
    """Each server life's start: the run's start, then every return from a real down (not a flap)."""
    return [-math.inf, *sorted(s.up_ts for s in spells if not s.flap and s.up_ts is not None)]


def _baseline(rows: pd.DataFrame, first_request: float | None) -> tuple[float, str, pd.Series] | None:
    """(used MiB, how it was found, which readings come after it: only those can jump)."""
    if first_request is not None and (rows["ts"] < first_request).any():
        before = rows[rows["ts"] < first_request]
        return float(before["used"].tail(BASELINE_READINGS).median()), "before load", rows["ts"] >= first_request
    if len(rows):
        after = pd.Series(np.arange(len(rows)) >= BASELINE_READINGS, index=rows.index)
        return float(rows["used"].head(BASELINE_READINGS).median()), "first readings", after
    return None


def gpu_growth(data: RunData, spells: list[DownSpell]) -> GpuGrowth:
    """Each reading against its GPU's baseline in its server life."""
    gpu = data.gpu
    if gpu.empty or "memory_used_mib" not in gpu or "memory_total_mib" not in gpu:
        return GpuGrowth(pd.DataFrame(columns=["ts", "gpu", "label", "used", "total"]), [], False)
    known = gpu[gpu["memory_used_mib"].notna() & gpu["memory_total_mib"].notna()]
    table = pd.DataFrame({"ts": known["ts"].astype(float), "gpu": gpu_identity(known), "label": gpu_label(known),
                          "used": known["memory_used_mib"].astype(float),
                          "total": known["memory_total_mib"].astype(float)}).sort_values("ts", kind="mergesort")
    starts = _lives(spells)
    table["life"] = np.searchsorted(np.array(starts[1:]), table["ts"].to_numpy(), side="right")
    sends = data.columns.array("send_ts")
    sends = np.sort(sends[~np.isnan(sends)])
    baselines, parts = [], []
    for (life, name), rows in table.groupby(["life", "gpu"], sort=True):
        later = sends[sends >= starts[life]]
        found = _baseline(rows, float(later[0]) if len(later) else None)
        if found is None:
            continue
        used, source, after = found
        total = float(rows["total"].iloc[0])
        baselines.append(Baseline(str(name), starts[life], used, total, source))
        # from the last baseline reading on: the step into load counts, start-up's own climb does not; and only
        # the part above the baseline: a card emptied and filled again (a restart NVML watched) climbs back to
        # the reservation, which is no jump
        since = after | after.shift(-1, fill_value=False)
        level = rows["used"][since]
        jump = (level - level.shift(1).clip(lower=used)).clip(lower=0.0).reindex(rows.index).fillna(0.0)
        parts.append(rows.assign(base_used_mib=used, base_free_mib=max(total - used, 0.0),
                                 growth_mib=rows["used"] - used, jump_mib=jump))
    readings = pd.concat(parts).sort_values("ts", kind="mergesort") if parts else table.iloc[0:0]
    simulated = bool(gpu["simulated"].fillna(False).astype(bool).any()) if "simulated" in gpu else False
    return GpuGrowth(readings, baselines, simulated)


def stage_figures(growth: GpuGrowth, t0: float, t1: float) -> dict[str, Any]:
    """The stage's GPU memory, as stage_stats carries it: peak and headroom as read, and what the load added."""
    rows = growth.window(t0, t1)
    if rows.empty:
        return dict.fromkeys(("gpu_memory_peak_mib", "gpu_headroom_min_pct", "gpu_baseline_headroom_min_pct",
                              "gpu_growth_max_mib", "gpu_growth_max_pct", "gpu_growth_gpu", "gpu_free_min_mib",
                              "gpu_free_min_gpu", "gpu_largest_jump_mib", "gpu_simulated"))
    share = rows["growth_mib"] / rows["base_free_mib"].clip(lower=1.0) * 100
    worst = share.idxmax()
    free = rows["total"] - rows["used"]
    tightest = free.idxmin()
    so_far = growth.readings[growth.readings["ts"] <= t1]  # the largest jump seen up to the stage's end
    return {"gpu_memory_peak_mib": float(rows["used"].max()),
            "gpu_headroom_min_pct": float((free / rows["total"]).min() * 100),
            "gpu_baseline_headroom_min_pct": float((rows["base_free_mib"] / rows["total"]).min() * 100),
            "gpu_growth_max_mib": float(rows["growth_mib"].max()),
            "gpu_growth_max_pct": float(share.max()), "gpu_growth_gpu": str(rows.at[worst, "label"]),
            "gpu_free_min_mib": float(free.min()), "gpu_free_min_gpu": str(rows.at[tightest, "label"]),
            "gpu_largest_jump_mib": float(so_far["jump_mib"].max()) if len(so_far) else None,
            "gpu_simulated": growth.simulated}


def _fit(rows: pd.DataFrame) -> tuple[float, float]:
    """Least-squares slope (MiB/s) and R² of one GPU's readings."""
    t = rows["ts"].to_numpy() - float(rows["ts"].iloc[0])
    y = rows["used"].to_numpy()
    if np.ptp(t) <= 0:
        return 0.0, 0.0
    slope, intercept = np.polyfit(t, y, 1)
    residual = float(((y - (slope * t + intercept)) ** 2).sum())
    spread = float(((y - y.mean()) ** 2).sum())
    return float(slope), (1.0 - residual / spread) if spread > 0 else 0.0


def soak_creep(growth: GpuGrowth, soaks: list[tuple[float, float]]) -> Creep | None:
    """The steepest clear creep of any GPU through the soak stages (their first fifth left out); None: none."""
    if growth.empty or not soaks:
        return None
    mask = pd.Series(False, index=growth.readings.index)
    for t0, t1 in soaks:
        mask |= (growth.readings["ts"] >= t0 + (t1 - t0) * CREEP_SKIP_SHARE) & (growth.readings["ts"] <= t1)
    found = None
    for (_, _), rows in growth.readings[mask].groupby(["life", "gpu"], sort=True):
        if len(rows) < CREEP_MIN_READINGS:
            continue
        slope, r2 = _fit(rows)
        span = float(rows["ts"].iloc[-1] - rows["ts"].iloc[0])
        if slope <= 0 or r2 < CREEP_MIN_R2 or slope * span < GPU_NOISE_MIB:
            continue
        creep = Creep(str(rows["label"].iloc[-1]), slope * 60, r2, len(rows), span,
                      float(rows["total"].iloc[-1] - rows["used"].iloc[-1]))
        if found is None or creep.mib_per_min > found.mib_per_min:
            found = creep
    return found


def memory_before(growth: GpuGrowth, ts: float, span_s: float = 60.0) -> dict[str, Any] | None:
    """The most any GPU had grown over its baseline in the `span_s` before `ts`, and its least free memory."""
    rows = growth.window(ts - span_s, ts)
    if rows.empty:
        return None
    share = rows["growth_mib"] / rows["base_free_mib"].clip(lower=1.0) * 100
    worst = share.idxmax()
    return {"growth_mib": float(rows.at[worst, "growth_mib"]), "growth_pct": float(share.max()),
            "gpu": str(rows.at[worst, "label"]), "free_min_mib": float((rows["total"] - rows["used"]).min()),
            "used_share": float((rows["used"] / rows["total"]).max())}


KV_MEMORY_LINE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")  # vllm/v1/worker/gpu_worker.py
KV_SIZE_LINE = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")  # vllm/v1/core/kv_cache_utils.py


def startup_kv(text: str) -> str | None:
    """What vLLM's start-up log says of the KV pool it reserved, as the reason quotes it; None: not said."""
    memory, size = KV_MEMORY_LINE.search(text), KV_SIZE_LINE.search(text)
    said = ([f"KV cache memory {memory.group(1)} GiB"] if memory else []) + \
        ([f"{size.group(1)} KV cache size {size.group(2)} tokens"] if size else [])
    return f"the start-up log says {', '.join(said)}" if said else None


def _share(label: Any) -> float | None:
    """`gpu_memory_utilization` as the server labelled it, when it is a share of a card; else None (never the
    label's text: whatever a server sends must not reach the reason as it is)."""
    try:
        value = float(str(label)[:32])
    except ValueError:
        return None
    return value if 0 < value <= 1 else None


def reservation_text(growth: GpuGrowth, cache_config: dict[str, str], startup_log: str = "") -> str | None:
    """What the server reserved at start, as the reason says it (never judged as pressure)."""
    first = [b for b in growth.baselines if b.life_start_ts == -math.inf] or growth.baselines
    if not first:
        return None
    low, high = min(b.used_share for b in first), max(b.used_share for b in first)
    share = f"{low:.1%}" if round(low, 3) == round(high, 3) else f"{low:.1%}-{high:.1%}"
    utilization = _share(cache_config.get("gpu_memory_utilization"))  # a server's label: a number or nothing
    blocks = cache_config.get("num_gpu_blocks")
    said = f", vLLM's --gpu-memory-utilization {utilization:g}" if utilization is not None else \
        " (vLLM reserves its KV pool at start; vllm:cache_config_info not scraped)"
    pool = f", {int(str(blocks)):,} KV blocks" if str(blocks).isdigit() and len(str(blocks)) <= 12 else ""
    log = startup_kv(startup_log)
    late = "" if all(b.source == "before load" for b in first) else \
        " (the baseline is the first readings, taken with load already running: growth before them is unseen)"
    return f"reserved at start: {share} of each card{said}{pool}{f' ({log})' if log else ''}; judged on what the " \
           f"load added to it{late}"
