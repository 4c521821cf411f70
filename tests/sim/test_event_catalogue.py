"""The catalogue of the run's seams (k3load/events.py) against the code and against real runs.

Every event and message is described; no writer or reader spells a name where it could name a member; a
name outside the catalogue is refused where it is written; and every events.jsonl line carries only the
fields its entry declares: the stored scale run's, the sampler's own when each of its parts is driven
through every event it writes, and a fresh Locust run's (tests/sim/test_locust_run.py calls `undeclared`).
"""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from k3load.events import FIELDS, MESSAGE_FIELDS, Event, Message
from k3load.rundir import JsonlLog
from k3load.sampler import Sampler
from k3load.sampler.fetch import Fetched
from k3load.sampler.gpu_poll import DcgmPoller, NvmlPoller
from k3load.sampler.health import HealthWatch
from k3load.sampler.logtail import LogTail
from k3load.sampler.promapi import PrometheusReader
from k3load.sampler.scrape import MetricsWatch
from tests.fake_nvml import FakeNvml

ROOT = Path(__file__).resolve().parents[2]
STORED_RUN = ROOT / "tests" / "data" / "scale-run" / "events.jsonl"
CODE = ("k3load", "analysis", "locustfiles")
# Calls whose first argument is an event or message name: JsonlLog.event, the sampler's sinks, Locust's messages
# (and the worker's own `_send`), the analysis's lookup.
NAME_FIRST = {"event", "_event", "_emit", "send_message", "register_message", "_send", "events_named"}
# Strings that spell a catalogue name but name something else: a CLI command, compat.json and verdict keys.
ELSEWHERE = {("k3load/cli.py", "precheck"), ("k3load/precheck/evidence.py", "cache_config"),
             ("k3load/precheck/startup_rules.py", "cache_config"),
             ("analysis/pillars/cache/pillar_cache.py", "cache_config")}
LOCUST_LAYER = {Event.RUN_START, Event.STAGE_START, Event.RUN_END, Event.HARNESS_ERROR, Event.ANSWER_UNJUDGED,
                Event.TURN_FAILED, Event.LONG_INPUT_UNFIT,
                Event.PRECHECK, Event.DISK_SPACE_LOW, Event.STAGE_DRAIN, Event.WORKER_SPOOLS, Event.LOAD_GENERATOR_CPU,
                Event.WORKER_LOST,
                Event.RESTART_COMMAND, Event.RESTART_DRILL_SKIPPED, Event.RESTART_DRILL_START,
                Event.RESTART_DRILL_DOWN, Event.RESTART_DRILL_READY, Event.RESTART_DRILL_FAILED, Event.RECOVERY_HOLD,
                Event.SEARCH_STEP, Event.SEARCH_END, Event.REPLAY_END}


def undeclared(lines: Iterable[str]) -> list[str]:
    """Each events.jsonl line whose event is not in the catalogue, or that carries a field its FIELDS entry
    does not declare, said as 'line N: ...'; [] when every line is as declared."""
    problems = []
    for n, line in enumerate(lines, 1):
        record = json.loads(line)
        name = record.get("event")
        if name not in FIELDS:
            problems.append(f"line {n}: event {name!r} is not in k3load/events.py")
            continue
        extra = set(record) - {"ts", "event"} - FIELDS[Event(name)]
        if extra:
            problems.append(f"line {n}: {name} carries {sorted(extra)}, not declared in FIELDS")
    return problems


def events_file_problems(path: Path) -> list[str]:
    return undeclared(path.read_text(encoding="utf-8").splitlines())


# -- the catalogue -------------------------------------------------------------------------------------
def test_every_event_and_message_is_described_once():
    assert set(FIELDS) == set(Event) and set(MESSAGE_FIELDS) == set(Message)
    assert len(Event.__members__) == len(Event) and len(Message.__members__) == len(Message)  # no aliases
    assert all(fields and all(isinstance(f, str) for f in fields) for fields in FIELDS.values())
    assert all(not ({"ts", "event"} & fields) for fields in FIELDS.values())
    assert all(m.value.startswith("k3_") for m in Message)


def test_members_are_the_plain_strings_on_disk(tmp_path):
    log = JsonlLog(tmp_path / "events.jsonl")
    log.event(Event.RUN_END, attempts=3)
    log.close()
    record = json.loads((tmp_path / "events.jsonl").read_text())
    assert record["event"] == "run_end" and type(record["event"]) is str
    assert json.dumps(Event.SERVER_DOWN) == '"server_down"' and Message.RECORD == "k3_record"
    assert {"k3_cpu": 1}.get(Message.CPU) == 1  # a handler registered by member is found by the wire's string


def test_a_name_outside_the_catalogue_is_refused_where_it_is_written(tmp_path):
    log = JsonlLog(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="stage_begin"):
        log.event("stage_begin", stage="load")  # type: ignore[arg-type]
    log.close()
    with pytest.raises(ValueError, match="gpu_lost"):
        Sampler(tmp_path, None).event("gpu_lost", 1.0)  # type: ignore[arg-type]
    assert (tmp_path / "events.jsonl").read_text() == ""


def _python_files() -> list[Path]:
    return sorted(p for root in CODE for p in (ROOT / root).rglob("*.py") if p != ROOT / "k3load" / "events.py")


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, kinds) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def test_writers_and_readers_name_members_never_strings():
    """No `.event("name")`, `_event(f"log_{kind}")`, `send_message("k3_x")`, `events_named("x")`, and no
    string spelling a catalogue name anywhere in the code (docstrings aside) unless it names something else."""
    names = {e.value for e in Event} | {m.value for m in Message}
    spelled, called = [], []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                    and id(node) not in docs and (rel, node.value) not in ELSEWHERE):
                spelled.append(f"{rel}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if name in NAME_FIRST:
                    called.append(f"{rel}:{node.lineno} {name}({ast.unparse(node.args[0])}, ...)")
    assert called == [], "name the member of k3load.events.Event / Message"
    assert spelled == [], "name the member of k3load.events.Event / Message"


# -- real runs --------------------------------------------------------------------------------------------
def test_the_stored_runs_events_are_as_declared():
    assert STORED_RUN.exists()
    assert events_file_problems(STORED_RUN) == []


def _metrics_body(prompt_tokens: float, engine: bool = True) -> str:
    lines = ["# TYPE vllm:prompt_tokens_total counter", f'vllm:prompt_tokens_total{{model_name="m"}} {prompt_tokens}',
             "# TYPE vllm:cache_config_info gauge", 'vllm:cache_config_info{block_size="16",num_gpu_blocks="9"} 1',
             "# TYPE vllm:lora_requests_info gauge", 'vllm:lora_requests_info{max_lora="1"} 1']
    if engine:
        lines += [f"# TYPE vllm:{name} gauge\nvllm:{name}{{model_name=\"m\"}} 0"
                  for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
    return "\n".join(lines) + "\n"


DCGM_BODY = '# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",Hostname="n1"} 1000\n'
EMPTY_MATRIX = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}})
FLAGGED = ["RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", "torch.OutOfMemoryError: again",
           "NCCL WARN Call to connect returned Connection refused",
           "RuntimeError: CUDA error: an illegal memory access",
           "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue",
           "WARNING [custom_all_reduce.py:90] Custom allreduce is disabled", "INFO an ordinary line"]


def _ok(body: str) -> Fetched:
    return Fetched(True, 200, body, None, 1.0)


def _failed(error: str, status: int | None = None) -> Fetched:
    return Fetched(False, status, "", error, 1.0)


def _answers(*results: Fetched):
    queue = iter(results)
    return lambda _url: next(queue)


def _wait_for(path: Path, name: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while f'"event":"{name}"' not in path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_each_sampler_part_writes_only_declared_fields(tmp_path):
    """Every part of the sampler driven through each event it can write, into one sampler's events.jsonl."""
    sampler = Sampler(tmp_path, None).start()
    sink, clock = sampler.event, time.time
    health = HealthWatch("http://x/health", sink, "http://x/health")
    for ts, result in enumerate([_ok(""), _failed("connection refused"), _ok(""), _failed("timeout after 2 s"),
                                 _ok("")]):
        health.observe(result, float(ts))  # server_down, server_up, health_slow
    bodies = [_metrics_body(10), _metrics_body(10, engine=False), _metrics_body(5)]
    watch = MetricsWatch("http://x/metrics", _answers(*map(_ok, bodies)), JsonlLog(tmp_path / "m.jsonl"), sink,
                         no_gpu_notice=(None, "no GPU telemetry"))
    for ts in range(len(bodies)):  # cache_config, vllm_info, gpu_unavailable; metrics_missing; back, counter_reset
        watch.tick(float(ts), None)
    dcgm = DcgmPoller("http://n1:9400/metrics", _answers(_failed("connection refused"), _ok(DCGM_BODY), _ok("")),
                      sampler.gpu, sink)
    for ts in range(3):  # gpu_source_down, gpu_source_up, gpu_unavailable
        dcgm.tick(float(ts))
    NvmlPoller(FakeNvml(), sampler.gpu, sink, clock).close()  # gpu_found
    prometheus = PrometheusReader("http://prom:9090", "", 0.0, 1.0, _answers(
        _failed("connection refused"), _ok(EMPTY_MATRIX), _failed("HTTP 503", 503)), JsonlLog(tmp_path / "p.jsonl"),
        sink, settle_s=0.0, final_budget_s=0.1)
    prometheus.tick(3.0)  # prometheus_error
    prometheus.tick(4.0)  # prometheus_back
    prometheus.tick(9.0, final=True)  # prometheus_incomplete
    (tmp_path / "vllm.log").write_text("\n".join(FLAGGED) + "\n")
    tail = LogTail(tmp_path / "server.log", sink, clock, path=tmp_path / "vllm.log", max_events_per_kind=1)
    tail.start()
    tail.stop()  # log_oom .. log_warning, log_flags_suppressed (the second OOM line)
    ended = LogTail(tmp_path / "cmd.log", sink, clock, cmd=["true"])
    ended.start()
    _wait_for(tmp_path / "events.jsonl", Event.LOG_TAIL_ENDED)
    ended.stop()
    broken = LogTail(tmp_path / "dir.log", sink, clock, path=tmp_path)  # a directory: log_tail_error
    broken.start()
    _wait_for(tmp_path / "events.jsonl", Event.LOG_TAIL_ERROR)
    broken.stop()
    sampler._loop_error("metrics", RuntimeError("boom"))  # sampler_error, as a failing tick reports it
    sampler._redirected("http://x/metrics", "http://y:80", 302, "credentials_dropped")  # redirect, as _fetch says it
    sampler.stop()  # sampler_stop
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert undeclared(lines) == []
    assert {json.loads(line)["event"] for line in lines} == set(Event) - LOCUST_LAYER
