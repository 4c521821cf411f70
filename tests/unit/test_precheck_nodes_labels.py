"""A Kubernetes node's GPU operator labels read as a host inventory (`k3load inventory --from-node-labels`):
the labels the precheck needs are read to the value, and any document either becomes an inventory the
precheck accepts or is refused naming the file and the label (a parser of outside bytes: property tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3load.precheck.formats import EvidenceFormatError, check_host_inventory
from k3load.precheck.node_labels import inventory_from_node_labels

GFD = {"nvidia.com/cuda.driver.major": "580", "nvidia.com/cuda.driver.minor": "95", "nvidia.com/cuda.driver.rev": "05",
       "nvidia.com/gpu.count": "4", "nvidia.com/gpu.product": "NVIDIA-GB300", "nvidia.com/gpu.memory": "284208",
       "nvidia.com/cuda.runtime.major": "13", "nvidia.com/cuda.runtime.minor": "0",
       "kubernetes.io/hostname": "gb300-n01"}


def _node(labels: dict[str, Any], name: str = "gb300-n01") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def test_the_labels_become_the_inventory_the_rules_read() -> None:
    record = inventory_from_node_labels(_node(GFD), "n01.json", "vllm/vllm-openai:kimi-k3")
    assert (record["node"], record["driver_version"], record["gpu_count"], record["cuda_driver_max_version"]) == (
        "gb300-n01", "580.95.05", 4, "13.0")
    assert record["container_image"] == "vllm/vllm-openai:kimi-k3" and record["topology"] is None
    assert [g["name"] for g in record["gpus"]] == ["NVIDIA-GB300"] * 4
    assert {g["memory_total_mib"] for g in record["gpus"]} == {284208.0}


def test_the_newer_driver_version_labels_are_read_too() -> None:
    labels = {"nvidia.com/cuda.driver-version.full": "580.82.07", "nvidia.com/gpu.count": "8",
              "nvidia.com/cuda.runtime-version.major": "13", "nvidia.com/cuda.runtime-version.minor": "1"}
    record = inventory_from_node_labels(_node(labels), "n.json", None)
    said = (record["driver_version"], record["gpu_count"], record["cuda_driver_max_version"])
    assert said == ("580.82.07", 8, "13.1")


@pytest.mark.parametrize(("doc", "field"), [
    ({"kind": "Pod"}, "kind"),
    (_node({"nvidia.com/gpu.count": "4"}), "nvidia.com/cuda.driver.major"),
    (_node({k: v for k, v in GFD.items() if k != "nvidia.com/gpu.count"}), "nvidia.com/gpu.count"),
    (_node({**GFD, "nvidia.com/gpu.count": "four"}), "nvidia.com/gpu.count"),
    (_node(GFD, name=""), "metadata.name"),
])
def test_a_node_without_its_gpu_labels_is_refused_naming_the_label(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(EvidenceFormatError) as exc:
        inventory_from_node_labels(doc, "node.json", None)
    assert exc.value.field == field and exc.value.path == "node.json"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
LABEL_VALUES = st.one_of(st.text(max_size=10), st.from_regex(r"\d{1,4}", fullmatch=True))


@given(JSON)
def test_any_json_is_an_inventory_or_refused(doc: Any) -> None:
    _inventory_or_refused(doc)


@given(st.dictionaries(st.sampled_from([*sorted(GFD), "nvidia.com/cuda.driver-version.full"]), LABEL_VALUES))
def test_any_gpu_labels_give_an_inventory_the_precheck_accepts_or_are_refused(labels: dict[str, str]) -> None:
    _inventory_or_refused(_node(labels))


def _inventory_or_refused(doc: Any) -> None:
    try:
        record = inventory_from_node_labels(doc, "node.json", None)
    except EvidenceFormatError as exc:
        assert str(exc).startswith("node.json: ") and "\n" not in str(exc)
        return
    check_host_inventory(json.loads(json.dumps(record)), "node.json")  # the precheck reads what was written
    assert record["gpu_count"] == len(record["gpus"])


def test_the_cli_writes_the_inventory_and_refuses_a_pod(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from k3load.cli import main

    node, out = tmp_path / "node.json", tmp_path / "n01.json"
    node.write_text(json.dumps(_node(GFD)))
    assert main(["inventory", "--from-node-labels", str(node), "--container-image", "x:y", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["gpu_count"] == 4
    node.write_text(json.dumps({"kind": "Pod"}))
    assert main(["inventory", "--from-node-labels", str(node)]) == 2
    assert capsys.readouterr().err.strip().endswith("kind: 'Pod', not a Node (kubectl get node NAME -o json)")
