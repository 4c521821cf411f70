"""Every knob of `k3load sim`, in one place, so that the CLI, a YAML profile and tests agree.

The sim is a stand-in for rehearsal and tests: its numbers are a model of vLLM's behaviour, never
evidence about a real deployment. Units are in the field names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from k3load.errors import InputError


class Strikes(StrEnum):
    """Where a fault strikes: the group docs/sim.md lists it under (k3load/sim/fault_docs.py generates that list from
    the fields, so a new fault is one field with its `strikes` and its test). The value is the group's heading."""

    ANSWERS = "Answers: the parser's and the model's"
    HTTP = "The HTTP path (a gateway's errors, resets, a stream held open)"
    HEALTH_AND_METRICS = "`/health` and `/metrics`"
    ENGINE_DEATH = "The engine core dying behind a live API server"
    ENGINE = "The engine (its stream, its timing, its cache, its KV demand)"
    GPU_MEMORY = "GPU memory outside the KV pool"
    KIMI_TOOL_CALLS = "Kimi's known tool-call failures"
    BATCH_VARIANCE = "An engine that is not batch-invariant"
    MODEL_AND_GATEWAY = "The model and the gateway"


def knob(default: Any, help: str, strikes: Strikes | None = None) -> Any:
    """A setting with its one description: `k3load sim --help` and docs/options.md read it from here; a fault says
    where it strikes (docs/sim.md's list of faults is generated from it)."""
    return field(default=default, metadata={"help": help, "strikes": strikes})


def help_of(cls: type, name: str) -> str:
    """A setting's description (`knob`'s help)."""
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata["help"]


HOSTILE_JSON_SHAPES = ("deep", "long_int", "nan", "duplicate_key")  # --hostile-json-shape (k3load.sim.faults)


class ProfileError(InputError):
    """A fault/engine profile that cannot be used; the message names the file and the field."""


@dataclass
class FaultProfile:
    """Injected misbehaviour. Rates are per request in [0, 1], decided from the seed and the request.

    The model/parser faults are plan rewrites (faults.py); the wire and gateway faults (error styles,
    Retry-After, resets, health flap, /metrics status and stall) are in gateway.py, which says why."""

    malformed_tool_args_rate: float = knob(0.0, "fault: tool-call arguments that are not valid JSON: parser",
                                           strikes=Strikes.ANSWERS)
    hostile_json_rate: float = knob(0.0, "fault: the model writes JSON a lenient parser takes or chokes on, as the "
                                         "first tool call's arguments (or a JSON answer's content): nested 60,000 "
                                         "deep, a 5,000-digit integer, NaN or a key given twice "
                                         "(--hostile-json-shape): model_output", strikes=Strikes.ANSWERS)
    hostile_json_shape: str = knob("mixed", "fault: what --hostile-json-rate writes: deep, long_int, nan, "
                                            "duplicate_key, or mixed (one of the four drawn per answer)",
                                   strikes=Strikes.ANSWERS)
    empty_tool_calls_rate: float = knob(0.0, "fault: finish_reason tool_calls with an empty tool_calls list: parser",
                                        strikes=Strikes.ANSWERS)
    raw_tool_markup_rate: float = knob(0.0, "fault: raw tool-call markup left in content instead of tool_calls: "
                                            "parser", strikes=Strikes.ANSWERS)
    reasoning_leak_rate: float = knob(0.0, "fault: reasoning text emitted as content: parser", strikes=Strikes.ANSWERS)
    weak_answer_rate: float = knob(0.0, "fault: a weak model, answering with nothing (no content, no tool call): "
                                        "model_output", strikes=Strikes.ANSWERS)
    http_error_rate: float = knob(0.0, "fault: requests rejected with --http-error-status", strikes=Strikes.HTTP)
    http_error_status: int = knob(503, "fault: status of injected HTTP errors (429, 500, 503 ...)",
                                  strikes=Strikes.HTTP)
    http_error_style: str = knob("vllm", "fault: body of injected errors: vllm (JSON), gateway (plain text) or html "
                                         "(an nginx error page, text/html)", strikes=Strikes.HTTP)
    http_error_retry_after_s: int = knob(0, "fault: injected HTTP errors carry 'Retry-After: N' (0: no header)",
                                         strikes=Strikes.HTTP)
    connection_reset_rate: float = knob(0.0, "fault: the connection is reset (TCP RST) before any response byte",
                                        strikes=Strikes.HTTP)
    midstream_reset_rate: float = knob(0.0, "fault: streaming connection reset (TCP RST) halfway, not a clean close",
                                       strikes=Strikes.HTTP)
    midstream_error_rate: float = knob(0.0, "fault: streaming error event halfway through the answer",
                                       strikes=Strikes.ENGINE)
    truncate_stream_rate: float = knob(0.0, "fault: stream closed halfway without finish chunk or [DONE]",
                                       strikes=Strikes.HTTP)
    slow_first_token_rate: float = knob(0.0, "fault: share of requests with a stalled first token",
                                        strikes=Strikes.ENGINE)
    slow_first_token_ms: float = knob(0.0, "fault: extra first-token delay, model ms", strikes=Strikes.ENGINE)
    slow_drip_rate: float = knob(0.0, "fault: share of requests with slow token drip", strikes=Strikes.ENGINE)
    slow_drip_ms: float = knob(0.0, "fault: extra delay between tokens, model ms", strikes=Strikes.ENGINE)
    prefix_cache_never_hits: bool = knob(False, "fault: prefix caching reported on but never hits",
                                         strikes=Strikes.ENGINE)
    metrics_disabled: bool = knob(False, "fault: as vLLM 0.32 with --disable-log-stats, only the tool-parser counter "
                                         "on /metrics, no other vllm:* series", strikes=Strikes.HEALTH_AND_METRICS)
    gpu_memory_creep_mib_per_s: float = knob(0.0, "fault: memory outside the KV pool grows this many MiB per GPU "
                                                   "per wall second once serving began (a leak, fragmentation), "
                                                   "never given back; past the card: a CUDA OOM crash (0: off)",
                                             strikes=Strikes.GPU_MEMORY)
    prefill_spike_mib_per_1k_tokens: float = knob(0.0, "fault: prefilling a prompt needs a buffer of this many MiB "
                                                        "per GPU per 1,000 prompt tokens outside the profiled "
                                                        "reservation; PyTorch's caching allocator keeps its high-"
                                                        "water mark; past the card: a CUDA OOM crash (0: off)",
                                                  strikes=Strikes.GPU_MEMORY)
    oom_kv_demand_tokens: int = knob(0, "fault: crash with a CUDA-OOM line when queued+running KV demand passes this "
                                        "(0: off)", strikes=Strikes.ENGINE)
    engine_death_after_requests: int = knob(0, "fault: the engine core dies at this chat request (EngineDeadError): "
                                                "/health 503, requests 500, its lines in the log, the API server "
                                                "gone --engine-death-exit-s later (vLLM's watchdog; 0: off)",
                                            strikes=Strikes.ENGINE_DEATH)
    engine_death_exit_s: float = knob(5.0, "fault: wall seconds the API server lives on after its engine died "
                                           "(vLLM's watchdog polls every 5 s); 0: it stays up answering 503, as "
                                           "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 does", strikes=Strikes.ENGINE_DEATH)
    health_flap_period_s: float = knob(0.0, "fault: /health alternates 200 and 503 every N wall seconds since start, "
                                            "the engine being fine (0: off; the metrics port's /health stays 200)",
                                       strikes=Strikes.HEALTH_AND_METRICS)
    metrics_http_status: int = knob(200, "fault: /metrics on the main port answers this status (404: '404 page not "
                                         "found', a gateway forwarding only /v1); the metrics port still serves",
                                    strikes=Strikes.HEALTH_AND_METRICS)
    metrics_stall_ms: float = knob(0.0, "fault: wall ms (not scaled by --time-scale) each /metrics response waits "
                                        "while the stall window is open (0: off)", strikes=Strikes.HEALTH_AND_METRICS)
    metrics_stall_after_requests: int = knob(0, "fault: the /metrics stall window opens once this many chat requests "
                                                "were received", strikes=Strikes.HEALTH_AND_METRICS)
    metrics_stall_requests: int = knob(0, "fault: the /metrics stall window closes once this many more chat requests "
                                          "were received (0: never closes)", strikes=Strikes.HEALTH_AND_METRICS)
    # Kimi's known tool-call failures (parser layer); the streamed-only ones leave stream:false right
    stream_empty_tool_calls_rate: float = knob(0.0, "fault: streamed answers only: every tool-call delta is sent as "
                                                    "an empty '\"tool_calls\": []', finish_reason still tool_calls "
                                                    "(vllm#54701); the stream:false twin stays right",
                                               strikes=Strikes.KIMI_TOOL_CALLS)
    stream_empty_tool_calls_min_running: int = knob(0, "fault: --stream-empty-tool-calls-rate applies only when the "
                                                       "engine holds at least this many requests (running + waiting, "
                                                       "this one included) when the request arrives",
                                                    strikes=Strikes.KIMI_TOOL_CALLS)
    tool_args_burst_rate: float = knob(0.0, "fault: streamed answers only: arguments do not stream; each call comes "
                                            "whole in one delta after a silence of --tool-args-burst-ms (vllm#50604)",
                                       strikes=Strikes.KIMI_TOOL_CALLS)
    tool_args_burst_ms: float = knob(0.0, "fault: the silence before the first tool-call delta, model ms",
                                     strikes=Strikes.KIMI_TOOL_CALLS)
    parallel_call_drop_rate: float = knob(0.0, "fault: streamed answers with 2+ calls: the last call is never sent, "
                                               "finish_reason stays tool_calls (vllm#24478)",
                                          strikes=Strikes.KIMI_TOOL_CALLS)
    parallel_call_merge_rate: float = knob(0.0, "fault: streamed answers with 2+ calls: the second call's header is "
                                                "lost and its arguments follow the first's under its index "
                                                "('{...}{...}', one call fewer)", strikes=Strikes.KIMI_TOOL_CALLS)
    parallel_call_duplicate_rate: float = knob(0.0, "fault: streamed answers with calls: one call is sent again, "
                                                    "whole, under a new index with the same id",
                                               strikes=Strikes.KIMI_TOOL_CALLS)
    missing_think_transition_rate: float = knob(0.0, "fault: no think-to-answer transition: the call (as K3 markup) "
                                                     "or the answer stays in reasoning; content empty, no calls, "
                                                     "finish_reason stop (vllm#53246; needs --reasoning-tokens > 0)",
                                                strikes=Strikes.KIMI_TOOL_CALLS)
    ignore_disconnect_rate: float = knob(0.0, "fault: the request keeps decoding to its end after the client went "
                                              "away (a gateway that does not pass the disconnect on): KV and batch "
                                              "seat stay taken, no abort", strikes=Strikes.MODEL_AND_GATEWAY)
    skip_tool_call_rate: float = knob(0.0, "fault: a model that skips tool calls: with tool_choice auto it answers in "
                                           "prose where it should call a tool (finish_reason stop, no calls): "
                                           "model_output; at temperature 0 the same request is skipped every time",
                                      strikes=Strikes.MODEL_AND_GATEWAY)
    # vLLM is not batch-invariant by default: a greedy decode can take a near-tie token the other way in a batch of
    # another size (docs.vllm.ai/en/v0.32.0/features/batch_invariance/; VLLM_BATCH_INVARIANT=1 is its beta fix)
    batch_dependent_args_rate: float = knob(0.0, "fault: a batch-variant engine: when the engine holds at least "
                                                 "--batch-dependent-args-min-running requests, this share of (request, "
                                                 "batch size) pairs decodes one tool-call argument value otherwise "
                                                 "(still schema-valid), decided from the request and how many requests "
                                                 "the engine holds: the same request alone answers the same every time",
                                            strikes=Strikes.BATCH_VARIANCE)
    batch_dependent_args_min_running: int = knob(2, "fault: --batch-dependent-args-rate applies only when the engine "
                                                    "holds at least this many requests (running + waiting, this one "
                                                    "included) when the request arrives",
                                                 strikes=Strikes.BATCH_VARIANCE)
    hold_after_done_rate: float = knob(0.0, "fault: streamed answers: a proxy that passes 'data: [DONE]' on but holds "
                                            "the chunked body open for --hold-after-done-ms (its last chunk late, or "
                                            "never if the client leaves first)", strikes=Strikes.HTTP)
    hold_after_done_ms: float = knob(30000.0, "fault: how long --hold-after-done-rate holds the body open after "
                                              "[DONE], wall ms (not scaled by --time-scale)", strikes=Strikes.HTTP)


@dataclass
class SimConfig:
    """Engine, cache, timing and identity of the simulated server."""

    host: str = knob("127.0.0.1", "address to bind (loopback by default)")
    port: int = knob(8000, "port to bind; 0 picks a free one (the URL is printed)")
    metrics_port: int = knob(0, "also serve the engine's /metrics and /health on this port of the same host, as an "
                                "engine whose metrics are reachable apart from its API gateway (0: not served; -1: a "
                                "free one; the URL is printed: 'metrics on http://HOST:PORT/metrics')")
    model: str = knob("kimi-k3-sim", "served model name (requests naming another model get vLLM's 404)")
    max_model_len: int = knob(32768, "context length in tokens; longer prompts get vLLM's context-length 400")
    vllm_version: str = knob("0.32.0", "version reported by /version (the sim speaks vLLM 0.32 on the wire)")
    seed: int = knob(0, "seed for answers and fault draws (identical requests replay identically)")
    # KV cache and scheduler (vLLM CacheConfig / SchedulerConfig analogues)
    block_size: int = knob(16, "KV block size in tokens (prefix-cache hash unit)")
    num_gpu_blocks: int = knob(8192, "KV blocks in the pool (capacity = blocks x block size tokens)")
    max_num_seqs: int = knob(64, "most requests running at once; the rest wait")
    max_num_batched_tokens: int = knob(8192, "token budget of one engine step (chunked prefill)")
    enable_prefix_caching: bool = knob(True, "reuse cached prompt blocks")
    hybrid_block_size: int = knob(0, "KDA/mamba-style state checkpoint grid in tokens: hits resume only at multiples "
                                     "(0: off)")
    # Timing model (seconds of wall time = model time x time_scale)
    time_scale: float = knob(1.0, "wall seconds per model second (0.1 runs ten times faster)")
    step_base_ms: float = knob(4.0, "fixed cost of one engine step, model ms")
    step_per_seq_ms: float = knob(0.08, "decode cost per running sequence per step, model ms")
    prefill_ms_per_token: float = knob(0.02, "prefill cost per uncached prompt token, model ms")
    # Output shape
    reasoning_tokens: int = knob(12, "tokens of reasoning before each answer (0: no reasoning field)")
    think_ms: float = knob(0.0, "thinking time, model ms: added to the reasoning's own decode time, spread evenly over "
                                "each answer's reasoning tokens (its first answer token comes this much later; needs "
                                "--reasoning-tokens > 0; 0: none)")
    answer_tokens_min: int = knob(16, "shortest plain answer in tokens")
    answer_tokens_max: int = knob(64, "longest plain answer in tokens")
    tool_call_style: str = knob("k3", "k3: each call whole in one delta; k2: name first, then argument pieces")
    enable_prompt_tokens_details: bool = knob(True, "report usage.prompt_tokens_details.cached_tokens")
    enable_request_id_headers: bool = knob(False, "answer every request with an X-Request-Id header: the one it "
                                                   "sent, else a new id (vLLM's --enable-request-id-headers)")
    # Simulated GPU memory (dcgm-exporter names, labelled simulated)
    gpu_count: int = knob(8, "simulated GPUs (DCGM_FI_DEV_FB_* gauges, labelled simulated)")
    gpu_memory_mib: int = knob(288 * 1024, "simulated memory per GPU, MiB")
    weights_mib_per_gpu: int = knob(180 * 1024, "simulated weight memory per GPU, MiB (inside the reservation)")
    gpu_memory_utilization: float = knob(0.9, "share of each card vLLM reserves at start for weights, activations "
                                              "and the KV pool (vLLM's --gpu-memory-utilization, default 0.9; the "
                                              "K3 recipe's 0.95): 'used' sits there from the first scrape, flat "
                                              "under load")
    gpu_context_mib: int = knob(1536, "memory per GPU outside the reservation (CUDA context, NCCL buffers), MiB")
    kv_bytes_per_token: int = knob(70_000, "simulated KV bytes per token across all GPUs")
    faults: FaultProfile = field(default_factory=FaultProfile)

    def time_s(self, ms: float) -> float:
        """Model milliseconds to wall seconds."""
        return ms * self.time_scale / 1000.0


def _apply(target: Any, data: dict[str, Any], where: str) -> None:
    known = {f.name: f for f in dataclasses.fields(target)}
    for key, value in data.items():
        if key not in known or key == "faults":
            raise ProfileError(f"{where}: unknown field {key!r} (known: {', '.join(sorted(known))})")
        expected = type(getattr(target, key))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ProfileError(f"{where}.{key}: expected {expected.__name__}, got {value!r}")
        setattr(target, key, value)


def load_profile(path: Path, config: SimConfig | None = None) -> SimConfig:
    """Read a YAML profile (`engine:` and `faults:` sections) onto a config; unknown keys are errors."""
    config = config or SimConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc}") from exc
    if not isinstance(data, dict) or set(data) - {"engine", "faults"}:
        raise ProfileError(f"{path}: top level must be a mapping with only 'engine' and 'faults'")
    for section, target in (("engine", config), ("faults", config.faults)):
        body = data.get(section) or {}
        if not isinstance(body, dict):
            raise ProfileError(f"{path}: {section} must be a mapping")
        _apply(target, body, f"{path}: {section}")
    validate(config)
    return config


def validate(config: SimConfig) -> None:
    """Reject settings the engine model cannot honour, naming the field."""
    f = config.faults
    for name in (x.name for x in dataclasses.fields(f) if x.name.endswith("_rate")):
        if not 0.0 <= getattr(f, name) <= 1.0:
            raise ProfileError(f"faults.{name} must be within [0, 1]")
    if f.http_error_style not in ("vllm", "gateway", "html"):
        raise ProfileError("faults.http_error_style must be 'vllm', 'gateway' or 'html'")
    _validate_wire(config)
    for name in ("stream_empty_tool_calls_min_running", "batch_dependent_args_min_running", "tool_args_burst_ms",
                 "hold_after_done_ms"):
        if getattr(f, name) < 0:
            raise ProfileError(f"faults.{name} must not be negative, got {getattr(f, name)}")
    if config.tool_call_style not in ("k2", "k3"):
        raise ProfileError("tool_call_style must be 'k2' or 'k3'")
    if config.hybrid_block_size and config.hybrid_block_size % config.block_size:
        raise ProfileError("hybrid_block_size must be a multiple of block_size")
    for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
        if getattr(config, name) <= 0:
            raise ProfileError(f"{name} must be positive")
    _validate_memory(config)
    if config.answer_tokens_min > config.answer_tokens_max:
        raise ProfileError("answer_tokens_min must not exceed answer_tokens_max")
    if f.hostile_json_shape not in (*HOSTILE_JSON_SHAPES, "mixed"):
        raise ProfileError(f"faults.hostile_json_shape must be one of {', '.join(HOSTILE_JSON_SHAPES)} or mixed, "
                           f"got {f.hostile_json_shape!r}")


def _validate_wire(config: SimConfig) -> None:
    """The gateway-side knobs: statuses a client can receive, no negative waits or counts."""
    f = config.faults
    if not 400 <= f.http_error_status <= 599:
        raise ProfileError(f"faults.http_error_status must be within [400, 599], got {f.http_error_status}")
    if f.metrics_http_status != 200 and not 400 <= f.metrics_http_status <= 599:
        raise ProfileError(f"faults.metrics_http_status must be 200 or within [400, 599], "
                           f"got {f.metrics_http_status}")
    for name in ("http_error_retry_after_s", "health_flap_period_s", "metrics_stall_ms",
                 "metrics_stall_after_requests", "metrics_stall_requests", "engine_death_after_requests",
                 "engine_death_exit_s"):
        if getattr(f, name) < 0:
            raise ProfileError(f"faults.{name} must not be negative")
    if not -1 <= config.metrics_port <= 65535:
        raise ProfileError(f"metrics_port must be 0 (off), -1 (a free port) or a port number, "
                           f"got {config.metrics_port}")
    if config.metrics_port > 0 and config.metrics_port == config.port:
        raise ProfileError("metrics_port must differ from port")


def _validate_memory(config: SimConfig) -> None:
    """vLLM refuses to start when the weights leave no room for a KV pool inside the reservation."""
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        raise ProfileError(f"gpu_memory_utilization must be within (0, 1], got {config.gpu_memory_utilization}")
    if config.gpu_context_mib < 0 or config.weights_mib_per_gpu < 0:
        raise ProfileError("gpu_context_mib and weights_mib_per_gpu must not be negative")
    reserved = config.gpu_memory_utilization * config.gpu_memory_mib
    if config.weights_mib_per_gpu >= reserved:
        raise ProfileError(f"weights_mib_per_gpu {config.weights_mib_per_gpu} leaves no KV pool inside "
                           f"gpu_memory_utilization {config.gpu_memory_utilization} of {config.gpu_memory_mib} MiB")
    if reserved + config.gpu_context_mib > config.gpu_memory_mib:
        raise ProfileError("gpu_memory_utilization x gpu_memory_mib + gpu_context_mib exceeds the card")
    f = config.faults
    if f.gpu_memory_creep_mib_per_s < 0 or f.prefill_spike_mib_per_1k_tokens < 0:
        raise ProfileError("faults.gpu_memory_creep_mib_per_s and prefill_spike_mib_per_1k_tokens must not be negative")
