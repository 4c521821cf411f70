"""Parse a saved `vllm collect-env` output (run inside the container) into the facts the rules need.

Why this file and not nvidia-smi: the container's build facts — "CUDA used to build PyTorch", the
PyTorch wheel, the vLLM version and git sha — exist only inside the image. nvidia-smi's "CUDA Version"
is the driver's maximum and says nothing about what the application was built with.

Format: `vllm/collect_env.py` (vLLM 0.32.0 wheel, `env_info_fmt` and `CUDA_FMT`): banner sections
between `====` lines, `Key<padding>: value` rows aligned at column 30, multi-line values (GPU models)
starting on the next line, `vLLM Build Flags:` / `GPU Topology:` followed by indented text, `[pip3]`
package lines. Missing values read "Could not collect", "N/A", "None" or "No CUDA": all become None.
"""

from __future__ import annotations

import re
from typing import Any

_ROW = re.compile(r"^(?P<key>[A-Za-z][^:]*?)\s*: (?P<value>.*)$")
_RULE = re.compile(r"^={10,}\s*$")
_PIP = re.compile(r"^\[(?:pip\d*|conda)\] (?P<name>[A-Za-z0-9_.\-]+)==(?P<version>\S+)")
_GPU = re.compile(r"^GPU (?P<index>\d+): (?P<name>.+?)(?: \(UUID: [^)]*\))?\s*$")
_VLLM = re.compile(r"^(?P<version>\S+)(?: \(git sha: (?P<sha>[0-9a-f]+)(?:, date: (?P<date>\d+))?\))?$")
MISSING = {"", "n/a", "could not collect", "none", "no cuda", "no xpu", "n/a (dev)"}


def _value(text: str | None) -> str | None:
    if text is None:
        return None
    text = text.strip()
    return None if text.lower() in MISSING else text


def _rows_and_blocks(lines: list[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Key/value rows, plus the indented or following-line blocks of 'Key:' and multi-line rows."""
    rows: dict[str, str] = {}
    blocks: dict[str, list[str]] = {}
    current: str | None = None
    for line in lines:
        if _RULE.match(line):
            current = None
            continue
        match = _ROW.match(line)
        if match and not line.startswith((" ", "\t")) and not _GPU.match(line):
            current = match["key"].strip()
            rows[current] = match["value"]
            blocks[current] = []
        elif not line.startswith((" ", "\t")) and line.rstrip().endswith(":"):
            current = line.rstrip()[:-1].strip()  # 'vLLM Build Flags:', 'GPU Topology:'
            blocks[current] = []
        elif current is not None:
            blocks[current].append(line)
    return rows, blocks


def _gpus(rows: dict[str, str], blocks: dict[str, list[str]]) -> list[dict[str, Any]]:
    key = "GPU models and configuration"
    lines = [rows.get(key, ""), *blocks.get(key, [])]
    gpus = []
    for line in lines:
        match = _GPU.match(line.strip())
        if match:
            gpus.append({"index": int(match["index"]), "name": match["name"].strip()})
    return gpus


def _topology(lines: list[str]) -> str | None:
    """nvidia-smi topo -m as printed, without its legend; None when not collected."""
    kept: list[str] = []
    for line in lines:
        if line.strip().startswith("Legend:"):
            break
        kept.append(line.rstrip())
    text = "\n".join(kept).strip("\n")
    return None if _value(text) is None else text


def _vllm(line: str | None) -> dict[str, Any]:
    """'0.27.1', '0.28.0.dev5+g0a1b2c3 (git sha: 0a1b2c3)' or '... (git sha: x, date: 20260801)'."""
    text = _value(line)
    if text is None:
        return {"vllm_version": None, "vllm_git_sha": None, "vllm_local_changes": None}
    match = _VLLM.match(text)
    if match is None:
        return {"vllm_version": text, "vllm_git_sha": None, "vllm_local_changes": None}
    return {"vllm_version": match["version"], "vllm_git_sha": match["sha"],
            "vllm_local_changes": bool(match["date"]) if match["sha"] else None}


def parse_collect_env(text: str) -> dict[str, Any]:
    """The facts of one collect-env output; a field that was not collected is None, never guessed."""
    lines = text.splitlines()
    rows, blocks = _rows_and_blocks(lines)
    gpus = _gpus(rows, blocks)
    flags = [line.strip() for line in blocks.get("vLLM Build Flags", []) if line.strip()]
    pip = {m["name"].lower(): m["version"] for m in map(_PIP.match, lines) if m}
    return {
        "format_ok": "vLLM Version" in rows or "PyTorch version" in rows,
        "torch_version": _value(rows.get("PyTorch version")),
        "cuda_build": _value(rows.get("CUDA used to build PyTorch")),
        "cuda_runtime": _value(rows.get("CUDA runtime version")),
        "cuda_available": _value(rows.get("Is CUDA available")),
        "driver_version": _value(rows.get("Nvidia driver version")),
        "gpus": gpus,
        "gpu_count": len(gpus) or None,
        "vllm_version_line": _value(rows.get("vLLM Version")),
        **_vllm(rows.get("vLLM Version")),
        "vllm_build_flags": "; ".join(flags) or None,
        "gpu_topology": _topology(blocks.get("GPU Topology", [])),
        "pip": pip,
    }


def major(version: str | None) -> int | None:
    """Leading integer of a dotted version ('13.0' -> 13, '580.95.05' -> 580); None if there is none."""
    match = re.match(r"^\s*(\d+)", version or "")
    return int(match.group(1)) if match else None


_VERSION = re.compile(r"^v?(?P<release>\d+(?:\.\d+)*)(?P<pre>(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev(?P<dev>\d+))?"
                      r"(?:\+(?P<local>[\w.]+))?$")


def parse_version(text: str) -> dict[str, Any] | None:
    """PEP 440-ish vLLM version: release tuple, pre/dev flags, git sha from a '+g<sha>' local part."""
    match = _VERSION.match(text.strip())
    if match is None:
        return None
    local = match["local"] or ""
    sha = re.match(r"g([0-9a-f]{7,40})", local)
    return {"release": tuple(int(p) for p in match["release"].split(".")), "pre": bool(match["pre"]),
            "dev": match["dev"] is not None, "sha": sha.group(1) if sha else None,
            "dirty": bool(sha) and bool(re.search(r"\.d\d{8}", local))}


def version_at_least(version: dict[str, Any], minimum: str) -> bool:
    """A pre-release or dev build of the minimum release is below it."""
    need = tuple(int(p) for p in minimum.split("."))
    width = max(len(need), len(version["release"]))
    need, release = need + (0,) * (width - len(need)), version["release"] + (0,) * (width - len(version["release"]))
    if release != need:
        return release > need
    return not (version["pre"] or version["dev"])
