"""On a real GPU (marker `gpu`): the sampler's NVML memory curve follows an allocation and its release.

Runs `scripts/gpu_nvml_check.py` as a user would; skipped, with the reason, where NVML finds no GPU or
nothing here can allocate GPU memory (the script's exit status 2).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3load.sampler.nvml import inventory, load

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_nvml_check.py"
pytestmark = pytest.mark.gpu


def _no_gpu_reason() -> str | None:
    lib, reason = load("auto")
    if lib is None:
        return reason
    lib.nvmlShutdown()
    inv = inventory()
    return None if inv and inv["gpu_count"] else "NVML initialised but reports no GPU"


def test_nvml_memory_used_follows_an_allocation(tmp_path):
    reason = _no_gpu_reason()
    if reason:
        pytest.skip(f"no GPU through NVML: {reason}")
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=300)
    if done.returncode == 2:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout
