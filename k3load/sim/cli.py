"""`k3load sim` options: one flag per SimConfig/FaultProfile field, each with its help text.

Why generated from the dataclasses: a knob that exists in a profile but not on the command line (or
the other way round) is a trap; a test checks that every field has a help text here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

from k3load.sim.config import FaultProfile, ProfileError, SimConfig, load_profile, validate

HELP: dict[str, str] = {
    "host": "address to bind (loopback by default)",
    "port": "port to bind; 0 picks a free one (the URL is printed)",
    "metrics_port": "also serve the engine's /metrics and /health on this port of the same host, as an engine "
                    "whose metrics are reachable apart from its API gateway (0: not served; -1: a free one; "
                    "the URL is printed: 'metrics on http://HOST:PORT/metrics')",
    "model": "served model name (requests naming another model get vLLM's 404)",
    "max_model_len": "context length in tokens; longer prompts get vLLM's context-length 400",
    "vllm_version": "version reported by /version",
    "seed": "seed for answers and fault draws (identical requests replay identically)",
    "block_size": "KV block size in tokens (prefix-cache hash unit)",
    "num_gpu_blocks": "KV blocks in the pool (capacity = blocks x block size tokens)",
    "max_num_seqs": "most requests running at once; the rest wait",
    "max_num_batched_tokens": "token budget of one engine step (chunked prefill)",
    "enable_prefix_caching": "reuse cached prompt blocks",
    "hybrid_block_size": "KDA/mamba-style state checkpoint grid in tokens: hits resume only at multiples (0: off)",
    "time_scale": "wall seconds per model second (0.1 runs ten times faster)",
    "step_base_ms": "fixed cost of one engine step, model ms",
    "step_per_seq_ms": "decode cost per running sequence per step, model ms",
    "prefill_ms_per_token": "prefill cost per uncached prompt token, model ms",
    "reasoning_tokens": "tokens of reasoning before each answer (0: no reasoning field)",
    "answer_tokens_min": "shortest plain answer in tokens",
    "answer_tokens_max": "longest plain answer in tokens",
    "tool_call_style": "k3: each call whole in one delta; k2: name first, then argument pieces",
    "enable_prompt_tokens_details": "report usage.prompt_tokens_details.cached_tokens",
    "gpu_count": "simulated GPUs (DCGM_FI_DEV_FB_* gauges, labelled simulated)",
    "gpu_memory_mib": "simulated memory per GPU, MiB",
    "weights_mib_per_gpu": "simulated weight memory per GPU, MiB",
    "kv_bytes_per_token": "simulated KV bytes per token across all GPUs",
    "malformed_tool_args_rate": "fault: tool-call arguments that are not valid JSON",
    "empty_tool_calls_rate": "fault: finish_reason tool_calls with an empty tool_calls list",
    "raw_tool_markup_rate": "fault: raw tool-call markup left in content instead of tool_calls",
    "reasoning_leak_rate": "fault: reasoning text emitted as content",
    "http_error_rate": "fault: requests rejected with --http-error-status",
    "http_error_status": "fault: status of injected HTTP errors (429, 500, 503 ...)",
    "http_error_style": "fault: body of injected errors: vllm (JSON), gateway (plain text) or html (an nginx "
                        "error page, text/html)",
    "http_error_retry_after_s": "fault: injected HTTP errors carry 'Retry-After: N' (0: no header)",
    "connection_reset_rate": "fault: the connection is reset (TCP RST) before any response byte",
    "midstream_reset_rate": "fault: streaming connection reset (TCP RST) halfway, not a clean close",
    "weak_answer_rate": "fault: a weak model, answering with nothing (no content, no tool call): model_output",
    "skip_tool_call_rate": "fault: a model that skips tool calls: with tool_choice auto it answers in prose where "
                           "it should call a tool (finish_reason stop, no calls): model_output; at temperature 0 "
                           "the same request is skipped every time",
    "midstream_error_rate": "fault: streaming error event halfway through the answer",
    "truncate_stream_rate": "fault: stream closed halfway without finish chunk or [DONE]",
    "slow_first_token_rate": "fault: share of requests with a stalled first token",
    "slow_first_token_ms": "fault: extra first-token delay, model ms",
    "slow_drip_rate": "fault: share of requests with slow token drip",
    "slow_drip_ms": "fault: extra delay between tokens, model ms",
    "prefix_cache_never_hits": "fault: prefix caching reported on but never hits",
    "metrics_disabled": "fault: as vLLM 0.32 with --disable-log-stats, only the tool-parser counter on /metrics, "
                        "no other vllm:* series",
    "health_flap_period_s": "fault: /health alternates 200 and 503 every N wall seconds since start, the engine "
                            "being fine (0: off; the metrics port's /health stays 200)",
    "metrics_http_status": "fault: /metrics on the main port answers this status (404: '404 page not found', "
                           "a gateway forwarding only /v1); the metrics port still serves",
    "metrics_stall_ms": "fault: wall ms (not scaled by --time-scale) each /metrics response waits while the "
                        "stall window is open (0: off)",
    "metrics_stall_after_requests": "fault: the /metrics stall window opens once this many chat requests "
                                    "were received",
    "metrics_stall_requests": "fault: the /metrics stall window closes once this many more chat requests were "
                              "received (0: never closes)",
    "stream_empty_tool_calls_rate": "fault: streamed answers only: every tool-call delta is sent as an empty "
                                    "'\"tool_calls\": []', finish_reason still tool_calls (vllm#54701); the "
                                    "stream:false twin stays right",
    "stream_empty_tool_calls_min_running": "fault: --stream-empty-tool-calls-rate applies only when the engine "
                                           "holds at least this many requests (running + waiting, this one "
                                           "included) when the request arrives",
    "tool_args_burst_rate": "fault: streamed answers only: arguments do not stream; each call comes whole in "
                            "one delta after a silence of --tool-args-burst-ms (vllm#50604)",
    "tool_args_burst_ms": "fault: the silence before the first tool-call delta, model ms",
    "parallel_call_drop_rate": "fault: streamed answers with 2+ calls: the last call is never sent, "
                               "finish_reason stays tool_calls (vllm#24478)",
    "parallel_call_merge_rate": "fault: streamed answers with 2+ calls: the second call's header is lost and its "
                                "arguments follow the first's under its index ('{...}{...}', one call fewer)",
    "parallel_call_duplicate_rate": "fault: streamed answers with calls: one call is sent again, whole, under a "
                                    "new index with the same id",
    "missing_think_transition_rate": "fault: no think-to-answer transition: the call (as K3 markup) or the answer "
                                     "stays in reasoning; content empty, no calls, finish_reason stop "
                                     "(vllm#53246; needs --reasoning-tokens > 0)",
    "oom_kv_demand_tokens": "fault: crash with a CUDA-OOM line when queued+running KV demand passes this (0: off)",
    "ignore_disconnect_rate": "fault: the request keeps decoding to its end after the client went away (a "
                              "gateway that does not pass the disconnect on): KV and batch seat stay taken, no abort",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", type=Path, help="YAML profile with 'engine:' and 'faults:' sections; "
                        "flags given on the command line override it")
    for group_name, cls in (("engine", SimConfig), ("faults", FaultProfile)):
        group = parser.add_argument_group(group_name)
        for field in dataclasses.fields(cls):
            if field.name == "faults":
                continue
            default = getattr(cls(), field.name)
            kind = type(default)
            text = f"{HELP[field.name]} (default: {default})"
            if kind is bool:
                group.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction, default=None,
                                   help=text)
            else:
                group.add_argument(_flag(field.name), type=kind, default=None, help=text)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Profile first, then explicit flags on top."""
    config = load_profile(args.profile) if args.profile else SimConfig()
    for target in (config, config.faults):
        for field in dataclasses.fields(target):
            value = getattr(args, field.name, None)
            if field.name != "faults" and value is not None:
                setattr(target, field.name, value)
    validate(config)
    return config


def run(args: argparse.Namespace) -> int:
    from k3load.sim.server import serve  # aiohttp only when serving

    try:
        config = config_from_args(args)
    except ProfileError as exc:
        print(f"k3load sim: {exc}")
        return 2
    asyncio.run(serve(config))
    return 0
