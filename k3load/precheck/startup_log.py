"""Read a vLLM startup log: what initialised (device, communication backend, kernels, server args) and
which warnings are about NCCL, communication or kernels.

Why classify instead of failing on any WARNING: a real log is full of harmless warnings (ulimit, dtype
downcasts, missing tcmalloc), and a rule that fails on all of them gets ignored. The acceptance
criteria name three kinds that mean the deployment does not match its build: NCCL, communication
(all-reduce, P2P, NVLink, IB, process groups) and kernel loading (CUDA, cuBLAS, FlashAttention,
FlashInfer, CUTLASS, DeepGEMM, Triton, "no kernel image"). Those fail; the rest is listed, not judged.
Python DeprecationWarning/FutureWarning lines are about source code, not the running deployment.
A few vLLM warnings name a kernel word but report a choice, not a broken stack: the operator's flag or
environment variable (`--enforce-eager`), or a default vLLM picks on purpose. They are listed in
NOTICES, word for word with the vLLM source line each comes from, and kept as other warnings with a
note; a message that only resembles one (or carries a CUDA error) is judged as usual.

Line formats (vLLM 0.32.0 CPU log as captured by tests/target_fixtures.py, vLLM's logger format in
`vllm/logger.py`, NCCL's `host:pid:tid [rank] NCCL WARN`): every format may carry vLLM's
`(Worker_TP0 pid=N) ` prefix, which it puts on its child processes' output.
"""

from __future__ import annotations

import ast
import re
from typing import Any, NamedTuple

_PREFIX = r"^(?:\((?P<proc>[^)]*?) pid=\d+\) )?"
_VLLM = re.compile(_PREFIX + r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
                   r"\[(?P<src>[^\]]+)\] (?P<msg>.*)$")
_GLOG = re.compile(_PREFIX + r"\[?(?P<level>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+(?: +\d+)? +(?P<src>[^\]\s]+)\] "
                   r"(?P<msg>.*)$")
_NCCL = re.compile(_PREFIX + r"(?P<src>\S+:\d+:\d+) \[\d+\] NCCL (?P<level>WARN|INFO|TRACE) (?P<msg>.*)$")
_PYWARN = re.compile(_PREFIX + r"(?P<src>\S+\.py):\d+: (?P<level>\w*Warning): (?P<msg>.*)$")
_EXC = re.compile(_PREFIX + r"(?P<level>(?:[\w.]+\.)?\w*(?:Error|Exception)): (?P<msg>.*)$")
_LEVELS = {"W": "WARNING", "E": "ERROR", "F": "CRITICAL", "I": "INFO", "WARN": "WARNING"}
_CODE_WARNINGS = ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning")

NCCL = re.compile(r"\bNCCL\b|\bRCCL\b|pynccl", re.I)
COMM_SOURCES = re.compile(r"(parallel_state|custom_all_reduce|quick_all_reduce|all_reduce_utils|all2all|communicator"
                          r"|shm_broadcast|symm_mem|flashinfer_all_reduce|kv_transfer|nixl)[\w/]*\.py")
COMM_WORDS = re.compile(
    r"all[-_ ]?reduce|all[-_ ]?gather|all[-_ ]?to[-_ ]?all|reduce[-_ ]scatter|\bP2P\b|peer[- ]to[- ]peer|peer access"
    r"|NVLink|\bNVLS\b|MNNVL|InfiniBand|\bibv_|\bRDMA\b|\bUCX\b|NVSHMEM|DeepEP|\bNIXL\b|\bgloo\b|\bMPI\b"
    r"|process ?group|rendezvous|TCPStore|shared memory broadcast|symmetric memory|\bcollectives?\b", re.I)
# GPU kernel stack. Triton counts only on CUDA: on the CPU platform vLLM's kernels are its C++ ops and
# oneDNN, and Triton (triton-cpu) only feeds the optional Model Runner V2; the k3load CPU install
# removes triton on purpose (shared/notes/vllm-cpu-recipe.md).
KERNEL_STACK = (r"CUDA|cuBLAS(?:Lt)?|cuDNN|NVRTC|\bPTX\b|\bsm_\d+|compute capability|FlashAttention|flash[_-]?attn"
                r"|FlashInfer|FlashMLA|CUTLASS|DeepGEMM|deep_gemm|Marlin|Machete|TensorRT|cudagraph|CUDA ?graph"
                r"|\bkernels?\b")
KERNEL = {"cuda": re.compile(KERNEL_STACK + r"|Triton", re.I), "cpu": re.compile(KERNEL_STACK, re.I)}
FAILURE = re.compile(r"fail|error|not (?:be )?(?:available|found|supported|installed|compiled|built)|unavailable"
                     r"|unsupported|missing|fall(?:ing|s)?[ -]?back|disabl|incompatib|mismatch|insufficient"
                     r"|could not|cannot|can't|unable|\binstead\b|illegal", re.I)
ALWAYS_KERNEL = re.compile(r"no kernel image|CUDA error|cudaError|CUBLAS_STATUS|illegal memory access", re.I)


class Notice(NamedTuple):
    """A vLLM warning that reports a deliberate configuration, not a compatibility problem."""

    note: str  # what it means, for the report
    source: str  # where vLLM 0.32.0 emits it (vllm/...)
    message: re.Pattern[str]  # the whole message: a notice with anything added is not one


NOTICES: tuple[Notice, ...] = (
    Notice("--enforce-eager: torch.compile and CUDA graphs off by choice (slower, not broken)",
           "vllm/config/vllm.py:1697 (with --enable-fault-tolerance) and :1703, VllmConfig.__post_init__",
           re.compile(r"Enforce eager set, disabling torch\.compile(?: and CUDAGraphs|, CUDAGraphs, and JIT kernel "
                      r"warmup)\. This is equivalent to setting -cc\.mode=none -cc\.cudagraph_mode=none"
                      r"(?: and --kernel_config\.enable_jit_warmup=False)?")),
    Notice("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: CUDA graph memory not profiled by choice (a sizing note)",
           "vllm/v1/worker/gpu_worker.py:791, Worker.determine_available_memory",
           re.compile(r"CUDA graph memory profiling is disabled \(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0\)\. "
                      r"Without it, CUDA graph memory is not accounted for during KV cache allocation, which may "
                      r"require lowering --gpu-memory-utilization to avoid OOM\. Consider re-enabling it \(the "
                      r"default as of v\d+\.\d+\.\d+\) and increasing --gpu-memory-utilization from [\d.]+ to "
                      r"[\d.]+\.")),
    Notice("the chosen KV connector needs piecewise CUDA graphs: vLLM sets them",
           "vllm/config/vllm.py:1917, VllmConfig.__post_init__",
           re.compile(r"KV connector \w+ requires PIECEWISE CUDA graph mode due to layerwise async operations that "
                      r"cannot be captured in CUDA graphs\. Overriding cudagraph_mode from \w+ to PIECEWISE\.")),
    Notice("vLLM's own per-model choice of CUTLASS over DeepGEMM on Blackwell",
           "vllm/config/vllm.py:1533, VllmConfig.__post_init__ (vllm/utils/deep_gemm.py, "
           "should_auto_disable_deep_gemm)",
           re.compile(r"Auto-disabled DeepGemm for model_type=\w+ on Blackwell\. DeepGemm E8M0 scale format causes "
                      r"accuracy degradation for this architecture\. Falling back to CUTLASS\. To disable DeepGemm "
                      r"globally, set VLLM_USE_DEEP_GEMM=0\.")),
    Notice("no tuned W8A8 block-FP8 kernel config for this GPU and shape: defaults used (a performance note)",
           "vllm/model_executor/layers/quantization/utils/fp8_utils.py:953, get_w8a8_block_fp8_configs",
           re.compile(r"Using default W8A8 Block FP8 kernel config\. Performance might be sub-optimal! Config file "
                      r"not found at \S+")),
)

_DEVICE = re.compile(r"device_config=(\w+)|detected platform (\w+)")
_BACKEND = re.compile(r"distributed_init_method=\S+ backend=(\w+)")
_NCCL_VERSION = re.compile(r"vLLM is using nccl==(\S+)")
_KERNEL_LINE = re.compile(r"Using (\S+) (?:attention )?backend|Loading weights took|Model loading took")
_VERSION = re.compile(r"Initializing a V1 LLM engine \(v([^)]+)\)|\bversion (\d+\.\d+\.\d+\S*)")
_ARGS = re.compile(r"non-default args: (\{.*\})\s*$")
_PAIR = re.compile(r"'(\w+)': ('(?:[^'\\]|\\.)*'|True|False|None|-?\d+(?:\.\d+)?(?:e-?\d+)?|\[[^\]]*\])")


def notice(level: str, message: str) -> Notice | None:
    """The known configuration notice this whole WARNING message is; None for anything else."""
    if level != "WARNING":
        return None
    return next((n for n in NOTICES if n.message.fullmatch(message.strip())), None)


def _entry(line: str) -> tuple[str, str, str] | None:
    """(level, source, message) of a log line in any known format, else None (continuation lines)."""
    for pattern in (_VLLM, _NCCL, _GLOG, _PYWARN):
        match = pattern.match(line)
        if match:
            level, source = match["level"], match["src"]
            return _LEVELS.get(level, level), f"NCCL {source}" if pattern is _NCCL else source, match["msg"]
    match = _EXC.match(line)
    return ("ERROR", match["level"], match["msg"]) if match else None


def category(level: str, source: str, message: str, platform: str) -> str | None:
    """'nccl', 'communication' or 'kernel' for a warning that means a compatibility problem; else None."""
    if level.endswith(_CODE_WARNINGS) or level in ("DEBUG", "INFO", "TRACE"):
        return None
    if notice(level, message) and not ALWAYS_KERNEL.search(message):
        return None
    text = f"{source} {message}"
    if NCCL.search(text):
        return "nccl"
    if COMM_SOURCES.search(source) or COMM_WORDS.search(message):
        return "communication"
    if ALWAYS_KERNEL.search(message) or (KERNEL[platform].search(message) and FAILURE.search(message)):
        return "kernel"
    return None


# What ast.literal_eval raises on text it cannot take: a set of dicts (`{{}}`: TypeError, found by the fuzz test),
# nesting past the recursion limit, an expression too large to build
_UNEVALUATED = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)


def non_default_args(text: str) -> dict[str, Any]:
    """vLLM's 'non-default args: {...}' dict; objects it cannot evaluate (config reprs) are skipped."""
    try:
        value = ast.literal_eval(text)
        return value if isinstance(value, dict) else {}
    except _UNEVALUATED:
        return dict(pair for pair in (_pair(key, raw) for key, raw in _PAIR.findall(text)) if pair is not None)


def _pair(key: str, raw: str) -> tuple[str, Any] | None:
    try:
        return key, ast.literal_eval(raw)
    except _UNEVALUATED:
        return None


def _facts(number: int, message: str, facts: dict[str, Any]) -> None:
    where = f"line {number}"
    for pattern, key in ((_DEVICE, "device"), (_BACKEND, "comm_backend"), (_NCCL_VERSION, "nccl_version"),
                         (_VERSION, "vllm_version")):
        match = pattern.search(message)
        if match and facts[key] is None:
            facts[key] = {"value": next(g for g in match.groups() if g), "where": where}
    if _KERNEL_LINE.search(message):
        facts["kernel_lines"].append({"where": where, "text": message[:300]})
    args = _ARGS.search(message)
    if args and not facts["args"]:
        facts["args"] = non_default_args(args.group(1))


def parse_startup_log(text: str, platform: str) -> dict[str, Any]:
    """Facts and classified warnings of one startup log; `platform` is the recipe's ('cuda' or 'cpu')."""
    facts: dict[str, Any] = {"device": None, "comm_backend": None, "nccl_version": None, "vllm_version": None,
                             "kernel_lines": [], "args": {}, "flagged": [], "other_warnings": [], "lines": 0}
    for number, line in enumerate(text.splitlines(), start=1):
        facts["lines"] = number
        entry = _entry(line.rstrip())
        if entry is None:
            continue
        level, source, message = entry
        _facts(number, message, facts)
        if level in ("DEBUG", "INFO", "TRACE") or level.endswith(_CODE_WARNINGS):
            continue
        found = category(level, source, message, platform)
        item = {"line": number, "level": level, "text": line.strip()[:400]}
        if found:
            facts["flagged"].append({**item, "category": found})
        else:
            known = notice(level, message)
            facts["other_warnings"].append({**item, "notice": known.note} if known else item)
    return facts


def quote(items: list[dict[str, Any]], n: int = 3) -> str:
    """The first n flagged lines, for a reason a human reads."""
    shown = "; ".join(f"line {i['line']} [{i.get('category', i['level'])}] {i['text'][:160]}" for i in items[:n])
    return shown + (f"; and {len(items) - n} more" if len(items) > n else "")


def cuda_init_problems(log: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(failures, gaps) of a CUDA deployment's startup: a CUDA device, the NCCL backend, kernels loaded."""
    fails, gaps = [], []
    device = (log["device"] or {}).get("value")
    if device is None:
        gaps.append("no CUDA initialisation line (device_config / detected platform)")
    elif device != "cuda":
        fails.append(f"startup log shows device {device}, not CUDA ({log['device']['where']})")
    backend = (log["comm_backend"] or {}).get("value")
    if backend is None:
        gaps.append("no communication backend line (distributed_init_method ... backend=)")
    elif backend != "nccl":
        fails.append(f"communication backend {backend}, not nccl ({log['comm_backend']['where']})")
    if not log["kernel_lines"]:
        gaps.append("no kernel loading lines (attention backend, weights loaded)")
    return fails, gaps
