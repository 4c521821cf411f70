"""`k3load precheck` end to end: the real CLI process against a real sim (local-dev passes, the K3
recipe fails with its reasons), exit codes, the bearer key never written. Against the real vLLM CPU server:
tests/real/test_precheck_vllm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from k3load.precheck import run_precheck

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "recipes" / "local-dev.yaml"
KIMI = ROOT / "recipes" / "kimi-k3.yaml"
GPU_RULES = ("image_official", "cuda_build", "driver_branch", "gpu_count", "gpu_model", "node_consistency")
SECRET = "sk-k3load-test-0f9e8d7c6b5a-DO-NOT-WRITE"


def precheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3load.precheck.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def rules(out: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    compat = json.loads((out / "compat.json").read_text())
    return compat, {r["id"]: r for r in compat["rules"]}


def local_nvml_absent() -> bool:
    try:
        from k3load.sampler.nvml import inventory
    except ImportError:
        return True
    return inventory(nvml=None) is None


def test_sim_with_local_dev_recipe_passes_with_gpu_rules_not_applicable(start_sim, tmp_path: Path) -> None:
    sim = start_sim("--vllm-version", "0.32.0")
    out = tmp_path / "run"
    done = precheck("--recipe", str(LOCAL), "--base-url", sim.base_url, "--startup-log", str(sim.log_path),
                    "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    compat, by_id = rules(out)
    assert compat["status"] == "pass" and compat["target"] == {"base_url": sim.base_url, "is_sim": True,
                                                                "sim_marker": "k3load_sim_info on /metrics"}
    for rule in GPU_RULES:
        assert by_id[rule]["status"] == "not_applicable"
        assert by_id[rule]["reason"] == "not_applicable: local-dev recipe, no GPU rules"
    assert compat["not_applicable"] == ["not_applicable: local-dev recipe, no GPU rules"]
    assert "accepted by the local-dev recipe" in by_id["target_not_sim"]["reason"]
    assert "vLLM 0.32.0 >= 0.27.1" in by_id["vllm_version"]["reason"]
    assert by_id["serve_flags"]["reason"] == "enable_prefix_caching=True"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("compat precheck: PASS") and "[k3load sim: never evidence]" in lines[0]
    assert sum(1 for line in lines if line.startswith("  not_applicable ")) == len(GPU_RULES) + 1
    assert "  not_applicable: local-dev recipe, no GPU rules" in lines
    assert (out / "evidence" / "server" / "metrics.txt").is_file() and (out / "evidence" / "startup.log").is_file()


def test_sim_with_kimi_k3_recipe_fails_with_the_reasons(start_sim, tmp_path: Path) -> None:
    sim = start_sim()
    out = tmp_path / "run"
    done = precheck("--recipe", str(KIMI), "--base-url", sim.base_url, "--out", str(out))  # local NVML tried
    assert done.returncode == 1, done.stdout + done.stderr
    compat, by_id = rules(out)
    assert compat["status"] == "fail" and compat["target"]["is_sim"] is True
    assert by_id["target_not_sim"]["status"] == "fail"
    assert "target is the k3load sim" in by_id["target_not_sim"]["reason"]
    assert "the sim is never evidence" in by_id["target_not_sim"]["reason"]
    assert by_id["cuda_build"]["status"] == "fail" and "no CUDA 13 build info" in by_id["cuda_build"]["reason"]
    assert by_id["driver_branch"]["status"] == "fail"
    if local_nvml_absent():
        assert "no NVIDIA driver" in by_id["driver_branch"]["reason"]
    assert by_id["image_official"]["status"] == "fail" and "not recorded" in by_id["image_official"]["reason"]
    assert by_id["startup_log"]["status"] == "inconclusive"
    assert len([line for line in done.stdout.splitlines() if line.startswith("  ")]) == len(compat["rules"])


def test_bearer_key_reaches_no_file_and_no_output(start_sim, tmp_path: Path) -> None:
    sim = start_sim()
    out = tmp_path / "run"
    env = {**os.environ, "K3_API_KEY": SECRET}
    base = sim.base_url.replace("http://", f"http://user:{SECRET}@")  # credentials in the URL are dropped too
    done = precheck("--recipe", str(LOCAL), "--base-url", base, "--no-nvml", "--out", str(out), env=env)
    assert done.returncode == 2, done.stdout + done.stderr  # no startup log: inconclusive
    assert SECRET not in done.stdout + done.stderr
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    compat, _ = rules(out)
    assert compat["target"]["base_url"] == sim.base_url and "no local NVML: --no-nvml" in compat["notes"]


def test_api_run_precheck_sends_the_key_only_as_a_header(start_sim, tmp_path: Path) -> None:
    sim = start_sim()
    compat = run_precheck(tmp_path / "run", LOCAL, sim.base_url, startup_log=sim.log_path, api_key=SECRET,
                          use_local_nvml=False)
    assert compat["status"] == "pass"
    assert not any(SECRET.encode() in p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file())


def test_exit_codes_for_bad_inputs_and_recheck(start_sim, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(LOCAL.read_text() + "gpus: 8\n")
    done = precheck("--recipe", str(bad), "--out", str(tmp_path / "a"))
    assert done.returncode == 3 and f"{bad}: (top level): Additional properties" in done.stderr
    assert not (tmp_path / "a").exists()  # nothing gathered for an invalid recipe
    done = precheck("--recipe", str(LOCAL), "--startup-log", str(tmp_path / "missing.log"), "--out",
                    str(tmp_path / "b"))
    assert done.returncode == 3 and "--startup-log" in done.stderr and "no such file" in done.stderr
    done = precheck("--recipe", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "n"))
    assert done.returncode == 3 and done.stderr == f"k3load precheck: --recipe {tmp_path / 'nope.yaml'}: no such file\n"
    sim = start_sim()
    out = tmp_path / "c"
    assert precheck("--recipe", str(LOCAL), "--base-url", sim.base_url, "--startup-log", str(sim.log_path),
                    "--no-nvml", "--out", str(out)).returncode == 0
    sim.stop()  # the record is judged again with the server gone
    first, _ = rules(out)
    done = precheck("--recheck", "--out", str(out))
    again, _ = rules(out)
    assert done.returncode == 0 and again["rules"] == first["rules"]
    done = precheck("--recheck", "--recipe", str(KIMI), "--out", str(out))
    assert done.returncode == 1 and "target is the k3load sim" in done.stdout


def test_unreachable_server_fails(tmp_path: Path) -> None:
    compat = run_precheck(tmp_path / "run", LOCAL, "http://127.0.0.1:9", use_local_nvml=False)
    by_id = {r["id"]: r for r in compat["rules"]}
    assert compat["status"] == "fail" and by_id["server_reachable"]["status"] == "fail"
    assert "did not answer: /version: ConnectError" in by_id["server_reachable"]["reason"]


def test_cli_help_lists_every_option() -> None:
    done = precheck("--help")
    for flag in ("--recipe", "--base-url", "--container-info", "--host-inventory", "--startup-log", "--image",
                 "--custom-build", "--no-nvml", "--out", "--recheck", "Exit status: 0 pass, 1 fail, 2 inconclusive"):
        assert flag in done.stdout
