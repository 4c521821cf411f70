"""The run's GPU memory as one curve: every GPU sampled counted once in each sampling round.

Why not sum gpu.jsonl by its `ts`: each source stamps its own readings (NVML on this host, one
dcgm-exporter per node), so the rows of one round differ by milliseconds and a sum per `ts` is a sum
over one source at a time. Seen on an H200 host running the demo beside the sim's exporter: the curve
alternated between 17.6 GB (the H200) and 1.47 TB (the sim's eight GPUs) from one point to the next,
and a crash's "memory before it" was whichever source read last. On a multi-node deployment each
node's GPUs would likewise never be summed with the others'. Two sources may also read the same GPU
(NVML on a server node that also runs dcgm-exporter): a GPU is its UUID wherever a source gives one.

A round is the sampler's interval, read off the data (the median gap between one GPU's readings), so
runs sampled at any `--k3-sample-interval` are grouped as they were taken. A GPU missed in a round
(a slow exporter) keeps its last reading for up to STALE_ROUNDS rounds rather than dropping out of the
sum; after that it counts as gone.
"""

from __future__ import annotations

import pandas as pd

STALE_ROUNDS = 2
COLUMNS = ["ts", "memory_used_mib", "memory_total_mib", "gpus"]


def gpu_identity(gpu: pd.DataFrame) -> pd.Series:
    """Each row's GPU: its UUID when the source gave one, else source, node and index."""
    uuid = gpu["uuid"] if "uuid" in gpu else pd.Series(None, index=gpu.index, dtype=object)
    fallback = (gpu.get("source", pd.Series("", index=gpu.index)).astype(str) + "/"
                + gpu.get("node", pd.Series("", index=gpu.index)).astype(str) + "/"
                + gpu.get("gpu", pd.Series("", index=gpu.index)).astype(str))
    known = uuid.notna() & (uuid.astype(str) != "")
    return uuid.astype(object).where(known, fallback)


def sampling_round_s(gpu: pd.DataFrame, default: float = 1.0) -> float:
    """The median gap between successive readings of one GPU (the sampler's interval)."""
    if gpu.empty or "ts" not in gpu:
        return default
    gaps = gpu.assign(_id=gpu_identity(gpu)).sort_values("ts").groupby("_id")["ts"].diff().dropna()
    gaps = gaps[gaps > 0]
    return float(gaps.median()) if not gaps.empty else default


def memory_curve(gpu: pd.DataFrame, t0: float, t1: float, round_s: float | None = None) -> pd.DataFrame:
    """Per sampling round in [t0, t1]: `ts` (the round's latest reading), the memory used and the
    memory there is summed over every GPU read (each once), and how many GPUs that is. Rounds are
    counted from t0; a round with no reading of its own is left out."""
    if gpu.empty or not {"ts", "memory_used_mib"} <= set(gpu):
        return pd.DataFrame(columns=COLUMNS)
    step = round_s or sampling_round_s(gpu)
    rows = gpu[(gpu["ts"] >= t0 - STALE_ROUNDS * step) & (gpu["ts"] <= t1) & gpu["memory_used_mib"].notna()]
    if rows.empty:
        return pd.DataFrame(columns=COLUMNS)
    total = rows["memory_total_mib"] if "memory_total_mib" in rows else pd.Series(float("nan"), index=rows.index)
    table = pd.DataFrame({"ts": rows["ts"], "used": rows["memory_used_mib"].astype(float),
                          "total": total.astype(float), "gpu": gpu_identity(rows),
                          "round": ((rows["ts"] - t0) // step).astype(int)})
    last = table.sort_values("ts", kind="mergesort").groupby(["round", "gpu"]).last()
    rounds = range(int(table["round"].min()), int(table["round"].max()) + 1)
    used = last["used"].unstack("gpu").reindex(rounds).ffill(limit=STALE_ROUNDS)
    there = last["total"].unstack("gpu").reindex(rounds).ffill(limit=STALE_ROUNDS)
    when = last["ts"].groupby(level="round").max().reindex(rounds)
    keep = when.notna() & (when >= t0)
    out = pd.DataFrame({"ts": when[keep], "memory_used_mib": used[keep].sum(axis=1, min_count=1),
                        "memory_total_mib": there[keep].sum(axis=1, min_count=1),
                        "gpus": used[keep].notna().sum(axis=1)})
    return out.reset_index(drop=True)
