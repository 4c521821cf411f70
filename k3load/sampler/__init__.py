"""The side sampler: the server's and the GPUs' view of a run, written next to the load's records.

Usage (no Locust needed; inside a Locust process it runs as greenlets)::

    from k3load.sampler import Sampler
    sampler = Sampler("runs/r1", "http://127.0.0.1:8000/metrics", gpu_metrics_urls=["http://node1:9400/metrics"],
                      interval_s=1.0, nvml="auto", server_log="vllm.log", api_key=key).start()
    ...
    sampler.stop()          # final reading, files closed; returns counts

or `k3load sample --metrics-url URL [--metrics-url URL2 ...] [--prometheus-url URL] --out DIR [...]`
(k3load/sampler/cli.py). Several metrics URLs (replicas, data-parallel ranks) are scraped by one loop each;
`/health` is polled on the target only (`health_url`, default next to the first metrics URL); the API key
goes only to URLs on the target's scheme, host and port, never to Prometheus or a dcgm-exporter.

Files (JSON lines, appended and flushed as they happen; `ts` is wall-clock epoch seconds):

metrics.jsonl.gz — one line per scrape of vLLM /metrics, per source (`source`: the URL without credentials),
compressed and flushed at least every half second (k3load.evidence: read it with `evidence.lines` and
`SeriesTable.decode`, which gives back `samples` as below; on disk the names are written once per file)::

    {"ts", "source": URL, "ok": true, "scrape_ms", "load_generator_cpu_pct", "load_generator_cpu_wait_pct",
     "vllm_series": N, "samples": {"vllm:name{label=\"v\",...}": value, ...},
     "legacy": {"vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc", ...},
     "process_start_ts": float | null, "types": {family: type}  (only when it changed: first line, after a change)}
    {"ts", "source", "ok": false, "scrape_ms", "load_generator_cpu_pct", "load_generator_cpu_wait_pct",
     "error": "connection refused" | "timeout after 2 s" | "HTTP 500" | "parse error: ...", "http_status": int | null}

  From Prometheus (`prometheus_url`, k3load/sampler/promapi.py): the same shape, one line per query_range
  step (ts = the evaluation time, on a grid of `interval_s` from the sampler's start) per `instance`, with
  `"source": "prometheus:<instance>"`, `"scrape_ms": null`, `"load_generator_cpu_pct": null`, no `types`
  (the query API has none), keys without Prometheus's `instance`/`job` labels (other target labels stay);
  `{"ts", "source", "ok": false, "scrape_ms": null, "load_generator_cpu_pct": null, "error": "up=0: ..." |
  "prometheus: <reason>", "http_status"}` when Prometheus's scrape failed (up=0) or the query failed (then
  one line per instance known, or one with `"source": "prometheus:<Prometheus URL>"` when none is yet).

  `samples` holds every vllm:* sample (counters with `_total`, histograms as `_bucket{le=..}`/`_sum`/`_count`,
  gauges) keyed by name and sorted labels (`k3load.sampler.prom.split_key` splits a key); values are
  cumulative as the server reports them — subtract two lines of the same window, and restart from zero
  after a `counter_reset` event. Left out: `*_created` samples and `vllm:*_info` gauges (their labels
  are events). `vllm_series: 0` with empty samples = no vllm:* series at all (never zeros). Metrics count
  as missing when the engine's gauges (`k3load.sampler.prom.REQUIRED_SERIES`: num_requests_running,
  num_requests_waiting, kv_cache_usage_perc) are absent, even if other vllm:* series remain (vLLM 0.32 with
  --disable-log-stats keeps its 12 `vllm:tool_call_parser_invocations_total` series): those are still
  written, the `metrics_missing` event says what is absent, and absent series are unknown. A value that is
  NaN/Inf is null. `load_generator_cpu_pct`: CPU of the sampling process per wall second (100 = one core);
  `load_generator_cpu_wait_pct`: the share of the same wall time it was ready to run and waited for a CPU
  (k3load.sampler.cpu_wait: a host short of CPU starves the load generator without saturating it; null where
  the kernel does not count it; absent from lines written before it was recorded).

gpu.jsonl — one line per GPU per reading (fields a source lacks are null)::

    {"ts", "source": "nvml" | "dcgm:URL", "node", "gpu": index, "uuid", "name", "memory_used_mib",
     "memory_total_mib", "memory_free_mib", "util_pct", "temp_c", "power_w", "sm_clock_mhz",
     "throttle_reasons": [..] | null, "simulated": bool, "extra": {other DCGM_FI_* fields}}

events.jsonl — `{"ts", "event", ...}`, shared with the locust layer (run_start, stage_start, run_end ...):
the sampler writes sampler_start/stop/error, server_down/up and health_slow (/health), counter_reset,
metrics_missing/back, cache_config and vllm_info (each /metrics source, and Prometheus's instances as
`prometheus:<instance>`), prometheus_error/back/incomplete, gpu_found/unavailable and gpu_source_down/up,
and the flagged server log lines (log_oom, log_nccl, log_cuda_error, log_engine_dead, log_warning) with
log_tail_ended/error and log_flags_suppressed. Every name, its fields and what it means: k3load/events.py.

server.log — the server's log lines as read (a file followed, or a command's output).
"""

from k3load.sampler.loop import Sampler

__all__ = ["Sampler"]
