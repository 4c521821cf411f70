"""dcgm-exporter gauges (one endpoint per node) to gpu.jsonl rows.

Why dcgm-exporter: on a multi-node deployment the load generator is not on the GPU hosts, so NVML
cannot see them; dcgm-exporter is what GPU clusters already run (Kubernetes GPU operator), one
`/metrics` per node, its series labelled with `gpu`, `UUID`, `modelName`, `Hostname`. The sim serves
`DCGM_FI_DEV_FB_USED/FREE` under the same names with `simulated="true"`, parsed by the same code.

Fields (dcgm-exporter's default counters, `etc/default-counters.csv`): FB_USED/FB_FREE/FB_TOTAL/FB_RESERVED
in MiB, GPU_UTIL in %, GPU_TEMP in C, POWER_USAGE in W, SM_CLOCK in MHz, CLOCK_THROTTLE_REASONS or
CLOCKS_EVENT_REASONS as NVML's bit mask. Any other `DCGM_FI_*` series of that GPU (XID errors, ECC,
profiling ratios) is kept under `extra` by its field name.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from k3load.sampler.gpu import gpu_row, pick, throttle_reasons

_FIELDS = {
    "DCGM_FI_DEV_FB_USED": "memory_used_mib",
    "DCGM_FI_DEV_FB_FREE": "memory_free_mib",
    "DCGM_FI_DEV_FB_TOTAL": "memory_total_mib",
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
    "DCGM_FI_DEV_GPU_TEMP": "temp_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
}
_THROTTLE = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
_IDENTITY = ("Hostname", "gpu", "UUID", "GPU_I_ID")  # GPU_I_ID: a MIG instance is its own row

DcgmFamilies = dict[str, list[tuple[dict[str, str], float | None]]]


def dcgm_rows(families: DcgmFamilies, ts: float, url: str) -> list[dict[str, Any]]:
    """One row per GPU (or MIG instance) found in the parsed `DCGM_FI_*` families of one body."""
    per_gpu: dict[tuple[str, ...], dict[str, Any]] = {}
    labels_of: dict[tuple[str, ...], dict[str, str]] = {}
    for family, samples in families.items():
        for labels, value in samples:
            ident = tuple(labels.get(key, "") for key in _IDENTITY)
            per_gpu.setdefault(ident, {})[family] = value
            labels_of.setdefault(ident, labels)
    rows = [_row(values, labels_of[ident], ts, url) for ident, values in per_gpu.items()]
    return sorted(rows, key=lambda r: (r["node"] or "", r["gpu"] if r["gpu"] is not None else -1, r["uuid"] or ""))


def _row(values: dict[str, Any], labels: dict[str, str], ts: float, url: str) -> dict[str, Any]:
    fields: dict[str, Any] = {target: values.get(family) for family, target in _FIELDS.items()}
    if fields["memory_total_mib"] is None:
        fields["memory_total_mib"] = _derived_total(values)
    mask = pick(values, *_THROTTLE)
    extra = {k: v for k, v in values.items() if k not in _FIELDS and k not in _THROTTLE}
    if labels.get("GPU_I_ID"):
        extra["GPU_I_ID"] = labels["GPU_I_ID"]
    gpu = labels.get("gpu", "")
    return gpu_row(
        ts, f"dcgm:{url}", node=labels.get("Hostname") or urllib.parse.urlsplit(url).hostname,
        gpu=int(gpu) if gpu.isdigit() else None, uuid=labels.get("UUID") or None,
        name=labels.get("modelName") or None, throttle_reasons=throttle_reasons(mask),
        simulated=labels.get("simulated") == "true", extra=extra, **fields,
    )


def _derived_total(values: dict[str, Any]) -> float | None:
    """dcgm-exporter's default set has no FB_TOTAL: total = used + free (+ reserved), as NVML counts it."""
    used, free = values.get("DCGM_FI_DEV_FB_USED"), values.get("DCGM_FI_DEV_FB_FREE")
    if used is None or free is None:
        return None
    return used + free + (values.get("DCGM_FI_DEV_FB_RESERVED") or 0)
