"""The sampler's parts without sockets: parsing, resets, dcgm rows, metrics missing, log flags, health
transitions, NVML."""

from __future__ import annotations

import json
import socket

import pytest

from k3load.sampler.dcgm import dcgm_rows
from k3load.sampler.fetch import Fetched, health_url_for, redact_url
from k3load.sampler.gpu import GPU_FIELDS, throttle_reasons
from k3load.sampler.health import HealthWatch
from k3load.sampler.logtail import classify
from k3load.sampler.nvml import NvmlReader, inventory, load
from k3load.sampler.prom import absent_required, counter_resets, parse, sample_key, split_key
from k3load.sampler.scrape import MetricsWatch
from tests.fake_nvml import NVML_ERROR_LIBRARY_NOT_FOUND, FakeGpu, FakeNvml
from tests.probes import WIRE

# dcgm-exporter 4.x text, default counters, two GPUs on one node (label set as the exporter writes it).
_GPU_LABELS = ('gpu="{i}",UUID="GPU-{u}",pci_bus_id="00000000:{bus}:00.0",device="nvidia{i}",modelName="NVIDIA H200",'
               'Hostname="gpu-node-1",DCGM_FI_DRIVER_VERSION="580.65.06"')
_GPUS = {0: _GPU_LABELS.format(i=0, u="a", bus="18"), 1: _GPU_LABELS.format(i=1, u="b", bus="2A")}
_DCGM_VALUES = {  # field: {gpu: value}
    "DCGM_FI_DEV_FB_USED": {0: 120000, 1: 130000},
    "DCGM_FI_DEV_FB_FREE": {0: 20000, 1: 10000},
    "DCGM_FI_DEV_GPU_UTIL": {0: 97},
    "DCGM_FI_DEV_POWER_USAGE": {0: 612.5},
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": {0: 68},
    "DCGM_FI_DEV_XID_ERRORS": {1: 79},
}
DCGM_BODY = "".join(f"# HELP {field} {field}.\n# TYPE {field} gauge\n"
                    + "".join(f"{field}{{{_GPUS[gpu]}}} {value}\n" for gpu, value in values.items())
                    for field, values in _DCGM_VALUES.items())

LEGACY_BODY = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 100.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 40.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.1",model_name="m"} 3.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 4.0
vllm:time_per_output_token_seconds_count{model_name="m"} 4.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.5
"""


# -- /metrics parsing --------------------------------------------------------------------------------
def test_real_vllm_capture_keeps_every_vllm_sample_and_drops_created_and_info():
    body = (WIRE / "metrics_after.txt").read_text()
    parsed = parse(body)
    expected = [line for line in body.splitlines() if line.startswith("vllm:")
                and not line.split("{")[0].endswith("_created") and not line.startswith("vllm:cache_config_info")]
    assert len(parsed.samples) == len(expected) > 300
    assert parsed.vllm_series == len(expected) + 1  # the info gauge counts as a series
    assert parsed.samples['vllm:prefix_cache_hits_total{engine="0",model_name="tiny"}'] is not None
    assert 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"}' in parsed.samples
    assert not any("_created" in key for key in parsed.samples)
    assert parsed.types["vllm:prefix_cache_hits"] == "counter"
    assert parsed.types["vllm:iteration_tokens_total"] == "histogram"  # a histogram despite its name
    assert {"vllm:prefix_cache_hits_total", "vllm:iteration_tokens_total_bucket"} <= parsed.monotonic
    assert "vllm:num_requests_running" not in parsed.monotonic
    (info,) = parsed.infos["vllm:cache_config_info"]
    assert info["block_size"] == "128" and info["num_gpu_blocks"] == "24" and info["enable_prefix_caching"] == "True"
    assert parsed.process_start_ts == pytest.approx(1.79621793514e9)
    assert parsed.legacy == {} and parsed.dcgm == {}


def test_legacy_names_are_kept_and_labelled():
    parsed = parse(LEGACY_BODY)
    assert set(parsed.legacy) == {"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries",
                                  "vllm:gpu_prefix_cache_hits", "vllm:time_per_output_token_seconds"}
    assert parsed.legacy["vllm:gpu_cache_usage_perc"] == "vllm:kv_cache_usage_perc"
    assert parsed.samples['vllm:gpu_prefix_cache_hits_total{model_name="m"}'] == 40.0


def test_keys_are_stable_and_split_back_with_escapes():
    labels = {"z": "1", "a": 'say "hi"\\ \n there'}
    key = sample_key("vllm:x_total", labels)
    assert key.startswith('vllm:x_total{a="say \\"hi\\"') and key.index('a="') < key.index('z="')
    assert split_key(key) == ("vllm:x_total", labels)
    assert split_key("vllm:plain") == ("vllm:plain", {})
    parsed = parse('# TYPE vllm:g gauge\nvllm:g{b="2",a="1"} 1\n')
    assert list(parsed.samples) == ['vllm:g{a="1",b="2"}']


def test_counter_resets_only_for_monotonic_series_that_went_down():
    before = parse((WIRE / "metrics_after.txt").read_text())
    after = parse((WIRE / "metrics_before.txt").read_text())
    down = counter_resets(before.samples, after.samples, before.monotonic)
    assert 'vllm:prompt_tokens_total{engine="0",model_name="tiny"}' in down
    assert not any(k.startswith("vllm:num_requests_running") for k in down)  # a gauge may go down freely
    assert counter_resets(after.samples, before.samples, before.monotonic) == []


def test_non_finite_values_become_null_never_zero():
    parsed = parse("# TYPE vllm:g gauge\nvllm:g NaN\n")
    assert parsed.samples == {"vllm:g": None}
    assert json.loads(json.dumps(parsed.samples)) == {"vllm:g": None}


@pytest.mark.parametrize("body", ["garbage here", "<html><body>502 Bad Gateway</body></html>"])
def test_garbage_raises_value_error(body):
    with pytest.raises(ValueError):
        parse(body)


# -- dcgm rows ---------------------------------------------------------------------------------------
def test_dcgm_rows_one_per_gpu_with_nones_for_what_is_absent():
    rows = dcgm_rows(parse(DCGM_BODY).dcgm, 100.0, "http://gpu-node-1:9400/metrics")
    assert [r["gpu"] for r in rows] == [0, 1]
    first, second = rows
    assert list(first) == list(GPU_FIELDS)
    assert first["source"] == "dcgm:http://gpu-node-1:9400/metrics" and first["node"] == "gpu-node-1"
    assert (first["memory_used_mib"], first["memory_free_mib"], first["memory_total_mib"]) == (120000, 20000, 140000)
    assert first["util_pct"] == 97 and first["power_w"] == 612.5 and first["uuid"] == "GPU-a"
    assert first["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]  # 68 = 0x4 | 0x40
    assert first["temp_c"] is None and first["sm_clock_mhz"] is None and first["simulated"] is False
    assert second["util_pct"] is None and second["throttle_reasons"] is None
    assert second["extra"] == {"DCGM_FI_DEV_XID_ERRORS": 79}


def test_throttle_reason_bits():
    assert throttle_reasons(None) is None
    assert throttle_reasons(0) == []
    assert throttle_reasons(0x1 | 0x400) == ["gpu_idle", "bit_0x400"]


# -- log flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("line", "kind"), [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
     "139.81 GiB of which 3.06 MiB is free.", "log_oom"),
    ("RuntimeError: CUDA error: out of memory", "log_oom"),
    ("gpu-node-1:123:456 [0] NCCL WARN Call to ibv_reg_mr failed with error Cannot allocate memory", "log_nccl"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
     "log_nccl"),
    ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)", "log_nccl"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "log_cuda_error"),
    ("NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.", "log_cuda_error"),
    ("ERROR 08-13 10:00:00 [core.py:700] EngineCore encountered a fatal error.", "log_engine_dead"),
    ("WARNING 08-13 10:00:00 [custom_all_reduce.py:90] Custom allreduce is disabled because it's not supported "
     "on more than two PCIe-only GPUs.", "log_warning"),
    ("WARNING 08-13 10:00:00 [fused_moe.py:800] Using default MoE config. Performance might be sub-optimal! "
     "Config file not found; falling back to the default kernel", "log_warning"),
    ("INFO 08-13 10:00:00 [loggers.py:120] Avg prompt throughput: 10.0 tokens/s", None),
    ("(EngineCore pid=1) INFO 12-02 14:07:08 [core.py:133] Initializing a V1 LLM engine with config: "
     "compilation_config={'cudagraph_mode': <CUDAGraphMode.NONE: 0>, 'pass_config': {'fuse_allreduce_rms': False}}, "
     "on_error: raise", None),
    ("INFO:     127.0.0.1:5000 - \"POST /v1/chat/completions HTTP/1.1\" 200 OK", None),
])
def test_log_lines_are_flagged_by_kind(line, kind):
    assert classify(line) == kind


# -- metrics missing -------------------------------------------------------------------------------
ENGINE_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
# What vLLM 0.32 with --disable-log-stats still serves under vllm: (the tool-parser family of a real capture).
STATS_OFF_BODY = "".join(line + "\n" for line in (WIRE / "metrics_end.txt").read_text().splitlines()
                         if "vllm:tool_call_parser_invocations" in line)
NO_VLLM_BODY = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e9\n"


def _watched(*bodies: str) -> tuple[list[dict], list[tuple]]:
    """Each body scraped once, at ts 1, 2, ...: the metrics.jsonl lines and the missing/back events."""
    lines: list[dict] = []
    events: list[tuple] = []
    queue = iter(bodies)
    watch = MetricsWatch("http://x/metrics", lambda _url: Fetched(True, 200, next(queue), None, 1.0), lines,  # type: ignore[arg-type]
                         lambda name, ts, **f: events.append((name, ts, f)))
    for ts in range(1, len(bodies) + 1):
        watch.tick(float(ts), None)
    return lines, [e for e in events if e[0] in ("metrics_missing", "metrics_back")]


@pytest.mark.parametrize(("body", "absent"), [
    ((WIRE / "metrics_after.txt").read_text(), []),
    (STATS_OFF_BODY, ENGINE_GAUGES),
    (LEGACY_BODY + "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n", []),  # the old KV name counts
    (NO_VLLM_BODY, ENGINE_GAUGES),
])
def test_required_engine_gauges(body, absent):
    assert absent_required(parse(body)) == absent


def test_stats_disabled_is_missing_but_what_remains_is_written():
    full = (WIRE / "metrics_after.txt").read_text()
    lines, events = _watched(STATS_OFF_BODY, STATS_OFF_BODY, full, NO_VLLM_BODY, full)
    assert [(name, ts) for name, ts, _ in events] == [("metrics_missing", 1.0), ("metrics_back", 3.0),
                                                      ("metrics_missing", 4.0), ("metrics_back", 5.0)]
    missing = events[0][2]
    assert missing["absent"] == ENGINE_GAUGES and missing["vllm_series"] == 12
    assert missing["reason"] == ("no vllm:num_requests_running / vllm:num_requests_waiting / vllm:kv_cache_usage_perc"
                                 " on /metrics (only 12 vllm:tool_call_parser_invocations_total series): "
                                 "vLLM started with --disable-log-stats?")
    assert events[2][2]["reason"] == "no vllm:* series on /metrics (vLLM started with --disable-log-stats?)"
    for line in lines[:2]:  # the series that are there are kept, never thrown away
        assert line["ok"] and line["vllm_series"] == 12 and len(line["samples"]) == 12
        assert all(key.startswith("vllm:tool_call_parser_invocations_total{") for key in line["samples"])
    assert lines[3]["vllm_series"] == 0 and lines[3]["samples"] == {}  # nothing at all: the empty line as before
    assert lines[2]["vllm_series"] > 300


def test_one_engine_gauge_missing_is_named():
    body = (WIRE / "metrics_after.txt").read_text().replace("vllm:kv_cache_usage_perc", "vllm:kv_cache_fill")
    _, events = _watched(body)
    ((name, _, fields),) = events
    assert name == "metrics_missing" and fields["absent"] == ["vllm:kv_cache_usage_perc"]
    series = fields["vllm_series"]
    assert fields["reason"].startswith(f"no vllm:kv_cache_usage_perc on /metrics ({series} vllm:* series: ")
    assert fields["reason"].endswith("more names): renamed in this vLLM version?")


# -- health ------------------------------------------------------------------------------------------
TIMEOUT = "timeout after 2 s"


def _fetched(ok: bool, status: int | None = None, error: str | None = None) -> Fetched:
    return Fetched(ok, status, "", error, 1.0)


def _health(polls: list[tuple[float, Fetched]], **kw: float) -> tuple[HealthWatch, list[tuple]]:
    events: list[tuple] = []
    watch = HealthWatch("u", lambda name, ts, **f: events.append((name, ts, f)), "u", **kw)  # type: ignore[arg-type]
    for ts, result in polls:
        watch.observe(result, ts)
    return watch, events


def test_health_writes_transitions_only():
    events: list[tuple] = []
    watch = HealthWatch("http://x/health", lambda name, ts, **f: events.append((name, ts, f)), "http://x/health")
    watch.observe(_fetched(True, 200), 1.0)
    watch.observe(_fetched(False, 503, "HTTP 503"), 2.0)
    watch.observe(_fetched(False, None, "connection refused"), 3.0)
    watch.observe(_fetched(True, 200), 5.5)
    assert [(e[0], e[1]) for e in events] == [("server_down", 2.0), ("server_up", 5.5)]
    assert events[0][2]["reason"] == "HTTP 503" and events[0][2]["http_status"] == 503
    assert events[0][2]["first_poll"] is False and events[1][2]["down_s"] == 3.5


def test_health_down_at_first_poll_is_said():
    _, events = _health([(1.0, _fetched(False, None, "connection refused"))])
    assert events == [("server_down", 1.0, {"source": "u", "reason": "connection refused", "http_status": None,
                                            "first_poll": True, "failed_polls": 1, "unanswered_s": 0.0})]


def test_one_slow_poll_is_no_crash():
    """Loaded machine: one /health past the fetch timeout, then an answer: a health_slow, never server_down."""
    watch, events = _health([(0.0, _fetched(True, 200)), (3.0, _fetched(False, None, TIMEOUT)),
                             (4.0, _fetched(True, 200))])
    assert events == [("health_slow", 3.0, {"source": "u", "reason": TIMEOUT, "failed_polls": 1,
                                            "unanswered_s": 1.0})]
    assert watch.transitions == 0 and watch.up is True


def test_polls_that_keep_timing_out_are_down_from_the_first():
    """A hung server (each tick ~4 s: /metrics and /health both time out): said at the third poll, 8 s on,
    stamped with the first failed poll so the crash timing is where it stopped answering."""
    polls = [(0.0, _fetched(True, 200))] + [(t, _fetched(False, None, TIMEOUT)) for t in (4.0, 8.0)]
    _, events = _health(polls)
    assert events == []
    _, events = _health([*polls, (12.0, _fetched(False, None, TIMEOUT)), (16.0, _fetched(False, None, TIMEOUT)),
                         (20.0, _fetched(True, 200))])
    assert events == [("server_down", 4.0, {"source": "u", "reason": TIMEOUT, "http_status": None,
                                            "first_poll": False, "failed_polls": 3, "unanswered_s": 8.0}),
                      ("server_up", 20.0, {"source": "u", "down_s": 16.0})]


@pytest.mark.parametrize(("polls", "down"), [
    # Three quick timeouts are not yet 5 s: the fourth, 5 s after the first, is.
    ([(t, _fetched(False, None, TIMEOUT)) for t in (1.0, 2.0, 3.0, 6.0)], (1.0, 4, 5.0, True)),
    # A gateway's 504 is no answer either; then refused: the process is gone, said at once.
    ([(1.0, _fetched(False, 504, "HTTP 504")), (3.0, _fetched(False, None, "connection refused"))],
     (1.0, 2, 2.0, True)),
    ([(0.0, _fetched(True, 200)), (1.0, _fetched(False, None, "connection reset"))], (1.0, 1, 0.0, False)),
])
def test_health_down_after_a_spell(polls, down):
    watch, events = _health(polls)
    ((name, ts, fields),) = events
    assert name == "server_down" and watch.up is False and watch.transitions == 1
    assert (ts, fields["failed_polls"], fields["unanswered_s"], fields["first_poll"]) == down


def test_health_down_thresholds_are_parameters():
    _, events = _health([(0.0, _fetched(False, None, TIMEOUT))], down_after_polls=1, down_after_s=0.0)
    assert [e[0] for e in events] == ["server_down"]


def test_urls():
    assert health_url_for("http://h:8000/metrics") == "http://h:8000/health"
    assert health_url_for("https://gw.example/vllm/metrics") == "https://gw.example/vllm/health"
    assert redact_url("http://user:pw@h:8000/metrics") == "http://h:8000/metrics"


# -- NVML through the fake ---------------------------------------------------------------------------
def test_nvml_reader_rows_in_the_gpu_shape():
    lib = FakeNvml(gpus=[FakeGpu(used_bytes=1024 * 2**20, total_bytes=4096 * 2**20),
                         FakeGpu(uuid="GPU-1", used_bytes=2048 * 2**20, total_bytes=4096 * 2**20, util_pct=55)])
    loaded, reason = load(lib)
    assert loaded is lib and reason is None
    reader = NvmlReader(lib)
    rows = reader.read(10.0)
    assert [(r["gpu"], r["memory_used_mib"], r["memory_total_mib"], r["memory_free_mib"]) for r in rows] == [
        (0, 1024.0, 4096.0, 3072.0), (1, 2048.0, 4096.0, 2048.0)]
    first = rows[0]
    assert list(first) == list(GPU_FIELDS) and first["source"] == "nvml" and first["node"] == socket.gethostname()
    assert (first["temp_c"], first["power_w"], first["sm_clock_mhz"]) == (35, 75.0, 1980)
    assert first["throttle_reasons"] == ["gpu_idle"] and first["simulated"] is False
    assert rows[1]["util_pct"] == 55 and rows[1]["uuid"] == "GPU-1"
    lib.gpus[0].used_bytes = 3000 * 2**20
    assert reader.read(11.0)[0]["memory_used_mib"] == 3000.0
    reader.close()
    assert lib.initialised == 0


def test_nvml_unsupported_fields_are_none():
    lib = FakeNvml(unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetUtilizationRates",
                                "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTemperature"})
    load(lib)
    (row,) = NvmlReader(lib).read(1.0)
    assert row["power_w"] is None and row["util_pct"] is None and row["temp_c"] is None
    assert row["throttle_reasons"] is None and row["memory_used_mib"] == 512.0


def test_nvml_unavailable_gives_a_reason_and_no_inventory():
    lib = FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)
    assert load(lib) == (None, "NVML init failed: NVMLError: NVML Shared Library Not Found")
    assert inventory(lib) is None


def test_inventory_shape_for_the_precheck():
    gpus = [FakeGpu(uuid=f"GPU-{i}", pci_bus_id=f"00000000:{i:02X}:00.0", numa_node=i // 2, nvlinks=0 if i == 3 else 18)
            for i in range(4)]
    lib = FakeNvml(gpus=gpus, unsupported={"nvmlSystemGetNVMLVersion"})
    inv = inventory(lib)
    assert inv is not None and lib.initialised == 0  # shut down again
    assert inv["driver_version"] == "580.65.06" and inv["cuda_driver_max_version"] == "13.0"
    assert "not the CUDA runtime" in inv["cuda_driver_max_version_note"]
    assert inv["nvml_version"] is None and inv["gpu_count"] == 4 and inv["host"] == socket.gethostname()
    assert inv["gpus"][1] == {"index": 1, "name": "NVIDIA H200", "uuid": "GPU-1", "memory_total_mib": 143771.0,
                              "pci_bus_id": "00000000:01:00.0", "nvlink_active_links": 18}
    assert inv["gpus"][3]["nvlink_active_links"] is None
    matrix = inv["topology"]["matrix"]
    # GPUs 0, 1 on NUMA node 0, GPUs 2, 3 on node 1; GPU 3 has no NVLink: its peers are PCIe/CPU levels.
    assert matrix[0] == ["X", "NVLINK", "NVLINK", "SYS"]
    assert matrix[3] == ["SYS", "SYS", "NODE", "X"]
    assert set(inv["topology"]["legend"]) >= {"X", "NVLINK", "NODE", "SYS"}


def test_inventory_single_gpu_has_no_topology_and_cuda_12_8_reads_right():
    inv = inventory(FakeNvml(cuda_driver_version=12080))
    assert inv is not None and inv["topology"] is None and inv["cuda_driver_max_version"] == "12.8"
