"""The precheck against the real vLLM CPU server (marker `vllm`, given by its fixtures): the server's own startup
log and a real `vllm collect-env` from its venv judged by both recipes, and every startup-log notice still said
where the installed vLLM says it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from k3load.precheck import run_precheck
from k3load.precheck.startup_log import NOTICES, Notice
from tests.sim.test_precheck_cli import GPU_RULES, KIMI, LOCAL, local_nvml_absent


def _collect_env(vllm_venv: Path, tmp_path: Path) -> Path:
    """A real `vllm collect-env` from the CPU server's own venv (as an operator saves it in the container)."""
    done = subprocess.run([str(vllm_venv / "bin" / "python"), "-m", "vllm.collect_env"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    path = tmp_path / "collect-env.txt"
    path.write_text(done.stdout)
    return path


def test_real_vllm_cpu_server(vllm_server, vllm_venv: Path, tmp_path: Path) -> None:
    """kimi-k3: fail (no NVIDIA driver, no CUDA 13 build info); local-dev: pass, GPU rules not applicable."""
    info = _collect_env(vllm_venv, tmp_path)
    kimi = run_precheck(tmp_path / "kimi", KIMI, vllm_server.base_url, container_info=info,
                        startup_log=vllm_server.log_path)
    by_id = {r["id"]: r for r in kimi["rules"]}
    assert kimi["status"] == "fail" and kimi["target"]["is_sim"] is False
    if local_nvml_absent():
        assert "no NVIDIA driver" in by_id["driver_branch"]["reason"]
    assert "no CUDA 13 build info" in by_id["cuda_build"]["reason"] and "2.13.0+cpu" in by_id["cuda_build"]["reason"]
    assert "startup log shows device cpu, not CUDA" in by_id["startup_log"]["reason"]
    assert "tool_call_parser is hermes" in by_id["serve_flags"]["reason"]
    assert by_id["vllm_version"]["status"] == "pass" and "/version, collect-env, startup log" in \
        by_id["vllm_version"]["reason"]
    local = run_precheck(tmp_path / "local", LOCAL, vllm_server.base_url, container_info=info,
                         startup_log=vllm_server.log_path)
    by_id = {r["id"]: r for r in local["rules"]}
    assert local["status"] == "pass", [(r["id"], r["reason"]) for r in local["rules"]]
    assert all(by_id[r]["reason"] == "not_applicable: local-dev recipe, no GPU rules" for r in GPU_RULES)
    log = by_id["startup_log"]
    assert log["details"]["flagged"] == [] and "device cpu, comm_backend gloo" in log["reason"]
    assert any("Triton is not installed" in w["text"] for w in log["details"]["other_warnings"])
    assert "not the k3load sim" in by_id["target_not_sim"]["reason"]


@pytest.mark.parametrize("notice", NOTICES, ids=lambda n: n.note[:24])
def test_every_notice_is_still_in_the_vllm_source(notice: Notice, vllm_venv: Path) -> None:
    """A notice cites where vLLM emits it; the installed vLLM (the suite's pinned CPU build, marker
    `vllm` through the fixture) must still say its opening words there."""
    (source,) = vllm_venv.glob("lib/python3*/site-packages/vllm")
    path, line = notice.source.split(",")[0].split(" ")[0].split(":")
    lines = (source.parent / path).read_text().splitlines()
    opening = notice.message.pattern.split("\\")[0].split("(")[0]
    assert len(opening) > 10 and opening in "\n".join(lines[int(line) - 3:int(line) + 3]), (path, line, opening)
