"""Property tests of the parsers of outside bytes that are not the chat wire (issue 37, item 4): a server's
/metrics, the precheck's input files, and the records a run writes and `k3load analyze` reads back.

Properties: nothing raises past the documented error types; every reading or record written reads back
identically; the judgment of any set of written records ends in a verdict. Deterministic in `make test`
(tests/conftest.py's `ci` profile); `make fuzz SECONDS=N` draws more.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from k3load.client.result import STATUSES
from k3load.events import Event
from k3load.evidence import RECORDS
from k3load.outcomes import HARNESS_ERROR, LAYERS
from k3load.precheck.collect_env import parse_collect_env, parse_version
from k3load.precheck.evidence import normalise_host
from k3load.precheck.formats import EvidenceFormatError
from k3load.precheck.startup_log import parse_startup_log
from k3load.records import Attempt, Finding, read_records
from k3load.rundir import JsonlLog
from k3load.sampler import prom
from k3load.sampler.fetch import Fetched
from k3load.sampler.scrape import MetricsWatch

# -- /metrics --------------------------------------------------------------------------------------------
EXPOSITION_LINES = st.sampled_from([
    "# TYPE vllm:num_requests_running gauge", "vllm:num_requests_running 3", "# HELP vllm:x a help text",
    '# TYPE vllm:kv_cache_usage_perc gauge', 'vllm:kv_cache_usage_perc{engine="0"} 0.5',
    "# TYPE vllm:num_requests_waiting gauge", "vllm:num_requests_waiting NaN", "vllm:num_requests_waiting +Inf",
    "# TYPE vllm:prompt_tokens counter", "vllm:prompt_tokens_total 10", "vllm:prompt_tokens_created 1e9",
    "# TYPE vllm:e2e histogram", 'vllm:e2e_bucket{le="+Inf"} 4', "vllm:e2e_count 4", "vllm:e2e_sum -1",
    '# TYPE vllm:cache_config_info gauge', 'vllm:cache_config_info{block_size="16",num_gpu_blocks="x"} 1',
    'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-1",Hostname="n1"} 1000', 'DCGM_FI_DEV_FB_FREE{gpu="0"} -5',
    "process_start_time_seconds 1.7e9", "process_start_time_seconds", "", "#", "{", '"', "\\", " ",
    'vllm:x{a="\\"} 1', 'vllm:x{a="b",a="c"} 1', "vllm:x 1 2 3", "vllm:x 1e999", "vllm:x 0x10",
])
HOSTILE = [
    'vllm:x{a="' + "b" * 1_000_000 + '"} 1',  # a megabyte label value
    "# TYPE vllm:x gauge\n" + "".join(f'vllm:x{{i="{i}"}} {i}\n' for i in range(20_000)),  # 20,000 series
    "# TYPE vllm:x gauge\nvllm:x{" + "a" * 100_000 + '="1"} 1',  # a 100,000-character label name
    "\x00" * 1000, "vllm:x 1\r\nvllm:y 2\r\n", "\ud800 1", "vllm:x " + "9" * 10_000,
]


def _watch(body: str) -> tuple[MetricsWatch, list[dict[str, Any]], list[tuple[Event, dict[str, Any]]]]:
    """A scrape of `body`, its lines kept in a list (JsonlLog's `append`) and its events in another."""
    lines: list[dict[str, Any]] = []
    events: list[tuple[Event, dict[str, Any]]] = []
    fetched = Fetched(True, 200, body, None, 1.0)
    watch = MetricsWatch("http://127.0.0.1:9/metrics", lambda _url: fetched, lines,  # type: ignore[arg-type]
                         lambda name, _ts, **fields: events.append((name, fields)), gpu_sink=lambda rows: None)
    return watch, lines, events


@given(st.one_of(st.text(), st.lists(st.one_of(EXPOSITION_LINES, st.text(max_size=30)), max_size=20)
                 .map("\n".join)))
@example(HOSTILE[0])
@example(HOSTILE[1])
@example(HOSTILE[2])
@example(HOSTILE[3])
@example(HOSTILE[4])
@example(HOSTILE[5])
@example(HOSTILE[6])
@settings(max_examples=300)
def test_any_metrics_body_is_a_reading_or_a_parse_error_line_never_an_exception(body: str) -> None:
    with contextlib.suppress(ValueError):  # the documented refusal: not the text format
        prom.parse(body)
    watch, lines, events = _watch(body)
    watch.tick(1.0, None)
    watch.tick(2.0, None)  # a second reading of the same body: resets and changes compared with the first
    assert len(lines) == 2 and watch.scrapes == 2  # one line per scrape, ok or not
    for line in lines:
        json.dumps(line, allow_nan=True)  # what the writer serialises
        assert line["ok"] is False or "samples" in line
    assert {name for name, _ in events} <= set(Event)


# -- the precheck's input files --------------------------------------------------------------------------
COLLECT_ENV_LINES = st.sampled_from([
    "PyTorch version: 2.9.0+cu130", "CUDA used to build PyTorch: 13.0", "CUDA runtime version: 13.0.48",
    "Is CUDA available: True", "Nvidia driver version: 580.82.07", "vLLM Version: 0.27.1", "vLLM Version: ",
    "GPU models and configuration:", "GPU 0: NVIDIA GB300", "GPU 1:", "vLLM Build Flags:", "CUDA Archs: 10.0",
    "GPU Topology:", "\tGPU0\tGPU1", "GPU0\t X \tNV18", "[pip3] torch==2.9.0", "[pip3] ==", "==============",
    "Versions of relevant libraries:", ":", "::::", "vLLM Version: 0.27.1rc1.dev5+g1234",
])
LOG_LINES = st.sampled_from([
    "INFO 12-05 10:00:00 [api_server.py:1] vLLM API server version 0.27.1",
    "WARNING 12-05 10:00:01 [cuda.py:2] Some kernel fallback", "ERROR 12-05 [x.py:3] CUDA error: illegal",
    "INFO 12-05 10:00:02 [arg_utils.py:4] non-default args: {'model': 'k3', 'tensor_parallel_size': 8}",
    "INFO 12-05 [utils.py:5] non-default args: {'a': [1, 2", "NCCL version 2.27.3", "(EngineCore pid=1) INFO x",
    "WARNING [x.py:1] ", "INFO 12-05 [gpu_worker.py:9] Available KV cache memory: 120.5 GiB",
])


@given(st.one_of(st.text(), st.lists(st.one_of(COLLECT_ENV_LINES, st.text(max_size=40)), max_size=25)
                 .map("\n".join)))
def test_any_collect_env_text_gives_facts_or_nones(text: str) -> None:
    facts = parse_collect_env(text)
    assert isinstance(facts["format_ok"], bool) and isinstance(facts["pip"], dict)
    assert facts["gpu_count"] is None or facts["gpu_count"] == len(facts["gpus"]) > 0
    json.dumps(facts)  # compat.json carries them
    parse_version(text[:40])


@given(st.one_of(st.text(), st.lists(st.one_of(LOG_LINES, st.text(max_size=60)), max_size=25).map("\n".join)),
       st.sampled_from(["cuda", "cpu"]))
def test_any_startup_log_gives_counted_lines_and_classified_warnings(text: str, platform: str) -> None:
    facts = parse_startup_log(text, platform)
    assert facts["lines"] == len(text.splitlines())
    assert all(1 <= item["line"] <= facts["lines"] for item in facts["flagged"] + facts["other_warnings"])
    json.dumps(facts)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=20)
INVENTORY_KEYS = st.sampled_from(["node", "driver_version", "cuda_driver_max_version", "gpu_count", "gpus",
                                  "container_image", "topology", "source", "nvidia_smi"])


INVENTORY_FIELDS = ("(top level)", "node", "host", "hostname", "driver_version", "cuda_driver_max_version",
                    "gpu_count", "device_count", "gpus", "container_image", "topology")


@given(st.one_of(JSON_VALUES, st.dictionaries(INVENTORY_KEYS, JSON_VALUES, max_size=9)))
@example({"gpus": [{"name": "GB300"}], "gpu_count": 2, "driver_version": 580})
@example({"gpu_count": True})
@example({"gpus": True})  # found by the fuzzer: TypeError in normalise_host
@example({"driver_version": "580.95.05", "gpu_count": 2, "gpus": [{"name": "NVIDIA GB300"}, {}]})
@example({"driver_version": None, "gpus": []})
def test_any_inventory_json_is_one_node_judged_or_an_input_error_naming_the_field(raw: Any) -> None:
    """Issue 38: a file that is not the inventory format is EvidenceFormatError naming the file and the
    field (a harness error, never a `rebuild`); a well-formed one is one node, its gaps (nulls) named."""
    try:
        host = normalise_host(raw, "hosts/n1.json")
    except EvidenceFormatError as exc:
        assert str(exc).startswith("hosts/n1.json: ") and "\n" not in str(exc)
        assert exc.field.split("[")[0] in INVENTORY_FIELDS, exc.field
        return
    assert isinstance(raw, dict) and "driver_version" in raw and ({"gpu_count", "gpus"} & set(raw))
    assert set(host["problems"]) <= {"no driver_version", "no gpu_count"}
    assert host["node"] and (host["driver_version"] is None or isinstance(host["driver_version"], str))
    json.dumps(host)


# -- records written and read back -----------------------------------------------------------------------
TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)  # surrogates too
FINITE = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False)
MAYBE_MS = st.none() | st.floats(min_value=0, max_value=1e7, allow_nan=False)
CHECKS = st.sampled_from(["http.status", "tool_call.arguments_json", "tool_call.schema", "answer.nonempty",
                          HARNESS_ERROR, "json.schema", "stream.done"]) | st.text(max_size=12)


@st.composite
def attempts(draw: st.DrawFn, run_id: str = "r") -> Attempt:
    send = draw(st.floats(min_value=1.7e9, max_value=1.8e9))
    findings = draw(st.lists(st.builds(Finding, CHECKS, st.booleans(), st.none() | st.sampled_from(LAYERS),
                                       TEXT), max_size=4))
    failed = sorted({f.layer for f in findings if not f.ok and f.layer})
    return Attempt(
        run_id=run_id, attempt_id=draw(st.uuids()).hex, chain_id=draw(st.sampled_from(["c1", "c2", "c3"])),
        attempt=draw(st.integers(1, 3)), stage=draw(st.sampled_from(["load", "soak", "prefix-control", "x"])),
        scenario=draw(st.sampled_from(["s1", "s2"]) | TEXT), family=draw(st.sampled_from(
            ["agent", "shared_prefix", "cold", "long_input"])), turn=draw(st.integers(0, 5)),
        turn_kind=draw(st.sampled_from(["tool_call", "answer", "json"])), user_id="agent-1-1",
        request_sha256="0" * 64, prefix_sha256="1" * 64, transport="httpx", status=draw(st.sampled_from(STATUSES)),
        send_ts=send, end_ts=send + draw(st.floats(min_value=0, max_value=600)), ttft_ms=draw(MAYBE_MS),
        itl_mean_ms=draw(MAYBE_MS), e2e_ms=draw(MAYBE_MS), chunks=draw(st.integers(0, 10_000)),
        prompt_tokens=draw(st.none() | st.integers(0, 10**6)),
        completion_tokens=draw(st.none() | st.integers(0, 10**5)),
        cached_tokens=draw(st.none() | st.integers(0, 10**6)), http_status=draw(st.none() | st.integers(100, 599)),
        error=draw(st.none() | TEXT), error_body=draw(st.none() | TEXT), reasoning=draw(TEXT), content=draw(TEXT),
        tool_calls=draw(st.lists(st.fixed_dictionaries({"name": TEXT, "arguments": TEXT}), max_size=2)),
        findings=findings, valid=not failed, failed_layers=failed, primary_layer=failed[0] if failed else None,
        control_pair=draw(st.none() | st.integers(0, 3)), control_role=draw(st.none() | st.sampled_from(
            ["cold", "warm"])), stream=draw(st.booleans()))


def _write_run(run: Path, records: list[Attempt]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.json").write_text(json.dumps({"run_id": "r", "model": "m", "started_ts": 1.7e9}))
    stages = sorted({a.stage for a in records}) or ["load"]
    events = [{"ts": 1.7e9 + i, "event": "stage_start", "stage": name, "kind": "load", "users": 1}
              for i, name in enumerate(stages)]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    log = JsonlLog(run / RECORDS)
    for attempt in records:
        log.append_line(attempt.to_json())
    log.close()


def _same(a: Any, b: Any) -> bool:
    """Equal, a float NaN aside (none is drawn) and -0.0 as 0.0."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@given(st.lists(attempts(), max_size=8))
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_every_record_written_reads_back_identically(tmp_path_factory: pytest.TempPathFactory,
                                                      records: list[Attempt]) -> None:
    run = tmp_path_factory.mktemp("records")
    _write_run(run, records)
    back = read_records(run / RECORDS)
    assert len(back) == len(records)
    for written, read in zip(records, back, strict=True):
        want, got = json.loads(written.to_json()), json.loads(read.to_json())
        assert want.keys() == got.keys() and all(_same(want[k], got[k]) for k in want)


@given(st.lists(attempts(), max_size=12))
@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_any_written_records_are_judged_to_a_verdict(tmp_path_factory: pytest.TempPathFactory,
                                                      records: list[Attempt]) -> None:
    from k3load.analysis.analyze import NothingJudged, analyze

    run = tmp_path_factory.mktemp("judged")
    _write_run(run, records)
    try:
        judgment = analyze(run)
    except NothingJudged:  # issue 38: no record and no compat.json, every pillar not_run: no verdict at all
        assert not records and not (run / "verdict.json").exists()
        return
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["verdict"] == judgment.verdict in ("go", "limited", "rebuild", "scale_up")
    assert all(isinstance(reason, str) and reason for reason in verdict["next_action"]["because"])
