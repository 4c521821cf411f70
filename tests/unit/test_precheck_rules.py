"""The compat rules on a table of saved evidence (tests/data/precheck): each case asserts the overall
status and, rule by rule, the status and the words of the reason — a label alone proves nothing."""

from __future__ import annotations

import json
import shutil
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest

from k3load.precheck import PrecheckError, recheck, run_precheck
from k3load.precheck.evidence import Evidence
from k3load.precheck.recipe import load_recipe
from k3load.precheck.rules import vllm_version

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "precheck"
KIMI = ROOT / "recipes" / "kimi-k3.yaml"
K3_IMAGE = "vllm/vllm-openai:kimi-k3"
CUSTOM_IMAGE = "registry.example.internal/ml/vllm-k3:cu129-5f3a9c1e2"
GOOD_HOSTS = ("gb300-n01.json", "gb300-n02.json")
PASSING = ("server_reachable", "metrics_reachable", "target_not_sim", "vllm_version", "image_official", "cuda_build",
           "driver_branch", "gpu_count", "gpu_model", "node_consistency", "serve_flags", "startup_log")

# case: inputs, overall status, {rule: (status, [words the reason must contain])}
CASES: dict[str, dict[str, Any]] = {
    "all_good": dict(
        container="cu130-gb300.txt", hosts=GOOD_HOSTS, log="k3-clean.log", image=K3_IMAGE, server=True,
        status="pass", expect={
            "cuda_build": ("pass", ["CUDA 13.0 build", "2.10.0+cu130", "CUDA runtime 13.0.88"]),
            "driver_branch": ("pass", ["R580+ on every node", "gb300-n01 580.95.05", "gb300-n02 580.95.05"]),
            "gpu_count": ("pass", ["8 GPUs across 2 node(s)", ">= 8"]),
            "gpu_model": ("pass", ["NVIDIA GB300"]),
            "image_official": ("pass", [K3_IMAGE]),
            "node_consistency": ("pass", ["2 node(s) on driver 580.95.05"]),
            "vllm_version": ("pass", ["vLLM 0.27.1 >= 0.27.1", "/version, collect-env, startup log"]),
            "serve_flags": ("pass", ["tool_call_parser=kimi_k3", "reasoning_parser=kimi_k3",
                                     "enable_prefix_caching=True"]),
            "startup_log": ("pass", ["no NCCL, communication or kernel warnings", "device cuda", "comm_backend nccl",
                                     "nccl_version 2.28.7", "1 other warning(s)"]),
            "custom_build": ("not_applicable", ["no custom build declared"]),
        }),
    "eager_mode": dict(  # --enforce-eager is a choice, not a broken kernel stack: named, not judged
        container="cu130-gb300.txt", hosts=GOOD_HOSTS, log="k3-eager.log", image=K3_IMAGE, server=True,
        status="pass", expect={
            "startup_log": ("pass", ["no NCCL, communication or kernel warnings", "device cuda", "3 other warning(s)",
                                     "noted, not judged: --enforce-eager: torch.compile and CUDA graphs off"]),
            **{rule: ("pass", []) for rule in PASSING if rule != "startup_log"},
        }),
    "r575_host": dict(
        container="cu130-gb300-r575.txt", hosts=("gb300-n01-r575.json", "gb300-n02-r575.json"), image=K3_IMAGE,
        status="fail", expect={
            "driver_branch": ("fail", ["gb300-n01 driver 575.57.08 (R575) is below R580",
                                       "gb300-n02 driver 575.57.08 (R575) is below R580", "not 'probably works'"]),
            "cuda_build": ("fail", ["CUDA 13.0 build", "CUDA does not initialise inside the container",
                                    "Is CUDA available: False", "driver 575.57.08"]),
            "node_consistency": ("pass", ["575.57.08"]),
        }),
    "r580_host_cuda12_container": dict(
        container="cu128-gb300.txt", hosts=("gb300-n01-cu128.json", "gb300-n02-cu128.json"), log="k3-clean.log",
        image="vllm/vllm-openai:v0.27.1", status="fail", expect={
            "cuda_build": ("fail", ["container built with CUDA 12.8", "2.9.1+cu128", "needs a CUDA 13 build"]),
            "driver_branch": ("pass", ["580.95.05"]),
            "image_official": ("fail", ["not the K3 image", "vllm/vllm-openai:v0.27.1 (--image)"]),
        }),
    "mixed_nodes": dict(
        container="cu130-gb300.txt", hosts=("gb300-n01.json", "gb300-n02-mixed.json"), log="k3-clean.log",
        image=K3_IMAGE, status="fail", expect={
            "node_consistency": ("fail", ["nodes differ in driver: gb300-n01 580.95.05, gb300-n02 580.82.07",
                                          "nodes differ in container tag", "node gb300-n02 vllm/vllm-openai:v0.27.1"]),
            "image_official": ("fail", ["vllm/vllm-openai:v0.27.1 (node gb300-n02)"]),
            "driver_branch": ("pass", ["gb300-n02 580.82.07"]),
        }),
    "nccl_warning": dict(
        container="cu130-gb300.txt", hosts=GOOD_HOSTS, log="k3-nccl-warning.log", image=K3_IMAGE, server=True,
        status="fail", expect={
            "startup_log": ("fail", ["2 NCCL/communication/kernel warning(s)", "[communication]",
                                     "Custom allreduce is disabled", "[nccl]", "NCCL WARN NET/IB"]),
            **{rule: ("pass", []) for rule in PASSING if rule != "startup_log"},
        }),
    "custom_build": dict(
        container="cu129-custom.txt", hosts=("gb300-n01-custom.json", "gb300-n02-custom.json"), image=CUSTOM_IMAGE,
        custom="complete.yaml", status="fail", expect={
            "image_official": ("fail", ["custom build declared", "never passes as the official image", K3_IMAGE]),
            "cuda_build": ("fail", ["container built with CUDA 12.9", "custom build declared"]),
            "custom_build": ("pass", ["commit 5f3a9c1e2b4d", "rollback image vllm/vllm-openai:kimi-k3",
                                      "judged apart from the official image"]),
            "vllm_version": ("pass", ["0.27.2.dev41+g5f3a9c1e2", "git sha 5f3a9c1e2"]),
            "node_consistency": ("pass", [CUSTOM_IMAGE]),
        }),
    "custom_build_incomplete": dict(
        container="cu129-custom.txt", hosts=("gb300-n01-custom.json", "gb300-n02-custom.json"), image=CUSTOM_IMAGE,
        custom="incomplete.yaml", status="fail", expect={
            "custom_build": ("fail", ["custom build record incomplete", "missing build_time, rollback_image"]),
        }),
    "nvidia_smi_cuda_only": dict(
        hosts=GOOD_HOSTS, image=K3_IMAGE, status="fail", expect={
            "cuda_build": ("fail", ["no CUDA 13 build info", "no collect-env output saved", "13.0 on gb300-n01",
                                    "the driver's maximum, not the build"]),
            "driver_branch": ("pass", []),
        }),
    "one_node_four_gpus": dict(
        container="cu130-gb300.txt", hosts=("gb300-n01.json",), image=K3_IMAGE, status="fail", expect={
            "gpu_count": ("fail", ["4 GPUs (gb300-n01: 4); the recipe needs at least 8"]),
            "node_consistency": ("pass", ["one node: real production is multi-node"]),
        }),
}


def judge_case(out: Path, case: dict[str, Any]) -> dict[str, Any]:
    """Gather the case's files as an operator would, add the saved server answers, judge offline."""
    compat = run_precheck(
        out, KIMI, None, container_info=DATA / "collect-env" / case["container"] if "container" in case else None,
        host_inventories=[DATA / "hosts" / h for h in case["hosts"]],
        startup_log=DATA / "logs" / case["log"] if "log" in case else None, image=case.get("image"),
        custom_build=DATA / "custom-build" / case["custom"] if "custom" in case else None, use_local_nvml=False)
    if case.get("server"):
        shutil.copytree(DATA / "server-k3", out / "evidence" / "server")
        compat = recheck(out)
    return compat


def by_id(compat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {rule["id"]: rule for rule in compat["rules"]}


@pytest.mark.parametrize("name", CASES)
def test_case(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    compat = judge_case(tmp_path / "run", case)
    rules = by_id(compat)
    for rule_id, (status, words) in case["expect"].items():
        rule = rules[rule_id]
        assert rule["status"] == status, (rule_id, rule["reason"])
        for word in words:
            assert word in rule["reason"], (rule_id, word, rule["reason"])
        assert all((tmp_path / "run" / "evidence" / path).is_file() for path in rule["evidence"]), rule
    assert compat["status"] == case["status"], [(r["id"], r["status"], r["reason"]) for r in compat["rules"]]
    saved = json.loads((tmp_path / "run" / "compat.json").read_text())
    assert saved["rules"] == compat["rules"] and saved["status"] == compat["status"]


def test_all_good_without_a_server_is_inconclusive_not_pass(tmp_path: Path) -> None:
    case = {**CASES["all_good"], "server": False}
    rules = by_id(compat := judge_case(tmp_path / "run", case))
    assert compat["status"] == "inconclusive"
    assert {r["id"] for r in compat["rules"] if r["status"] == "inconclusive"} == {"server_reachable",
                                                                                   "metrics_reachable",
                                                                                   "target_not_sim"}
    assert "no --base-url" in rules["server_reachable"]["reason"]
    assert rules["serve_flags"]["status"] == "pass"  # prefix caching read from the startup log's args


def test_custom_build_has_its_own_section_and_is_never_official(tmp_path: Path) -> None:
    compat = judge_case(tmp_path / "run", CASES["custom_build"])
    section = compat["custom_build"]
    assert section["official"] is False and section["complete"] is True and section["problems"] == []
    assert section["record"]["rollback_image"] == K3_IMAGE and section["record"]["build_time"]
    assert section["observed"] == {"cuda_build": "12.9", "torch_version": "2.9.0+cu129",
                                   "vllm_version": "0.27.2.dev41+g5f3a9c1e2", "vllm_git_sha": "5f3a9c1e2"}
    assert section["image"] == CUSTOM_IMAGE and section["file"] == "custom-build.yaml"
    assert judge_case(tmp_path / "plain", CASES["all_good"])["custom_build"] is None


def test_evidence_is_a_byte_copy_fixed_by_hash_and_recheck_is_identical(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = judge_case(out, CASES["nccl_warning"])
    assert (out / "evidence" / "startup.log").read_bytes() == (DATA / "logs" / "k3-nccl-warning.log").read_bytes()
    index = json.loads((out / "evidence" / "index.json").read_text())
    sources = {f["path"]: f["source"] for f in index["files"]}
    assert sources["container/collect-env.txt"] == str(DATA / "collect-env" / "cu130-gb300.txt")
    assert {"hosts/00-gb300-n01.json", "hosts/01-gb300-n02.json"} <= set(sources)
    hashes = {e["path"]: e["sha256"] for e in first["evidence"]}
    assert "server/metrics.txt" in hashes and "recipe.yaml" in hashes
    assert all(h == sha256((out / "evidence" / p).read_bytes()).hexdigest() for p, h in hashes.items())
    moved = tmp_path / "elsewhere"
    shutil.copytree(out, moved)  # judged again on another machine, recipe from the saved copy
    again = recheck(moved)
    assert again["rules"] == first["rules"] and again["status"] == first["status"]
    assert again["recipe"]["sha256"] == first["recipe"]["sha256"]


def _ev(**server_and_container: Any) -> Evidence:
    ev = Evidence()
    if "server_version" in server_and_container:
        ev.server = {"version": server_and_container["server_version"], "endpoints": {}}
    if "container_version" in server_and_container:
        ev.container = {"vllm_version": server_and_container["container_version"],
                        "vllm_git_sha": server_and_container.get("sha"),
                        "vllm_local_changes": server_and_container.get("dirty")}
    return ev


@pytest.mark.parametrize(("evidence", "status", "words"), [
    (_ev(server_version="0.27.1"), "pass", ["0.27.1 >= 0.27.1", "release 0.27.1"]),
    (_ev(server_version="0.27.1.post1"), "pass", ["0.27.1.post1"]),
    (_ev(server_version="0.27.1rc2"), "fail", ["below the recipe's 0.27.1"]),
    (_ev(server_version="0.26.3"), "fail", ["vLLM 0.26.3 is below the recipe's 0.27.1"]),
    (_ev(server_version="0.28.0.dev12"), "fail", ["not pinned", "dev build 0.28.0.dev12 without a git sha"]),
    (_ev(server_version="dev"), "fail", ["'dev' is not an exact version"]),
    (_ev(container_version="0.28.0.dev12+g0a1b2c3d4.d20260818", sha="0a1b2c3d4", dirty=True), "fail",
     ["uncommitted local changes"]),
    (_ev(container_version="0.28.0.dev12+g0a1b2c3d4", sha="0a1b2c3d4", dirty=False), "pass", ["git sha 0a1b2c3d4"]),
    (_ev(server_version="0.32.0", container_version="0.27.1"), "fail",
     ["disagree", "/version 0.32.0, collect-env 0.27.1"]),
    (Evidence(), "fail", ["vLLM version not recorded"]),
])
def test_vllm_version_pinning(evidence: Evidence, status: str, words: list[str]) -> None:
    rule = vllm_version(load_recipe(KIMI), evidence)
    assert rule["status"] == status, rule["reason"]
    for word in words:
        assert word in rule["reason"], rule["reason"]


def test_local_nvml_inventory_is_a_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lazy NVML path, through the sampler's real inventory() on its fake library (no GPU here)."""
    fake_nvml = pytest.importorskip("tests.fake_nvml")
    from k3load.sampler import nvml

    real = nvml.inventory
    lib = fake_nvml.FakeNvml(gpus=[fake_nvml.FakeGpu()], driver_version="575.57.08", cuda_driver_version=12090)
    monkeypatch.setattr(nvml, "inventory", lambda nvml=None: real(nvml=lib))
    compat = run_precheck(tmp_path / "run", KIMI, None, container_info=DATA / "collect-env" / "cu130-gb300.txt",
                          image=K3_IMAGE)
    rules = by_id(compat)
    saved = json.loads((tmp_path / "run" / "evidence" / "hosts" / "local-nvml.json").read_text())
    assert saved["driver_version"] == "575.57.08" and saved["container_image"] == K3_IMAGE
    assert "hosts/local-nvml.json" in rules["driver_branch"]["evidence"]
    assert "575.57.08 (R575) is below R580" in rules["driver_branch"]["reason"]
    assert "collect-env saw driver 580.95.05 inside the container" in rules["driver_branch"]["reason"]
    assert "not GB300-class: NVIDIA H200" in rules["gpu_model"]["reason"]
    assert "1 GPUs" in rules["gpu_count"]["reason"]


def test_inputs_inside_the_evidence_folder_are_refused(tmp_path: Path) -> None:
    first = tmp_path / "run"
    judge_case(first, CASES["all_good"])
    with pytest.raises(PrecheckError, match="which a new precheck replaces"):
        run_precheck(first, KIMI, None, startup_log=first / "evidence" / "startup.log", use_local_nvml=False)
    assert (first / "evidence" / "startup.log").is_file()
