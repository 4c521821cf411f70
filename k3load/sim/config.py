"""Every knob of `k3load sim`, in one place, so that the CLI, a YAML profile and tests agree.

The sim is a stand-in for rehearsal and tests: its numbers are a model of vLLM's behaviour, never
evidence about a real deployment. Units are in the field names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ProfileError(ValueError):
    """A fault/engine profile that cannot be used; the message names the file and the field."""


@dataclass
class FaultProfile:
    """Injected misbehaviour. Rates are per request in [0, 1], decided from the seed and the request.

    The model/parser faults are plan rewrites (faults.py); the wire and gateway faults (error styles,
    Retry-After, resets, health flap, /metrics status and stall) are in gateway.py, which says why."""

    malformed_tool_args_rate: float = 0.0  # arguments that are not valid JSON (parser layer)
    empty_tool_calls_rate: float = 0.0  # finish_reason "tool_calls" with no calls (parser layer)
    raw_tool_markup_rate: float = 0.0  # K2 tool-call markup left in content (parser layer)
    reasoning_leak_rate: float = 0.0  # reasoning text repeated inside content
    weak_answer_rate: float = 0.0  # a weak model: no content, no tool call (model_output, not the stack)
    http_error_rate: float = 0.0  # reject before any work
    http_error_status: int = 503  # 429, 500, 502, 503 ...
    http_error_style: str = "vllm"  # "vllm" JSON body, "gateway" plain text, "html" an nginx error page
    http_error_retry_after_s: int = 0  # >0: injected HTTP errors carry `Retry-After: N` (a rate limiter)
    connection_reset_rate: float = 0.0  # TCP RST before any response byte (gateway/LB dropping the request)
    midstream_reset_rate: float = 0.0  # streaming: TCP RST after some chunks (a reset, not a clean close)
    midstream_error_rate: float = 0.0  # streaming: `data: {"error": ...}` after some chunks
    truncate_stream_rate: float = 0.0  # streaming: connection closed without [DONE]
    slow_first_token_rate: float = 0.0
    slow_first_token_ms: float = 0.0  # extra delay before the first token
    slow_drip_rate: float = 0.0
    slow_drip_ms: float = 0.0  # extra delay between tokens
    prefix_cache_never_hits: bool = False  # flag says caching is on, lookups never hit
    metrics_disabled: bool = False  # as vLLM 0.32 `--disable-log-stats`: only vllm:tool_call_parser_invocations
    oom_kv_demand_tokens: int = 0  # >0: crash with a CUDA-OOM-like line when KV demand passes it
    health_flap_period_s: float = 0.0  # >0: main-port /health alternates 200/503 every N wall seconds
    metrics_http_status: int = 200  # not 200: main-port /metrics answers this (a gateway forwarding only /v1)
    metrics_stall_ms: float = 0.0  # wall ms every /metrics response waits while the stall window is open
    metrics_stall_after_requests: int = 0  # the window opens once this many chat requests were received
    metrics_stall_requests: int = 0  # ... and closes once this many more arrived (0: never closes)
    # Kimi's known tool-call failures (parser layer); the streamed-only ones leave stream:false right
    stream_empty_tool_calls_rate: float = 0.0  # streamed: every tool-call delta is `"tool_calls": []` (vllm#54701)
    stream_empty_tool_calls_min_running: int = 0  # ... only with at least this many requests in the engine
    tool_args_burst_rate: float = 0.0  # streamed: each call whole in one delta after a silence (vllm#50604)
    tool_args_burst_ms: float = 0.0  # that silence before the first tool-call delta, model ms
    parallel_call_drop_rate: float = 0.0  # streamed, 2+ calls: the last call is never sent (vllm#24478)
    parallel_call_merge_rate: float = 0.0  # streamed, 2+ calls: the second's arguments under the first's index
    parallel_call_duplicate_rate: float = 0.0  # streamed: one call sent again, same id, new index
    missing_think_transition_rate: float = 0.0  # no think-to-answer transition: all left in reasoning (vllm#53246)
    ignore_disconnect_rate: float = 0.0  # the engine keeps decoding after its client left (a gateway not passing it on)
    skip_tool_call_rate: float = 0.0  # a model answering in prose where it should call a tool (model_output)


@dataclass
class SimConfig:
    """Engine, cache, timing and identity of the simulated server."""

    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 0  # also serve /metrics and /health here (0: not served; -1: a free port)
    model: str = "kimi-k3-sim"
    max_model_len: int = 32768
    vllm_version: str = "0.33.0"
    seed: int = 0
    # KV cache and scheduler (vLLM CacheConfig / SchedulerConfig analogues)
    block_size: int = 16
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    hybrid_block_size: int = 0  # >0: KDA-style state checkpoints; hits resume only at multiples
    # Timing model (seconds of wall time = model time x time_scale)
    time_scale: float = 1.0
    step_base_ms: float = 4.0  # fixed cost of one engine step
    step_per_seq_ms: float = 0.08  # decode cost per running sequence
    prefill_ms_per_token: float = 0.02  # cost per uncached prompt token
    # Output shape
    reasoning_tokens: int = 12  # 0 disables the reasoning field
    answer_tokens_min: int = 16
    answer_tokens_max: int = 64
    tool_call_style: str = "k3"  # "k3": each call whole in one delta; "k2": name then argument pieces
    enable_prompt_tokens_details: bool = True
    # Simulated GPU memory (dcgm-exporter names, labelled simulated)
    gpu_count: int = 8
    gpu_memory_mib: int = 288 * 1024  # GB300-class
    weights_mib_per_gpu: int = 180 * 1024
    kv_bytes_per_token: int = 70_000
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
    for name in ("stream_empty_tool_calls_min_running", "tool_args_burst_ms"):
        if getattr(f, name) < 0:
            raise ProfileError(f"faults.{name} must not be negative, got {getattr(f, name)}")
    if config.tool_call_style not in ("k2", "k3"):
        raise ProfileError("tool_call_style must be 'k2' or 'k3'")
    if config.hybrid_block_size and config.hybrid_block_size % config.block_size:
        raise ProfileError("hybrid_block_size must be a multiple of block_size")
    for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
        if getattr(config, name) <= 0:
            raise ProfileError(f"{name} must be positive")
    if config.answer_tokens_min > config.answer_tokens_max:
        raise ProfileError("answer_tokens_min must not exceed answer_tokens_max")


def _validate_wire(config: SimConfig) -> None:
    """The gateway-side knobs: statuses a client can receive, no negative waits or counts."""
    f = config.faults
    if not 400 <= f.http_error_status <= 599:
        raise ProfileError(f"faults.http_error_status must be within [400, 599], got {f.http_error_status}")
    if f.metrics_http_status != 200 and not 400 <= f.metrics_http_status <= 599:
        raise ProfileError(f"faults.metrics_http_status must be 200 or within [400, 599], "
                           f"got {f.metrics_http_status}")
    for name in ("http_error_retry_after_s", "health_flap_period_s", "metrics_stall_ms",
                 "metrics_stall_after_requests", "metrics_stall_requests"):
        if getattr(f, name) < 0:
            raise ProfileError(f"faults.{name} must not be negative")
    if not -1 <= config.metrics_port <= 65535:
        raise ProfileError(f"metrics_port must be 0 (off), -1 (a free port) or a port number, "
                           f"got {config.metrics_port}")
    if config.metrics_port > 0 and config.metrics_port == config.port:
        raise ProfileError("metrics_port must differ from port")
