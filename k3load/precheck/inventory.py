"""`k3load inventory`: one node's GPU inventory, in the format `--host-inventory` reads.

    k3load inventory --container-image vllm/vllm-openai:kimi-k3 --out n01.json          # on the node
    nvidia-smi --query-gpu=index,name,uuid,memory.total,pci.bus_id,driver_version --format=csv > n01.csv
    k3load inventory --from-csv n01.csv --node n01 --container-image vllm/vllm-openai:kimi-k3 --out n01.json
    kubectl get node n01 -o json > n01-node.json      # on Kubernetes: the GPU operator's node labels
    k3load inventory --from-node-labels n01-node.json --container-image vllm/vllm-openai:kimi-k3 --out n01.json

On the node it runs that nvidia-smi query itself; `--from-csv FILE` (`-`: stdin) converts a saved one
(from a node where k3load is not installed). The CSV is nvidia-smi's: a header row naming the queried
fields (`memory.total [MiB]`), values with or without units (`--format=csv,nounits` too); without a
header (`noheader`) the columns are the ones above, in that order. index, name and driver_version are
required. `--from-node-labels FILE` reads a Kubernetes node's GPU Feature Discovery labels instead
(k3load/precheck/node_labels.py; `-`: stdin). What is written is the format of k3load/precheck/formats.py
(docs/running.md), checked before it is written. Exit 0 written, 2 when the CSV (or the node) is not that
format (naming the file, the line or label and the field) or nvidia-smi cannot run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from k3load.precheck.formats import EvidenceFormatError, check_host_inventory, read_json
from k3load.precheck.node_labels import inventory_from_node_labels

QUERY = ("index", "name", "uuid", "memory.total", "pci.bus_id", "driver_version")
REQUIRED = ("index", "name", "driver_version")
NVIDIA_SMI = ("nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv")
MISSING = {"", "[n/a]", "n/a", "[not supported]"}
EXIT_ERROR = 2


def _value(text: str) -> str | None:
    text = text.strip()
    return None if text.lower() in MISSING else text


def _columns(rows: list[list[str]], path: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """The column names (from the header, units dropped, or QUERY) and the numbered data rows."""
    numbered = [(n, row) for n, row in enumerate(rows, 1) if any(cell.strip() for cell in row)]
    if not numbered:
        raise EvidenceFormatError(path, "(top level)", "empty: no GPU row (nvidia-smi saw no GPU?)")
    first = [cell.strip() for cell in numbered[0][1]]
    if first and first[0] == "index":
        names = [cell.split(" [")[0] for cell in first]  # "memory.total [MiB]" -> "memory.total"
        numbered = numbered[1:]
    else:
        names = list(QUERY)
    missing = [name for name in REQUIRED if name not in names]
    if missing:
        raise EvidenceFormatError(path, "line 1", f"no {', '.join(missing)} column (query {','.join(QUERY)})")
    for n, row in numbered:
        if len(row) != len(names):
            raise EvidenceFormatError(path, f"line {n}", f"{len(row)} fields, expected {len(names)} "
                                      f"({', '.join(names)})")
    if not numbered:
        raise EvidenceFormatError(path, "(top level)", "a header and no GPU row")
    return names, numbered


def _number(text: str | None, path: str, where: str) -> float | None:
    if text is None:
        return None
    try:
        return float(text.split()[0])  # "81559 MiB" or "81559"
    except (ValueError, IndexError):
        raise EvidenceFormatError(path, where, f"{text!r}, not a number of MiB") from None


def gpus_from_csv(text: str, path: str) -> tuple[str, list[dict[str, Any]]]:
    """(driver version, one entry per GPU) from nvidia-smi's CSV; EvidenceFormatError when it is not that."""
    names, rows = _columns(list(csv.reader(io.StringIO(text), skipinitialspace=True)), path)
    gpus, drivers = [], set()
    for n, row in rows:
        cell = dict(zip(names, (_value(c) for c in row), strict=True))
        index = cell["index"]
        if index is None or not index.isdigit():
            raise EvidenceFormatError(path, f"line {n}: index", f"{index!r}, not a GPU index")
        if cell["driver_version"] is None:
            raise EvidenceFormatError(path, f"line {n}: driver_version", "not reported")
        drivers.add(cell["driver_version"])
        gpus.append({"index": int(index), "name": cell["name"], "uuid": cell.get("uuid"),
                     "memory_total_mib": _number(cell.get("memory.total"), path, f"line {n}: memory.total"),
                     "pci_bus_id": cell.get("pci.bus_id")})
    if len(drivers) != 1:
        raise EvidenceFormatError(path, "driver_version", "differs between GPUs of one node: "
                                  + ", ".join(sorted(drivers)))
    return drivers.pop(), gpus


def inventory_from_csv(text: str, path: str, node: str, container_image: str | None) -> dict[str, Any]:
    """The node's inventory (the --host-inventory format), checked as the precheck will read it."""
    driver, gpus = gpus_from_csv(text, path)
    record = {"node": node, "container_image": container_image, "source": "nvidia-smi", "host": node,
              "driver_version": driver, "cuda_driver_max_version": None, "gpu_count": len(gpus), "gpus": gpus,
              "topology": None}
    check_host_inventory(record, path)
    return record


def _nvidia_smi() -> str:
    """The query's CSV from this node's nvidia-smi; an error names what failed."""
    try:
        done = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise OSError("nvidia-smi not found: no NVIDIA driver on this host? (--from-csv FILE converts a saved "
                      "query)") from None
    except subprocess.TimeoutExpired:
        raise OSError("nvidia-smi did not answer in 60 s") from None
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())[:300]
        raise OSError(f"nvidia-smi exited {done.returncode}: {said}")
    return done.stdout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from-csv", metavar="FILE", help="convert a saved `nvidia-smi --query-gpu=... "
                        "--format=csv` output (`-`: stdin) instead of running nvidia-smi here; needs --node")
    parser.add_argument("--from-node-labels", metavar="FILE", help="convert a Kubernetes node's GPU operator "
                        "labels (`kubectl get node NAME -o json`; `-`: stdin) instead: the node is its metadata.name")
    parser.add_argument("--node", help="the node's name (default: this host's name; required with --from-csv)")
    parser.add_argument("--container-image", help="the container image (repository:tag) this node serves")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")


def run(args: argparse.Namespace) -> int:
    """Write the inventory; exit 2 with one line when the CSV is not nvidia-smi's or nvidia-smi fails."""
    if args.from_csv and not args.node:
        print("k3load inventory: --from-csv needs --node (the name of the node the CSV came from)", file=sys.stderr)
        return EXIT_ERROR
    try:
        if args.from_node_labels:
            return _write(_from_node_labels(args.from_node_labels, args.container_image), args.out)
        if args.from_csv == "-":
            text, path = sys.stdin.read(), "<stdin>"
        elif args.from_csv:
            text, path = Path(args.from_csv).read_text(encoding="utf-8"), args.from_csv
        else:
            text, path = _nvidia_smi(), "nvidia-smi"
        record = inventory_from_csv(text, path, args.node or socket.gethostname(), args.container_image)
    except (EvidenceFormatError, OSError, UnicodeDecodeError) as exc:
        print(f"k3load inventory: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return _write(record, args.out)


def _from_node_labels(source: str, container_image: str | None) -> dict[str, Any]:
    if source == "-":
        try:
            doc = json.loads(sys.stdin.read())
        except json.JSONDecodeError as exc:
            raise EvidenceFormatError("<stdin>", "(top level)", f"not JSON: {exc.msg}") from None
        return inventory_from_node_labels(doc, "<stdin>", container_image)
    return inventory_from_node_labels(read_json(source), source, container_image)


def _write(record: dict[str, Any], out: Path | None) -> int:
    text = json.dumps(record, indent=2) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        from k3load.rundir import write_atomic

        write_atomic(out, text)
        print(f"k3load inventory: {record['node']}: {record['gpu_count']} GPUs, driver {record['driver_version']} "
              f"-> {out}", file=sys.stderr)
    return 0
