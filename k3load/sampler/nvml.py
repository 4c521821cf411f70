"""NVML (nvidia-ml-py's `pynvml`) on the local host: per-tick GPU readings and the host inventory.

Why NVML and not `nvidia-smi`: it is the library nvidia-smi itself reads, answers in microseconds
without a subprocess, and raises typed errors, so a field the GPU does not support becomes None
instead of a parse failure. Why the library is a parameter: tests inject `tests/fake_nvml.py`; in a
run the real `pynvml` is used whenever it loads and finds a driver.

Public entry points:
- `load(nvml)` -> `(lib, None)` initialised, or `(None, reason)`; `nvml` is `"auto"`/None (import
  the real `pynvml`) or a library object with pynvml's function names.
- `NvmlReader(lib)` -> `.read(ts)` gives one gpu.jsonl row per GPU; `.close()` shuts NVML down.
- `inventory(nvml=None)` -> the host's GPU evidence for the precheck (shape in its docstring).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from k3load.sampler.gpu import gpu_row, mib, throttle_reasons

# nvidia-smi topo -m's legend for nvmlDeviceGetTopologyCommonAncestor levels.
_TOPOLOGY_LEVELS = {0: "INTERNAL", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TOPOLOGY_LEGEND = {
    "X": "self", "NVLINK": "peer-to-peer over NVLink reported OK by NVML",
    "INTERNAL": "same board", "PIX": "at most one PCIe bridge", "PXB": "multiple PCIe bridges",
    "PHB": "through a PCIe host bridge", "NODE": "across host bridges within one NUMA node",
    "SYS": "across NUMA nodes (SMP interconnect)",
}
CUDA_NOTE = ("nvmlSystemGetCudaDriverVersion: the newest CUDA version this DRIVER supports (what nvidia-smi "
             "shows as 'CUDA Version'), not the CUDA runtime the container or vLLM was built with")


def load(nvml: Any = "auto") -> tuple[Any | None, str | None]:
    """Import (when `nvml` is "auto" or None) and initialise NVML; never raises."""
    lib = nvml
    if nvml is None or nvml == "auto":
        try:
            import pynvml  # nvidia-ml-py
        except ImportError as exc:
            return None, f"nvidia-ml-py not importable: {exc}"
        lib = pynvml
    try:
        lib.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... (also a broken lib)
        return None, f"NVML init failed: {type(exc).__name__}: {exc}"
    return lib, None


def _call(lib: Any, fn_name: str, *args: Any) -> Any:
    """One NVML call; None when the call is unsupported, missing from this library, or fails."""
    fn: Callable[..., Any] | None = getattr(lib, fn_name, None)
    if fn is None:
        return None
    try:
        value = fn(*args)
    except lib.NVMLError:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _throttle_mask(lib: Any, handle: Any) -> int | None:
    mask = _call(lib, "nvmlDeviceGetCurrentClocksEventReasons", handle)
    return mask if mask is not None else _call(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)


class NvmlReader:
    """Reads every local GPU once per tick. Names and UUIDs are read once: they do not change."""

    name = "nvml"

    def __init__(self, lib: Any, node: str | None = None) -> None:
        self.lib = lib
        self.node = node or socket.gethostname()
        count = _call(lib, "nvmlDeviceGetCount") or 0
        self.handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.static = [(_call(lib, "nvmlDeviceGetName", h), _call(lib, "nvmlDeviceGetUUID", h)) for h in self.handles]

    def read(self, ts: float) -> list[dict[str, Any]]:
        return [self._row(index, handle, ts) for index, handle in enumerate(self.handles)]

    def _row(self, index: int, handle: Any, ts: float) -> dict[str, Any]:
        lib = self.lib
        memory = _call(lib, "nvmlDeviceGetMemoryInfo", handle)
        util = _call(lib, "nvmlDeviceGetUtilizationRates", handle)
        power_mw = _call(lib, "nvmlDeviceGetPowerUsage", handle)
        name, uuid = self.static[index]
        return gpu_row(
            ts, "nvml", node=self.node, gpu=index, uuid=uuid, name=name,
            memory_used_mib=mib(getattr(memory, "used", None)), memory_total_mib=mib(getattr(memory, "total", None)),
            memory_free_mib=mib(getattr(memory, "free", None)), util_pct=getattr(util, "gpu", None),
            temp_c=_call(lib, "nvmlDeviceGetTemperature", handle, getattr(lib, "NVML_TEMPERATURE_GPU", 0)),
            power_w=None if power_mw is None else power_mw / 1000,
            sm_clock_mhz=_call(lib, "nvmlDeviceGetClockInfo", handle, getattr(lib, "NVML_CLOCK_SM", 1)),
            throttle_reasons=throttle_reasons(_throttle_mask(lib, handle)),
        )

    def close(self) -> None:
        _call(self.lib, "nvmlShutdown")


def inventory(nvml: Any = None) -> dict[str, Any] | None:
    """This host's GPU evidence, or None when NVML is unavailable (no library, no driver).

    `nvml`: None or "auto" for the real `pynvml`, or a library object with its names (tests).
    The precheck calls exactly `inventory(nvml=None)`. Returned shape (None where NVML cannot tell):

        {"source": "nvml", "host": "node-1",
         "driver_version": "580.65.06",                  # nvmlSystemGetDriverVersion
         "cuda_driver_max_version": "13.0",              # the driver's newest CUDA, NOT the app's runtime
         "cuda_driver_max_version_note": CUDA_NOTE,
         "nvml_version": "13.580.65",
         "gpu_count": 8,
         "gpus": [{"index": 0, "name": "NVIDIA GB300", "uuid": "GPU-...", "memory_total_mib": 284208.0,
                   "pci_bus_id": "00000000:1B:00.0", "nvlink_active_links": 18}, ...],
         "topology": {"matrix": [["X", "NVLINK", ...], ...], "legend": TOPOLOGY_LEGEND} | None}

    `topology.matrix[i][j]` is "NVLINK" when NVML reports NVLink peer-to-peer between GPUs i and j as OK,
    else their closest PCIe/CPU common ancestor (nvidia-smi topo -m's PIX/PXB/PHB/NODE/SYS), None if unknown.
    """
    lib, _reason = load(nvml)
    if lib is None:
        return None
    try:
        count = _call(lib, "nvmlDeviceGetCount") or 0
        handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        return {
            "source": "nvml", "host": socket.gethostname(),
            "driver_version": _call(lib, "nvmlSystemGetDriverVersion"),
            "cuda_driver_max_version": _cuda_version(_call(lib, "nvmlSystemGetCudaDriverVersion")),
            "cuda_driver_max_version_note": CUDA_NOTE,
            "nvml_version": _call(lib, "nvmlSystemGetNVMLVersion"),
            "gpu_count": count,
            "gpus": [_gpu_facts(lib, i, h) for i, h in enumerate(handles)],
            "topology": _topology(lib, handles),
        }
    finally:
        _call(lib, "nvmlShutdown")


def _cuda_version(raw: int | None) -> str | None:
    """NVML encodes 13.0 as 13000 and 12.8 as 12080."""
    return None if raw is None else f"{raw // 1000}.{raw % 1000 // 10}"


def _gpu_facts(lib: Any, index: int, handle: Any) -> dict[str, Any]:
    memory = _call(lib, "nvmlDeviceGetMemoryInfo", handle)
    pci = _call(lib, "nvmlDeviceGetPciInfo", handle)
    bus_id = getattr(pci, "busId", None)
    return {
        "index": index, "name": _call(lib, "nvmlDeviceGetName", handle),
        "uuid": _call(lib, "nvmlDeviceGetUUID", handle),
        "memory_total_mib": mib(getattr(memory, "total", None)),
        "pci_bus_id": bus_id.decode() if isinstance(bus_id, bytes) else bus_id,
        "nvlink_active_links": _nvlink_links(lib, handle),
    }


def _nvlink_links(lib: Any, handle: Any) -> int | None:
    """Active NVLink links; None when the GPU has no NVLink or NVML cannot say."""
    states = [_call(lib, "nvmlDeviceGetNvLinkState", handle, link)
              for link in range(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18))]
    known = [s for s in states if s is not None]
    return sum(1 for s in known if s == getattr(lib, "NVML_FEATURE_ENABLED", 1)) if known else None


def _topology(lib: Any, handles: list[Any]) -> dict[str, Any] | None:
    if len(handles) < 2:
        return None
    matrix = [[_link(lib, a, b) if i != j else "X" for j, b in enumerate(handles)] for i, a in enumerate(handles)]
    if all(cell in ("X", None) for row in matrix for cell in row):
        return None
    return {"matrix": matrix, "legend": TOPOLOGY_LEGEND}


def _link(lib: Any, a: Any, b: Any) -> str | None:
    nvlink_index = getattr(lib, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    if _call(lib, "nvmlDeviceGetP2PStatus", a, b, nvlink_index) == getattr(lib, "NVML_P2P_STATUS_OK", 0):
        return "NVLINK"
    level = _call(lib, "nvmlDeviceGetTopologyCommonAncestor", a, b)
    return None if level is None else _TOPOLOGY_LEVELS.get(level, f"LEVEL_{level}")
