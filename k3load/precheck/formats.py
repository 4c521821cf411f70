"""The precheck's input files checked against their formats; a file that is not its format is an input error.

    check_input_files(container_info=Path("collect-env.txt"), host_inventories=[Path("n01.json")])
    # raises EvidenceFormatError: "n01.json: driver_version: missing (the NVIDIA driver version, ...)"

Why an error and not a rule result: a file the harness cannot read says nothing about the deployment. A
host inventory in a made-up shape used to be judged as a host with no driver (`driver_branch` failed,
verdict `rebuild`); now it stops the precheck naming the file and the field (exit 2 in a Locust run,
3 in `k3load precheck`), before anything is gathered. What the deployment itself lacks is still judged:
a field present as `null` (NVML could not tell) is "not recorded", a rule's finding.

The formats, with an example of each under docs/examples/precheck/ (docs/running.md):
  host inventory (--host-inventory, JSON, one node): an object with `driver_version` (a string such as
      "580.95.05", or null) and `gpu_count` (an integer, or null) or `gpus` (a list of objects, each with
      an optional string `name`); `gpu_count` and the length of `gpus` agree when both are given.
      Optional: `node` (else `host`, else the file name), `container_image`, `cuda_driver_max_version`,
      `topology` (an object or null); other keys are kept in the evidence and not read. Aliases read as
      the same fact: `hostname` for `node`, `device_count` for `gpu_count`, `cuda_driver_version` for
      `cuda_driver_max_version`. `k3load inventory` writes it (k3load/precheck/inventory.py).
  collect-env (--container-info): the text `vllm collect-env` prints inside the container; it must
      hold a `PyTorch version:` or a `vLLM Version:` row (k3load/precheck/collect_env.py).
  custom build (--custom-build): a YAML or JSON mapping (its fields are judged by the custom_build rule).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from k3load.errors import InputError
from k3load.precheck.collect_env import parse_collect_env
from k3load.yamlfile import one_line

HOST_ALIASES = {"node": ("node", "host", "hostname"), "driver_version": ("driver_version",),
                "cuda_driver_max_version": ("cuda_driver_max_version", "cuda_driver_version"),
                "gpu_count": ("gpu_count", "device_count")}
DRIVER_VERSION = re.compile(r"^\d+(\.\d+)*$")
TOP = "(top level)"


class EvidenceFormatError(InputError):
    """An input file that is not its format: `path: field: problem`, one line (a harness error)."""

    def __init__(self, path: Path | str, field: str, problem: str) -> None:
        self.path, self.field, self.problem = str(path), field, problem
        super().__init__(f"{path}: {field}: {one_line(problem)}")


def _kind(value: Any) -> str:
    """What a JSON value is, in words."""
    if value is None:
        return "null"
    return {bool: "true/false", str: "a string", dict: "an object", list: "a list", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def first(raw: dict[str, Any], key: str) -> tuple[str | None, Any]:
    """(the key found, its value) for a fact under its name or an alias; (None, None) when absent."""
    return next(((k, raw[k]) for k in HOST_ALIASES.get(key, (key,)) if k in raw), (None, None))


def read_json(path: Path | str) -> Any:
    """A JSON document; not UTF-8 or not JSON is an EvidenceFormatError naming the line and column."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise EvidenceFormatError(path, TOP, f"not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise EvidenceFormatError(path, TOP, f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


def check_host_inventory(raw: Any, path: Path | str) -> None:
    """Raise EvidenceFormatError for the first field that is not the documented shape (module docstring)."""
    if not isinstance(raw, dict):
        raise EvidenceFormatError(path, TOP, f"{_kind(raw)}, not a JSON object (one node's inventory)")
    key, driver = first(raw, "driver_version")
    if key is None:
        raise EvidenceFormatError(path, "driver_version", 'missing (the NVIDIA driver version, e.g. "580.95.05"; '
                                  "`k3load inventory` writes the file)")
    if driver is not None and not (isinstance(driver, str) and DRIVER_VERSION.match(driver.strip())):
        raise EvidenceFormatError(path, "driver_version", f'{_kind(driver)} {json.dumps(driver)[:40]}, not a version '
                                  'string like "580.95.05"')
    count_key, count = first(raw, "gpu_count")
    gpus = raw.get("gpus")
    if count_key is None and "gpus" not in raw:
        raise EvidenceFormatError(path, "gpu_count", "missing, and no gpus list (the node's GPU count)")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise EvidenceFormatError(path, count_key or "gpu_count", f"{_kind(count)} {json.dumps(count)[:40]}, "
                                  "not a whole number >= 0")
    if gpus is not None:
        _check_gpus(gpus, count, path)
    for name in ("node", "cuda_driver_max_version"):
        key, value = first(raw, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
            raise EvidenceFormatError(path, key or name, f"{_kind(value)}, not a string")
    if raw.get("container_image") is not None and not isinstance(raw["container_image"], str):
        raise EvidenceFormatError(path, "container_image", f"{_kind(raw['container_image'])}, not a string")
    if raw.get("topology") is not None and not isinstance(raw["topology"], dict):
        raise EvidenceFormatError(path, "topology", f"{_kind(raw['topology'])}, not an object or null")


def _check_gpus(gpus: Any, count: Any, path: Path | str) -> None:
    if not isinstance(gpus, list):
        raise EvidenceFormatError(path, "gpus", f"{_kind(gpus)}, not a list of objects")
    for i, gpu in enumerate(gpus):
        if not isinstance(gpu, dict):
            raise EvidenceFormatError(path, f"gpus[{i}]", f"{_kind(gpu)}, not an object")
        if gpu.get("name") is not None and not isinstance(gpu["name"], str):
            raise EvidenceFormatError(path, f"gpus[{i}].name", f"{_kind(gpu['name'])}, not a string")
    if isinstance(count, int) and gpus and len(gpus) != count:
        raise EvidenceFormatError(path, "gpus", f"{len(gpus)} entries, but gpu_count is {count}")


def read_host_inventory(path: Path | str) -> dict[str, Any]:
    raw = read_json(path)
    check_host_inventory(raw, path)
    return raw


def inventory_node(raw: dict[str, Any], path: Path | str) -> str:
    """The node an inventory names: `node` (or an alias), else its file name without the `NN-` that the
    copy under evidence/hosts/ adds; the name NODE=PATH entries must match (k3load.precheck.node_files)."""
    value = next((raw[k] for k in HOST_ALIASES["node"] if raw.get(k) is not None), None)
    return str(value) if value else re.sub(r"^\d{2}-", "", Path(path).stem)


def inventory_nodes(paths: list[Path] | tuple[Path, ...] | list[str]) -> list[str]:
    """The node of each given inventory file (each read as its format: a bad one raises)."""
    return [inventory_node(read_host_inventory(path), path) for path in paths]


def check_collect_env(text: str, path: Path | str) -> dict[str, Any]:
    """The facts of a collect-env output; text that is not one (no version row at all) raises."""
    facts = parse_collect_env(text)
    if not facts["format_ok"]:
        raise EvidenceFormatError(path, "PyTorch version", "no `PyTorch version:` or `vLLM Version:` row: not the "
                                  "output of `vllm collect-env` (run it inside the serving container)")
    return facts


def read_custom_build(path: Path | str) -> dict[str, Any]:
    """A custom build record: a YAML/JSON mapping (whether it is complete is the custom_build rule's)."""
    try:
        record = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise EvidenceFormatError(path, TOP, f"not UTF-8 (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise EvidenceFormatError(path, TOP, f"not YAML/JSON: {getattr(exc, 'problem', None) or exc}{where}") from None
    if not isinstance(record, dict):
        raise EvidenceFormatError(path, TOP, f"{_kind(record)}, not a mapping (commit, pytorch_deps, build_time, "
                                  "reproduction, rollback_image)")
    return record


def check_input_files(*, container_info: Path | str | list[Path] | tuple[Path, ...] | None = None,
                      host_inventories: list[Path] | tuple[Path, ...] | list[str] = (),
                      custom_build: Path | str | None = None) -> None:
    """Every given file read as its format; the first that is not raises EvidenceFormatError.
    `container_info`: one collect-env, or each node's (k3load.precheck.node_files)."""
    for path in container_info if isinstance(container_info, list | tuple) else [container_info]:
        if path:
            check_collect_env(Path(path).read_text(encoding="utf-8", errors="replace"), path)
    for path in host_inventories:
        read_host_inventory(path)
    if custom_build:
        read_custom_build(custom_build)
