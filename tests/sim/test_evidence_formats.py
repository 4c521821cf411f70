"""The precheck's evidence files: their formats documented, checked and written (issue 38, part 5).

Every example under docs/examples/precheck/ reads as its format (a stale one fails here); `k3load inventory`
writes a node's inventory from nvidia-smi's CSV; a file that is not its format ends `k3load precheck` (exit 3,
its "could not run") and a Locust run (exit 2) with one line naming the file and the field, never a
rule failure or `rebuild`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3load.loadgen import observe
from k3load.loadgen.target import TargetApi
from k3load.precheck import run_precheck
from k3load.precheck.evidence import normalise_host
from k3load.precheck.formats import EvidenceFormatError, check_collect_env, read_custom_build, read_host_inventory
from k3load.precheck.inventory import inventory_from_csv
from k3load.precheck.rules import custom_build_problems

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples" / "precheck"
KIMI = ROOT / "recipes" / "kimi-k3.yaml"
IMAGE = "vllm/vllm-openai:kimi-k3"
CSV = (EXAMPLES / "nvidia-smi-query.csv").read_text()
MADE_UP = {"hostname": "node1", "driver": "580.95.05", "gpus": 4}  # the shape that gave `rebuild` (issue 38)


def _run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, input=stdin,
                          timeout=120, env={**os.environ, "K3_API_KEY": ""})
    assert time.monotonic() - started < 30, "a malformed file must end in seconds"
    return done


def _one_line(done: subprocess.CompletedProcess[str], code: int, line: str) -> None:
    assert done.returncode == code, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    lines = [x for x in done.stderr.splitlines() if "/INFO/" not in x]  # Locust's own log lines
    assert "Traceback" not in done.stderr and lines == [line], done.stderr[-3000:]


# -- the examples --------------------------------------------------------------------------------------------
def test_every_example_reads_as_its_format() -> None:
    assert sorted(p.name for p in EXAMPLES.iterdir()) == ["collect-env.txt", "custom-build.yaml",
                                                          "host-inventory.json", "nvidia-smi-query.csv"]
    host = normalise_host(read_host_inventory(EXAMPLES / "host-inventory.json"), "hosts/00-host-inventory.json")
    assert (host["node"], host["driver_version"], host["gpu_count"], host["problems"]) == ("gb300-n01", "580.95.05",
                                                                                            4, [])
    facts = check_collect_env((EXAMPLES / "collect-env.txt").read_text(), EXAMPLES / "collect-env.txt")
    assert (facts["cuda_build"], facts["driver_version"], facts["gpu_count"]) == ("13.0", "580.95.05", 4)
    assert custom_build_problems(read_custom_build(EXAMPLES / "custom-build.yaml")) == []


def test_the_example_inventory_is_what_k3load_inventory_writes_from_the_example_csv(tmp_path: Path) -> None:
    out = tmp_path / "n01.json"
    done = _run("-m", "k3load", "inventory", "--from-csv", str(EXAMPLES / "nvidia-smi-query.csv"), "--node",
                "gb300-n01", "--container-image", IMAGE, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_text() == (EXAMPLES / "host-inventory.json").read_text(), "regenerate the example"


def test_a_precheck_over_the_examples_judges_them(tmp_path: Path) -> None:
    compat = run_precheck(tmp_path / "run", KIMI, None, container_info=EXAMPLES / "collect-env.txt",
                          host_inventories=[EXAMPLES / "host-inventory.json"], image=IMAGE, use_local_nvml=False)
    rules = {r["id"]: r["status"] for r in compat["rules"]}
    assert rules["driver_branch"] == rules["cuda_build"] == rules["image_official"] == "pass", compat["rules"]


# -- k3load inventory: nvidia-smi's CSV ----------------------------------------------------------------------
def test_nvidia_smi_csv_with_or_without_units_and_header() -> None:
    want = inventory_from_csv(CSV, "a.csv", "n01", IMAGE)
    rows = CSV.splitlines()
    nounits = "\n".join([rows[0]] + [r.replace(" MiB", "") for r in rows[1:]])
    assert inventory_from_csv(nounits, "b.csv", "n01", IMAGE) == want
    assert inventory_from_csv("\n".join(r.replace(" MiB", "") for r in rows[1:]), "c.csv", "n01", IMAGE) == want
    short = "index, name, driver_version\n0, NVIDIA H100 80GB HBM3, 570.133.20\n"  # the required columns only
    gpu = inventory_from_csv(short, "d.csv", "h1", None)["gpus"][0]
    assert gpu == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": None, "memory_total_mib": None,
                   "pci_bus_id": None}
    na = CSV.replace("284208 MiB", "[N/A]")
    assert {g["memory_total_mib"] for g in inventory_from_csv(na, "e.csv", "n01", IMAGE)["gpus"]} == {None}


@pytest.mark.parametrize(("text", "line"), [
    ("", "(top level): empty: no GPU row (nvidia-smi saw no GPU?)"),
    ("index, name, uuid\n0, NVIDIA GB300, GPU-1\n",
     "line 1: no driver_version column (query index,name,uuid,memory.total,pci.bus_id,driver_version)"),
    (CSV.replace("0, NVIDIA GB300,", "0, NVIDIA, GB300,"), "line 2: 7 fields, expected 6 (index, name, uuid, "
     "memory.total, pci.bus_id, driver_version)"),
    (CSV.replace("\n2, ", "\nx, "), "line 4: index: 'x', not a GPU index"),
    (CSV.replace("284208 MiB", "lots"), "line 2: memory.total: 'lots', not a number of MiB"),
    (CSV.replace("580.95.05\n3,", "575.57.08\n3,"), "driver_version: differs between GPUs of one node: "
     "575.57.08, 580.95.05"),
    (CSV.replace(", 580.95.05\n1,", ", [N/A]\n1,"), "line 2: driver_version: not reported"),
])
def test_a_csv_that_is_not_nvidia_smis_is_exit_2_naming_the_file_and_field(tmp_path: Path, text: str,
                                                                          line: str) -> None:
    path = tmp_path / "gpus.csv"
    path.write_text(text)
    out = tmp_path / "n01.json"
    done = _run("-m", "k3load", "inventory", "--from-csv", str(path), "--node", "n01", "--out", str(out))
    _one_line(done, 2, f"k3load inventory: {path}: {line}")
    assert not out.exists()


def test_inventory_from_stdin_and_the_node_it_needs() -> None:
    done = _run("-m", "k3load", "inventory", "--from-csv", "-", "--node", "n07", stdin=CSV)
    assert done.returncode == 0 and json.loads(done.stdout)["node"] == "n07", done.stderr
    _one_line(_run("-m", "k3load", "inventory", "--from-csv", "-", stdin=CSV), 2,
              "k3load inventory: --from-csv needs --node (the name of the node the CSV came from)")


# -- malformed evidence files: an input error, never a verdict -----------------------------------------------
BAD_FILES = {  # name: (flag, file name, content, the line after "FILE: ")
    "made_up_inventory": ("--host-inventory", "node1.json", json.dumps(MADE_UP),
                          'driver_version: missing (the NVIDIA driver version, e.g. "580.95.05"; `k3load inventory` '
                          "writes the file)"),
    "not_json": ("--host-inventory", "n1.json", '{"driver_version": "580.95.05",\n', "(top level): not JSON: "
                 "Expecting property name enclosed in double quotes at line 2 column 1"),
    "driver_number": ("--host-inventory", "n1.json", json.dumps({"driver_version": 580, "gpu_count": 4}),
                      'driver_version: a number 580, not a version string like "580.95.05"'),
    "gpus_not_list": ("--host-inventory", "n1.json", json.dumps({"driver_version": "580.95.05", "gpus": 4}),
                      "gpus: a number, not a list of objects"),
    "count_mismatch": ("--host-inventory", "n1.json", json.dumps({"driver_version": "580.95.05", "gpu_count": 8,
                                                                  "gpus": [{"name": "NVIDIA GB300"}]}),
                       "gpus: 1 entries, but gpu_count is 8"),
    "collect_env_other": ("--container-info", "env.txt", "Driver Version: 580.95.05\nCUDA Version: 13.0\n",
                          "PyTorch version: no `PyTorch version:` or `vLLM Version:` row: not the output of `vllm "
                          "collect-env` (run it inside the serving container)"),
    "custom_build_yaml": ("--custom-build", "build.yaml", "commit: [abc\n", "(top level): not YAML/JSON: "
                          "expected ',' or ']', but got '<stream end>' at line 2 column 1"),
    "custom_build_list": ("--custom-build", "build.yaml", "- commit: abc\n",
                          "(top level): a list, not a mapping (commit, pytorch_deps, build_time, reproduction, "
                          "rollback_image)"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_k3load_precheck_on_a_malformed_file_is_its_could_not_run_exit_naming_file_and_field(
        tmp_path: Path, case: str) -> None:
    flag, name, content, line = BAD_FILES[case]
    path = tmp_path / name
    path.write_text(content)
    out = tmp_path / "run"
    done = _run("-m", "k3load", "precheck", "--recipe", str(KIMI), "--no-nvml", flag, str(path), "--out", str(out))
    _one_line(done, 3, f"k3load precheck: {path}: {line}")  # 3: could not run (its 2 is "inconclusive")
    assert not out.exists()  # nothing gathered, no compat.json: no verdict on a file that was not read


def test_a_recheck_of_a_saved_malformed_file_names_its_copy(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_precheck(run, KIMI, None, host_inventories=[EXAMPLES / "host-inventory.json"], use_local_nvml=False)
    copy = run / "evidence" / "hosts" / "00-host-inventory.json"
    copy.write_text(json.dumps(MADE_UP))
    done = _run("-m", "k3load", "precheck", "--recheck", "--out", str(run))
    _one_line(done, 3, f"k3load precheck: {copy}: driver_version: missing (the NVIDIA driver version, e.g. "
              '"580.95.05"; `k3load inventory` writes the file)')


def test_the_locust_run_stops_at_init_with_exit_2_naming_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "node1.json"
    path.write_text(json.dumps(MADE_UP))
    out = tmp_path / "out"
    done = _run("-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless", "--only-summary",
                "--host", "http://127.0.0.1:9", "--k3-out", str(out), "--k3-plan", "smoke",
                "--k3-recipe", "recipes/local-dev.yaml", "--k3-host-inventory", str(path))
    _one_line(done, 2, f"k3load: harness error: {path}: driver_version: missing (the NVIDIA driver version, e.g. "
              '"580.95.05"; `k3load inventory` writes the file)')
    assert not out.exists()  # before the run directory, the server or any load


def test_the_locust_precheck_at_run_time_raises_the_input_error(tmp_path: Path) -> None:
    """The run-time path (the web UI may change the files after `init`): an input error, no compat.json."""
    path = tmp_path / "node1.json"
    path.write_text(json.dumps(MADE_UP))
    opts = SimpleNamespace(k3_recipe=str(KIMI), k3_container_info="", k3_host_inventory=[str(path)],
                           k3_startup_log="", k3_image="", k3_custom_build="", k3_api_key="", k3_nvml="off",
                           k3_metrics_url=[])
    run = SimpleNamespace(run_dir=tmp_path / "run", target=TargetApi(None, opts))  # type: ignore[arg-type]
    with pytest.raises(EvidenceFormatError, match=r"node1.json: driver_version: missing"):
        observe.precheck(run, stop=lambda: None)  # type: ignore[arg-type]
    assert not (tmp_path / "run" / "compat.json").exists()
