"""A Kubernetes node's GPU labels (NVIDIA GPU Feature Discovery, part of the GPU operator) as a host inventory.

    kubectl get node gb300-n01 -o json > n01-node.json
    k3load inventory --from-node-labels n01-node.json --container-image vllm/vllm-openai:kimi-k3 --out n01.json

Why: on a cluster the precheck's master pod has no GPU and no nvidia-smi of the serving nodes, but the
GPU operator labels every GPU node with what `--host-inventory` needs. Read here (label: field):
  nvidia.com/cuda.driver-version.full, else nvidia.com/cuda.driver.major/.minor/.rev: driver_version
      ("580.95.05"; required: a node without it is not a GPU node as the operator sees it)
  nvidia.com/gpu.count: gpu_count (required, a whole number)
  nvidia.com/gpu.product: each GPU's name (GFD writes "NVIDIA-GB300": label values hold no spaces)
  nvidia.com/gpu.memory: each GPU's memory_total_mib
  nvidia.com/cuda.runtime-version.major/.minor, else nvidia.com/cuda.runtime.major/.minor:
      cuda_driver_max_version (the driver's newest CUDA, as nvidia-smi's "CUDA Version": never the build)
The node's name is metadata.name; the labels give no topology (null). The result is checked as the
precheck will read it (k3load/precheck/formats.py); a document that is not a Node, or a label that is
missing or not its shape, raises EvidenceFormatError naming the file and the label.
"""

from __future__ import annotations

import re
from typing import Any

from k3load.precheck.formats import DRIVER_VERSION, EvidenceFormatError, check_host_inventory

PREFIX = "nvidia.com/"
_WHOLE = re.compile(r"^\d+$")


def _labels(doc: Any, path: str) -> tuple[str, dict[str, str]]:
    if not isinstance(doc, dict) or doc.get("kind") != "Node":
        kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise EvidenceFormatError(path, "kind", f"{kind!r}, not a Node (kubectl get node NAME -o json)")
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        meta = {}  # no name: refused just below
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise EvidenceFormatError(path, "metadata.name", "missing: the node's name")
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise EvidenceFormatError(path, "metadata.labels", "not a mapping of strings")
    return name, {k: v.strip() for k, v in labels.items() if isinstance(k, str) and k.startswith(PREFIX)}


def _driver(labels: dict[str, str], path: str) -> str:
    full = labels.get(PREFIX + "cuda.driver-version.full")
    parts = [labels.get(f"{PREFIX}cuda.driver.{p}") for p in ("major", "minor", "rev")]
    version = full or (".".join(p for p in parts if p) if parts[0] else None)
    if not version:
        raise EvidenceFormatError(path, PREFIX + "cuda.driver.major", "missing: no driver version label (is GPU "
                                  "Feature Discovery running on this node?)")
    if not DRIVER_VERSION.match(version):
        raise EvidenceFormatError(path, PREFIX + "cuda.driver-version.full", f"{version[:40]!r}, not a version")
    return version


def _whole(labels: dict[str, str], key: str, path: str, required: bool) -> int | None:
    value = labels.get(PREFIX + key)
    if value is None and not required:
        return None
    if value is None or not _WHOLE.match(value):
        said = "missing" if value is None else f"{value[:40]!r}, not a whole number"
        raise EvidenceFormatError(path, PREFIX + key, said)
    return int(value)


def _cuda_max(labels: dict[str, str]) -> str | None:
    for stem in ("cuda.runtime-version", "cuda.runtime"):
        major, minor = labels.get(f"{PREFIX}{stem}.major"), labels.get(f"{PREFIX}{stem}.minor")
        if major and _WHOLE.match(major):
            return f"{major}.{minor}" if minor and _WHOLE.match(minor) else major
    return None


def inventory_from_node_labels(doc: Any, path: str, container_image: str | None) -> dict[str, Any]:
    """The node's host inventory from its GPU labels; EvidenceFormatError when they are not there."""
    name, labels = _labels(doc, path)
    driver = _driver(labels, path)
    count = _whole(labels, "gpu.count", path, required=True)
    memory = _whole(labels, "gpu.memory", path, required=False)
    product = labels.get(PREFIX + "gpu.product") or None
    gpus = [{"index": i, "name": product, "memory_total_mib": None if memory is None else float(memory)}
            for i in range(count or 0)]
    record = {"node": name, "container_image": container_image, "source": "node labels (GPU Feature Discovery)",
              "host": name, "driver_version": driver, "cuda_driver_max_version": _cuda_max(labels),
              "gpu_count": count, "gpus": gpus, "topology": None}
    check_host_inventory(record, path)
    return record
