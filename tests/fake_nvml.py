"""A fake NVML library with nvidia-ml-py's (`pynvml`) names, for tests only.

Why a fake and not a mock: the sampler talks to NVML through a dozen functions and catches
`NVMLError` the way the real library raises it; this object keeps that contract (same names, same
argument order, values in the same units — bytes, milliwatts, MHz, NVML's CUDA integer 13000) so a
test reads like a GPU host. Change `gpus[i].used_bytes` between readings to draw a memory curve; put a
function name in `unsupported` to make it raise NVMLError_NotSupported as a GPU without that sensor does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_LIBRARY_NOT_FOUND = 12


class NVMLError(Exception):
    """Like pynvml.NVMLError: carries `.value`, the NVML return code."""

    _names: ClassVar[dict[int, str]] = {1: "Uninitialized", 2: "Invalid Argument", 3: "Not Supported",
                                        12: "NVML Shared Library Not Found"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._names.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_NotSupported(NVMLError):  # pynvml's own class name
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    total_bytes: int = 143_771 * 2**20
    used_bytes: int = 512 * 2**20
    util_pct: int = 0
    temp_c: int = 35
    power_mw: int = 75_000
    sm_clock_mhz: int = 1980
    throttle_mask: int = 0x1  # gpu_idle
    pci_bus_id: str = "00000000:18:00.0"
    nvlinks: int = 18
    numa_node: int = 0


@dataclass
class FakeNvml:
    """Module-like: `lib.nvmlInit()`, `lib.NVMLError`, `lib.NVML_TEMPERATURE_GPU` ..."""

    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu()])
    driver_version: str = "580.65.06"
    cuda_driver_version: int = 13000
    nvml_version: str = "13.580.65"
    unsupported: set[str] = field(default_factory=set)
    init_error: int | None = None  # e.g. NVML_ERROR_LIBRARY_NOT_FOUND: nvmlInit raises it
    initialised: int = 0
    calls: int = 0

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5
    NVML_TOPOLOGY_NODE = 40
    NVML_TOPOLOGY_SYSTEM = 50

    def _check(self, name: str) -> None:
        self.calls += 1
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if name in self.unsupported:
            raise NVMLError_NotSupported()

    def _gpu(self, handle: Any) -> FakeGpu:
        return self.gpus[handle]

    # -- init ----------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.initialised -= 1

    # -- system --------------------------------------------------------------------------------------
    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._check("nvmlSystemGetNVMLVersion")
        return self.nvml_version

    # -- devices -------------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        self._check("nvmlDeviceGetName")
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        self._check("nvmlDeviceGetUUID")
        return self._gpu(handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle)
        return SimpleNamespace(total=gpu.total_bytes, used=gpu.used_bytes, free=gpu.total_bytes - gpu.used_bytes)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=self._gpu(handle).util_pct, memory=0)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature")
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(handle).temp_c

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._check("nvmlDeviceGetPowerUsage")
        return self._gpu(handle).power_mw

    def nvmlDeviceGetClockInfo(self, handle: int, clock_type: int) -> int:
        self._check("nvmlDeviceGetClockInfo")
        if clock_type != self.NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(handle).sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        self._check("nvmlDeviceGetCurrentClocksEventReasons")
        return self._gpu(handle).throttle_mask

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=self._gpu(handle).pci_bus_id.encode())  # bytes, as ctypes gives char arrays

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        self._check("nvmlDeviceGetNvLinkState")
        if link >= self._gpu(handle).nvlinks:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        self._check("nvmlDeviceGetP2PStatus")
        linked = self._gpu(a).nvlinks and self._gpu(b).nvlinks and index == self.NVML_P2P_CAPS_INDEX_NVLINK
        return self.NVML_P2P_STATUS_OK if linked else self.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        self._check("nvmlDeviceGetTopologyCommonAncestor")
        same = self._gpu(a).numa_node == self._gpu(b).numa_node
        return self.NVML_TOPOLOGY_NODE if same else self.NVML_TOPOLOGY_SYSTEM
