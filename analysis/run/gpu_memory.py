"""The run's GPU memory as one curve: every GPU sampled counted once in each sampling round.

Why not sum gpu.jsonl by its `ts`: each source stamps its own readings (NVML on this host, one
dcgm-exporter per node), so the rows of one round differ by milliseconds and a sum per `ts` is a sum
over one source at a time. Seen on an H200 host running the demo beside the sim's exporter: the curve
alternated between 17.6 GB (the H200) and 1.47 TB (the sim's eight GPUs) from one point to the next,
and a crash's "memory before it" was whichever source read last. On a multi-node deployment each
node's GPUs would likewise never be summed with the others'. Two sources may also read the same GPU
(NVML on a server node that also runs dcgm-exporter): a GPU is its UUID wherever a source gives one.

A round is the sampler's interval, read off the data (the median gap between one GPU's readings), so
runs sampled at any `--k3-sample-interval` are grouped as they were taken. A GPU not read in a round
keeps its last reading for up to STALE_INTERVALS of its own intervals (at least that many rounds)
rather than dropping out of the sum: an exporter that answers every 4 s beside NVML's 1 s would
otherwise make the sum dip every round it is silent, a release of memory that never happened. After
that it counts as gone.
"""

from __future__ import annotations

import math

import pandas as pd

STALE_INTERVALS = 2
COLUMNS = ["ts", "memory_used_mib", "memory_total_mib", "gpus"]


def gpu_identity(gpu: pd.DataFrame) -> pd.Series:
    """Each row's GPU: its UUID when the source gave one, else source, node and index."""
    def text(name: str) -> pd.Series:
        return gpu[name].astype(str) if name in gpu else pd.Series("", index=gpu.index)

    uuid = gpu["uuid"].astype(object) if "uuid" in gpu else pd.Series(None, index=gpu.index, dtype=object)
    return uuid.where(uuid.notna() & (uuid.astype(str) != ""), text("source") + "/" + text("node") + "/" + text("gpu"))


def _gaps(gpu: pd.DataFrame) -> pd.Series:
    """The gaps between successive readings of each GPU, indexed by the GPU."""
    table = pd.DataFrame({"gpu": gpu_identity(gpu), "ts": gpu["ts"]}).sort_values("ts", kind="mergesort")
    gaps = table.groupby("gpu")["ts"].diff()
    return gaps[gaps > 0].set_axis(table["gpu"][gaps > 0])


def sampling_round_s(gpu: pd.DataFrame, default: float = 1.0) -> float:
    """The median gap between successive readings of one GPU (the sampler's interval)."""
    if gpu.empty or "ts" not in gpu:
        return default
    gaps = _gaps(gpu)
    return float(gaps.median()) if not gaps.empty else default


def memory_curve(gpu: pd.DataFrame, t0: float, t1: float, round_s: float | None = None) -> pd.DataFrame:
    """Per sampling round in [t0, t1]: `ts` (the round's latest reading), the memory used and the
    memory there is summed over every GPU read (each once), and how many GPUs that is. Rounds are
    counted from t0; a round with no reading of its own is left out."""
    if gpu.empty or not {"ts", "memory_used_mib"} <= set(gpu):
        return pd.DataFrame(columns=COLUMNS)
    step = round_s or sampling_round_s(gpu)
    known = gpu[gpu["memory_used_mib"].notna()]
    own = _gaps(known).groupby(level=0).median()  # each GPU's own interval
    carry = {g: max(STALE_INTERVALS, math.ceil(STALE_INTERVALS * gap / step)) for g, gap in own.items()}
    reach = max(carry.values(), default=STALE_INTERVALS) * step
    rows = known[(known["ts"] >= t0 - reach) & (known["ts"] <= t1)]
    if rows.empty:
        return pd.DataFrame(columns=COLUMNS)
    total = rows["memory_total_mib"] if "memory_total_mib" in rows else pd.Series(float("nan"), index=rows.index)
    table = pd.DataFrame({"ts": rows["ts"], "used": rows["memory_used_mib"].astype(float),
                          "total": total.astype(float), "gpu": gpu_identity(rows),
                          "round": ((rows["ts"] - t0) // step).astype(int)})
    last = table.sort_values("ts", kind="mergesort").groupby(["round", "gpu"]).last()
    rounds = range(int(table["round"].min()), int(table["round"].max()) + 1)
    used, there = last["used"].unstack("gpu").reindex(rounds), last["total"].unstack("gpu").reindex(rounds)
    for name in used.columns:
        limit = carry.get(name, STALE_INTERVALS)
        used[name], there[name] = used[name].ffill(limit=limit), there[name].ffill(limit=limit)
    when = last["ts"].groupby(level="round").max().reindex(rounds)
    keep = when.notna() & (when >= t0)
    out = pd.DataFrame({"ts": when[keep], "memory_used_mib": used[keep].sum(axis=1, min_count=1),
                        "memory_total_mib": there[keep].sum(axis=1, min_count=1),
                        "gpus": used[keep].notna().sum(axis=1)})
    return out.reset_index(drop=True)
