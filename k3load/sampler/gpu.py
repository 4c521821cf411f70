"""The gpu.jsonl line, shared by both GPU sources (NVML on this host, dcgm-exporter per node).

Why one shape for both: the OOM analysis draws one memory curve per GPU around a crash, whichever
way the numbers arrived. A field a source cannot give is None, never 0: a missing power reading must
not look like an idle GPU. `simulated` is true only for the sim's gauges (label `simulated="true"`),
so no report can take a rehearsal for a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

GPU_FIELDS = ("ts", "source", "node", "gpu", "uuid", "name", "memory_used_mib", "memory_total_mib",
              "memory_free_mib", "util_pct", "temp_c", "power_w", "sm_clock_mhz", "throttle_reasons",
              "simulated", "extra")

# nvmlClocksEventReason* bits (nvml.h; dcgm-exporter's DCGM_FI_DEV_CLOCKS_EVENT_REASONS is the same mask).
THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


class GpuSource(Protocol):
    """Anything that returns this host's (or a node's) GPU rows for one tick."""

    name: str

    def read(self, ts: float) -> list[dict[str, Any]]: ...


def throttle_reasons(mask: float | int | None) -> list[str] | None:
    """Names of the set bits; unknown bits as `bit_0x...`; None when the source has no reading."""
    if mask is None:
        return None
    bits = int(mask)
    names = [label for bit, label in THROTTLE_BITS.items() if bits & bit]
    rest = bits & ~sum(THROTTLE_BITS)
    names += [f"bit_{1 << i:#x}" for i in range(rest.bit_length()) if rest >> i & 1]
    return names


def gpu_row(ts: float, source: str, **fields: Any) -> dict[str, Any]:
    """A full gpu.jsonl line: every field present, None where the source had nothing."""
    row: dict[str, Any] = dict.fromkeys(GPU_FIELDS)
    row.update(ts=ts, source=source, simulated=False, extra={})
    unknown = set(fields) - set(GPU_FIELDS)
    if unknown:
        raise ValueError(f"not gpu.jsonl fields: {sorted(unknown)}")
    row.update(fields)
    return row


def mib(value_bytes: float | int | None) -> float | None:
    """Bytes to MiB, rounded to 0.1 MiB (NVML reports bytes, dcgm-exporter MiB)."""
    return None if value_bytes is None else round(value_bytes / 2**20, 1)


def pick(mapping: Mapping[str, Any], *keys: str) -> Any:
    """The first key present with a non-None value."""
    for key in keys:
        if mapping.get(key) is not None:
            return mapping[key]
    return None
