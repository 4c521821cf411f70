#!/usr/bin/env python3
"""Check the sampler's NVML path on a real GPU: memory_used must rise by what we allocate, then fall back.

    python scripts/gpu_nvml_check.py [--gib 2] [--device 0] [--out DIR]

Why: the OOM analysis trusts gpu.jsonl's memory curve; on a CPU-only machine only the fake NVML is
tested. This runs the real sampler (`Sampler(..., nvml="auto")`, no server needed) while it allocates
GPU memory with torch, else cupy, else the CUDA driver API through ctypes (libcuda.so.1 ships with the
driver, so a bare driver host can still be checked), holds it, frees it, and compares the sampler's
readings with the allocation. Exit status: 0 PASS, 1 FAIL, 2 cannot test here (no GPU through NVML, or
nothing can allocate GPU memory) — each printed with the numbers and the reason.
Needs only the harness's dependencies (plus torch or cupy if present). Leaves nothing running.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's numbering = NVML's (PCI order)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3load.sampler import Sampler  # after the path and CUDA order are set
from k3load.sampler.nvml import inventory

PASS, FAIL, CANNOT = 0, 1, 2
INTERVAL_S = 0.2
SLACK_MIB = 64.0  # allocator rounding, a second context's bookkeeping


class Allocator:
    """alloc(bytes) then free(); `init()` creates the CUDA context first so the baseline includes it."""

    name = "none"

    def init(self, device: int) -> None: ...

    def alloc(self, nbytes: int) -> None: ...

    def free(self) -> None: ...


class TorchAllocator(Allocator):
    name = "torch"

    def init(self, device: int) -> None:
        import torch

        self.torch, self.device = torch, torch.device("cuda", device)
        torch.zeros(1, device=self.device)
        torch.cuda.synchronize(self.device)

    def alloc(self, nbytes: int) -> None:
        self.block = self.torch.ones(nbytes, dtype=self.torch.uint8, device=self.device)  # touched, not lazy
        self.torch.cuda.synchronize(self.device)

    def free(self) -> None:
        del self.block
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.empty_cache()  # hand the cached segment back to the driver


class CupyAllocator(Allocator):
    name = "cupy"

    def init(self, device: int) -> None:
        import cupy

        self.cupy = cupy
        cupy.cuda.Device(device).use()
        cupy.zeros(1)

    def alloc(self, nbytes: int) -> None:
        self.block = self.cupy.ones(nbytes, dtype=self.cupy.uint8)
        self.cupy.cuda.Device().synchronize()

    def free(self) -> None:
        del self.block
        self.cupy.get_default_memory_pool().free_all_blocks()


class DriverApiAllocator(Allocator):
    """cuMemAlloc through libcuda.so.1: no toolkit, no Python CUDA package needed."""

    name = "cuda-driver-api (ctypes)"

    def _ok(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} returned CUDA error {code}")

    def init(self, device: int) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.dev, self.ctx, self.ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        self._ok(self.cuda.cuInit(0), "cuInit")
        self._ok(self.cuda.cuDeviceGet(ctypes.byref(self.dev), device), "cuDeviceGet")
        self._ok(self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), self.dev), "cuDevicePrimaryCtxRetain")
        self._ok(self.cuda.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def alloc(self, nbytes: int) -> None:
        self._ok(self.cuda.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc_v2")
        self._ok(self.cuda.cuMemsetD8_v2(self.ptr, ctypes.c_ubyte(1), ctypes.c_size_t(nbytes)), "cuMemsetD8_v2")
        self._ok(self.cuda.cuCtxSynchronize(), "cuCtxSynchronize")

    def free(self) -> None:
        self._ok(self.cuda.cuMemFree_v2(self.ptr), "cuMemFree_v2")


def pick_allocator(device: int) -> tuple[Allocator | None, list[str]]:
    """The first allocator that can create a context on `device`; the reasons the others could not."""
    tried: list[str] = []
    for cls in (TorchAllocator, CupyAllocator, DriverApiAllocator):
        allocator = cls()
        try:
            allocator.init(device)
            return allocator, tried
        except Exception as exc:  # ImportError, no CUDA build, no libcuda ...
            tried.append(f"{cls.name}: {type(exc).__name__}: {str(exc)[:200]}")
    return None, tried


def nvml_index(device: int) -> int:
    """The NVML index of CUDA device `device` (CUDA_VISIBLE_DEVICES given as indices or as UUIDs)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return device
    chosen = visible[device]
    if chosen.isdigit():
        return int(chosen)
    inv = inventory() or {}
    for gpu in inv.get("gpus", []):
        if gpu["uuid"] and (gpu["uuid"] == chosen or gpu["uuid"].startswith(chosen)):
            return int(gpu["index"])
    raise SystemExit(f"CANNOT TEST: CUDA_VISIBLE_DEVICES entry {chosen!r} matches no NVML GPU")


def used_mib(out: Path, gpu: int, since: float) -> list[float]:
    rows = [json.loads(line) for line in (out / "gpu.jsonl").read_text().splitlines()]
    return [r["memory_used_mib"] for r in rows
            if r["gpu"] == gpu and r["ts"] >= since and r["memory_used_mib"] is not None]


def settle(out: Path, gpu: int, hold_s: float) -> list[float]:
    """Readings taken over `hold_s` seconds from now."""
    start = time.time()
    time.sleep(hold_s)
    return used_mib(out, gpu, start)


def measure(allocator: Allocator, out: Path, gpu: int, nbytes: int, hold_s: float) -> dict[str, Any]:
    baseline = settle(out, gpu, hold_s)
    allocator.alloc(nbytes)
    time.sleep(2 * INTERVAL_S)  # let the next reading see the allocation
    held = settle(out, gpu, hold_s)
    allocator.free()
    time.sleep(2 * INTERVAL_S)
    after = settle(out, gpu, hold_s)
    if not (baseline and held and after):
        return {"error": "the sampler wrote no NVML readings for this GPU"}
    base = statistics.median(baseline)
    return {"allocated_mib": nbytes / 2**20, "baseline_mib": base, "held_mib": statistics.median(held),
            "after_mib": statistics.median(after), "rise_mib": statistics.median(held) - base,
            "residue_mib": statistics.median(after) - base, "readings": len(baseline) + len(held) + len(after)}


def judge(m: dict[str, Any]) -> list[str]:
    """Problems found; empty means PASS. Other processes on the GPU can move the numbers: hence the slack."""
    if "error" in m:
        return [m["error"]]
    alloc, problems = m["allocated_mib"], []
    if not 0.9 * alloc - SLACK_MIB <= m["rise_mib"] <= 1.1 * alloc + SLACK_MIB:
        problems.append(f"memory_used rose by {m['rise_mib']:.0f} MiB for {alloc:.0f} MiB allocated")
    if abs(m["residue_mib"]) > 0.1 * alloc + SLACK_MIB:
        problems.append(f"memory_used did not fall back: {m['residue_mib']:+.0f} MiB from the baseline after free")
    return problems


def field_report(out: Path, gpu: int) -> dict[str, Any]:
    """Which gpu.jsonl fields this GPU fills (None where NVML does not support them): information, not a verdict."""
    rows = [json.loads(line) for line in (out / "gpu.jsonl").read_text().splitlines()]
    last = next((r for r in reversed(rows) if r["gpu"] == gpu), {})
    keys = ("util_pct", "temp_c", "power_w", "sm_clock_mhz", "throttle_reasons", "memory_total_mib", "uuid", "name")
    return {k: last.get(k) for k in keys}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    inv = inventory()
    if not inv or not inv["gpu_count"]:
        return report(CANNOT, "NVML finds no GPU here (no driver, no library, or no device)", {})
    print(f"NVML: driver {inv['driver_version']}, driver's max CUDA {inv['cuda_driver_max_version']}, "
          f"{inv['gpu_count']} GPU(s): {', '.join(g['name'] or '?' for g in inv['gpus'])}", flush=True)
    allocator, tried = pick_allocator(args.device)
    if allocator is None:
        return report(CANNOT, "nothing could allocate GPU memory: " + "; ".join(tried), {})
    gpu = nvml_index(args.device)
    total_mib = inv["gpus"][gpu]["memory_total_mib"] or 0
    nbytes = int(min(args.gib * 2**30, 0.25 * total_mib * 2**20))
    out = Path(args.out or tempfile.mkdtemp(prefix="k3load-gpu-check-"))
    sampler = Sampler(out, None, interval_s=INTERVAL_S, nvml="auto").start()
    try:
        m = measure(allocator, out, gpu, nbytes, args.hold)
    except Exception as exc:  # the allocation itself failed (the GPU is full of someone else's work)
        return report(CANNOT, f"{allocator.name} could not allocate {nbytes / 2**20:.0f} MiB: {exc}", {})
    finally:
        sampler.stop()
    m.update(allocator=allocator.name, nvml_gpu=gpu, run_dir=str(out), fields=field_report(out, gpu))
    problems = judge(m)
    return report(FAIL if problems else PASS, "; ".join(problems) or "memory_used followed the allocation", m)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="GiB to allocate (at most a quarter of the GPU)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument("--hold", type=float, default=1.5, help="seconds to read at each phase")
    parser.add_argument("--out", help="run directory for the sampler's files (default: a temp dir)")
    return parser.parse_args(argv)


def report(status: int, why: str, details: dict[str, Any]) -> int:
    word = {PASS: "PASS", FAIL: "FAIL", CANNOT: "CANNOT TEST"}[status]
    print(json.dumps(details, indent=2, default=str))
    print(f"{word}: {why}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
