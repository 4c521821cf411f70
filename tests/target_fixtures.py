"""pytest plugin: the real vLLM CPU server, for tests marked ``vllm``.

Loaded by ``tests/conftest.py`` (``pytest_plugins = ["tests.target_fixtures"]``). Fixtures:

- ``vllm_venv``: the vLLM venv (``ensure_venv``; ~4 min from nothing, instant when cached).
- ``tiny_model_dir``: the tiny model built by that venv (~10 s, cached by tiny_model.py's hash).
- ``vllm_server``: ONE server for the whole session, started on first request, stopped at the end.
  It runs with ``--num-gpu-blocks-override 24`` (3,072 KV tokens in blocks of 128), so the same
  server shows prefix-cache hits on sequential requests sharing a ~1,000-token prefix and
  preemptions under 32 concurrent 256-token requests (both checked in test_vllm_target.py).
  Yields a ``VllmTarget`` with ``base_url`` (``http://127.0.0.1:PORT``), ``model`` (``"tiny"``),
  ``log_path``, ``max_model_len`` and the underlying ``server``.

Cache: ``$K3LOAD_CACHE`` if set, else ``<repo>/.cache/k3load`` (gitignored), so a checkout's test
runs share one install and CI can cache that folder. Nothing starts unless a test asks for these
fixtures; any test that uses ``vllm_server`` is given the ``vllm`` marker automatically, so
``-m "not vllm"`` always deselects it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from k3load.targets.vllm_cpu import VllmCpuServer, ensure_tiny_model, ensure_venv

REPO = Path(__file__).resolve().parents[1]
# Small enough that 32 x 256 tokens preempt, large enough for one 2,048-token context (16 blocks).
SERVER_ARGS = ("--num-gpu-blocks-override", "24")
VLLM_FIXTURES = {"vllm_server", "vllm_venv", "tiny_model_dir"}


def cache_dir() -> Path:
    """``$K3LOAD_CACHE`` or ``<repo>/.cache/k3load``."""
    env = os.environ.get("K3LOAD_CACHE")
    return Path(env) if env else REPO / ".cache" / "k3load"


@dataclass(frozen=True)
class VllmTarget:
    """What a test needs to talk to the running server."""

    base_url: str
    model: str
    log_path: Path
    max_model_len: int
    server: VllmCpuServer

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"


@pytest.hookimpl(tryfirst=True)  # before the mark plugin applies -m
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that pulls a vLLM fixture as ``vllm``, so marker selection is reliable."""
    for item in items:
        if VLLM_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    return ensure_venv(cache_dir())


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_venv: Path) -> Path:
    return ensure_tiny_model(vllm_venv, cache_dir())


@pytest.fixture(scope="session")
def vllm_server(
    vllm_venv: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmTarget]:
    """One server per session; its log stays in pytest's temp dir for post-mortems."""
    server = VllmCpuServer(
        vllm_venv, tiny_model_dir, run_dir=tmp_path_factory.mktemp("vllm-server"), extra_args=SERVER_ARGS
    )
    server.start()
    try:
        yield VllmTarget(server.base_url, server.model, server.log_path, server.max_model_len, server)
    finally:
        server.stop()
