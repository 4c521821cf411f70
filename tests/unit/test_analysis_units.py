"""The judgment's parts on hand-made data (no sockets): counter windows with restarts, sustained
queues, the ramp's knee, the verdict's order, cache reasons, the manifest and the HTML renderer."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml

from k3load.analysis.analyze import NothingJudged, analyze
from k3load.analysis.decision.checklist import _families, build_checklist
from k3load.analysis.decision.ramp import ramp_of
from k3load.analysis.outputs.manifest import verify
from k3load.analysis.outputs.markdown_html import markdown_to_html
from k3load.analysis.pillars.headroom.pillar_resources import classify_crashes, judge_resources
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.limit_rules import RuleId
from k3load.analysis.pillars.pillar import PillarResult, thresholds
from k3load.analysis.pillars.rules import breach
from k3load.analysis.run.input_size import input_tokens, live_frame, tokens_per_byte
from k3load.analysis.run.record_columns import RecordColumns
from k3load.analysis.run.rundata import RunData, StageWindow
from k3load.analysis.run.timeline import MetricIndex
from k3load.analysis.verdict import verdict_of
from k3load.events import Event
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS, Signal
from k3load.workload.plan import parse_plan

KEY = 'vllm:prefix_cache_hits_total{engine="0",model_name="m"}'
WAIT = 'vllm:num_requests_waiting{engine="0",model_name="m"}'
RUN = 'vllm:num_requests_running{engine="0",model_name="m"}'


def _line(ts: float, **samples: float) -> dict:
    return {"ts": ts, "ok": True, "vllm_series": len(samples), "samples": samples}


def test_counter_delta_over_a_window_survives_a_restart():
    index = MetricIndex([_line(0, **{KEY: 100}), _line(1, **{KEY: 150}), _line(2, **{KEY: 20}),
                         _line(3, **{KEY: 50}), {"ts": 4, "ok": False, "error": "refused"}])
    assert index.delta("vllm:prefix_cache_hits_total", 0.5, 3) == 50 + 20 + 30  # reset counts from zero
    assert index.delta("vllm:prefix_cache_hits_total", 10, 20) is None  # no scrape: unknown, not 0
    assert index.delta("vllm:prefix_cache_hits_total", 0, 3, {"model_name": "other"}) == 0


def test_metrics_missing_is_none_not_zero():
    index = MetricIndex([{"ts": 1, "ok": True, "vllm_series": 0, "samples": {}}])
    assert not index.present(0, 2) and index.gauge("vllm:num_requests_waiting", 0, 2) is None


def test_sustained_waiting_is_the_longest_stretch_behind_running_requests_not_a_blip():
    values = [0, 3, 0, 0, 2, 2, 2, 2, 0]
    index = MetricIndex([_line(t, **{WAIT: v, RUN: 1}) for t, v in enumerate(values)])
    assert index.sustained_queue_s(0, 10) == 4  # ts 4..8


def test_one_slow_step_read_as_waiting_with_nothing_running_is_no_queue():
    """Seen on SmolLM2 on a 2-core CPU: one request's 2,000-token prefill read as waiting 1, running 0 for
    8 s (the gauges are a step behind); later, with two users, waiting 1 behind running 1 for real."""
    rows = [_line(t, **{WAIT: 1, RUN: 0}) for t in range(9)] + \
        [_line(t, **{WAIT: 1, RUN: 1}) for t in range(9, 12)] + [_line(12, **{WAIT: 0, RUN: 1})]
    assert MetricIndex(rows).sustained_queue_s(0, 20) == 3  # ts 9..12 only
    # A source that serves waiting but not running (a trimmed exporter) is judged on waiting alone.
    waiting_only = [_line(t, **{WAIT: 1}) for t in range(9)] + [_line(9, **{WAIT: 0})]
    assert MetricIndex(waiting_only).sustained_queue_s(0, 20) == 9


def _step(users: int, problems: list[tuple[str, str]]) -> StageRow:
    return StageRow.of(stage=f"c{users}", kind="concurrency", users=users,
                       problems=tuple(breach(RuleId(rule), Signal(signal), 1, 0, "any wording")
                                      for rule, signal in problems),
                       max_prompt_tokens_ok=500, kv_usage_max=0.5)


def test_ramp_knee_and_what_ran_out_first_by_rule_id_not_wording():
    kv = [("slo.ttft_p95", "queue_latency"), ("resources.kv_usage", "resource")]
    table = [_step(2, []), _step(8, []), _step(16, kv), _step(32, [("slo.error_rate", "errors")])]
    result = ramp_of(table)
    assert result.knee_users == 8 and result.ran_out_first == "KV cache"
    assert ramp_of([_step(2, [("slo.ttft_p95", "latency")])]).knee_users is None
    assert ramp_of([_step(2, []), _step(4, [("stability.health_flap", "health_flap")])]).ran_out_first == "health check"


def _pillars(**status: str) -> dict[str, PillarResult]:
    names = ("compat", "resources", "prefix_cache", "agent_api")
    return {n: PillarResult(status.get(n, PASS), [f"{n} reason"], {"crashes": []}) for n in names}


def test_verdict_order_rebuild_first_then_scale_up_then_limited():
    kv = [("resources.kv_usage", "resource")]
    table = [_step(2, []), _step(8, kv)]
    table_ramp = ramp_of(table)
    assert verdict_of(_pillars(compat=FAIL, resources=FAIL), table, table_ramp)[0] == "rebuild"
    verdict, because, limits = verdict_of(_pillars(resources=FAIL), table, table_ramp)
    assert verdict == "limited" and limits.max_concurrency == 2 and "hold concurrency at 2" in because[0]
    all_bad = [_step(2, kv)]
    assert verdict_of(_pillars(resources=FAIL), all_bad, ramp_of(all_bad))[0] == "scale_up"
    storm = [_step(2, [("slo.error_rate", "errors"), ("slo.ttft_p95", "latency")])]
    verdict, because, _ = verdict_of(_pillars(resources=FAIL), storm, ramp_of(storm))
    assert verdict == "limited"  # errors and latency without a queue, KV or memory signal: never buy GPUs
    assert verdict_of(_pillars(prefix_cache=INCONCLUSIVE), [_step(2, [])], ramp_of([_step(2, [])]))[0] == "limited"
    assert verdict_of(_pillars(), [_step(2, [])], ramp_of([_step(2, [])]))[0] == "go"


def test_markdown_subset_renders_to_html():
    html = markdown_to_html("# T\n\n> **warn**\n\n- a `b`\n\n| x | y |\n|---|---|\n| 1 | [f](f.json) |\n")
    assert "<h1>T</h1>" in html and "<blockquote><strong>warn</strong></blockquote>" in html
    assert "<li>a <code>b</code></li>" in html and '<td><a href="f.json">f</a></td>' in html


PRECHECK_PASSED = {"status": "pass", "recipe": {"name": "local-dev"}, "rules": []}


def test_a_hand_made_directory_is_judged_and_signed(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "r", "model": "m", "started_ts": 0}))
    (run / "events.jsonl").write_text(json.dumps({"ts": 1, "event": "stage_start", "stage": "load",
                                                  "kind": "load", "users": 1}) + "\n")
    with pytest.raises(NothingJudged, match="nothing could be judged, every pillar is not_run"):
        analyze(run)  # issue 38: evidence of nothing is a harness error, never `limited`, and nothing is written
    assert not (run / "verdict.json").exists()
    (run / "compat.json").write_text(json.dumps(PRECHECK_PASSED))
    judgment = analyze(run)
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["verdict"] == judgment.verdict == "limited"
    assert verdict["pillars"]["compat"]["status"] == "pass" and verdict["pillars"]["resources"]["status"] == "not_run"
    assert verdict["pillars"]["agent_api"]["reasons"] == ["no request was recorded"]
    assert verify(run) == []
    (run / "extra.txt").write_text("unsigned")
    assert verify(run) == ["not covered by the manifest: extra.txt"]


def test_unreadable_evidence_is_said_with_the_verdict(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.yaml").write_text("stages: [oops\n")
    events = [{"ts": 1, "event": "stage_start", "stage": "load", "kind": "load", "users": 1},
              {"ts": 9, "event": "worker_spools", "workers": 2, "final": 1,
               "not_final": ["worker w2 (spool w2.jsonl)"]}]
    (run / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    (run / "metrics.jsonl").write_text('{"ts": 1, "ok": false, "error": "x"}\n{torn\n{"ts": 2, "ok": false}\n')
    (run / "compat.json").write_text(json.dumps(PRECHECK_PASSED))  # one pillar judged (issue 38)
    analyze(run)
    verdict = json.loads((run / "verdict.json").read_text())
    note = verdict["next_action"]["because"][-1]
    assert note.startswith("evidence incomplete, judged on what was readable: plan.yaml: "), note
    assert "metrics.jsonl:2: unreadable line skipped" in note
    assert "worker w2 (spool w2.jsonl) did not report its users stopped" in note


def _attempt_row(scenario: str, turn: int, status: str, send: float, end: float, prompt: int | None,
                 size: int | None, http_status: int | None = None, error: str | None = None) -> dict:
    return {"scenario": scenario, "turn": turn, "status": status, "send_ts": send, "end_ts": end, "error": error,
            "prompt_tokens": prompt, "request_bytes": size, "http_status": http_status, "max_tokens": 64}


def test_input_tokens_are_the_servers_count_or_an_estimate_marked_as_one():
    rows = [_attempt_row("a", 0, "ok", 0, 1, 1000, 4000), _attempt_row("a", 0, "ok", 0, 1, 1100, 4400),
            _attempt_row("b", 1, "ok", 0, 1, 300, 600),
            _attempt_row("a", 0, "truncated", 0, 1, None, 8000),  # same turn: its own ratio
            _attempt_row("c", 2, "truncated", 0, 1, None, 1000),  # never finished: run median
            _attempt_row("a", 0, "truncated", 0, 1, None, None)]  # an old record: unknown

    def sizes_of(rows: list[dict]) -> pd.DataFrame:
        everything = RecordColumns.of(rows).rows()
        return input_tokens(live_frame(everything), tokens_per_byte(everything))

    sizes = sizes_of(rows)
    assert sizes["input_tokens"].tolist()[:5] == [1000, 1100, 300, 2000, 250]
    assert pd.isna(sizes["input_tokens"].iloc[5])
    assert sizes["input_tokens_estimated"].tolist() == [False, False, False, True, True, False]
    assert sizes_of([r | {"prompt_tokens": None} for r in rows])["input_tokens"].isna().all()  # nothing to learn


def test_a_crash_names_the_requests_it_cut_not_those_that_had_finished():
    rows = [_attempt_row("a", 0, "ok", 0, 9.5, 1000, 4000),  # finished well before the crash
            _attempt_row("a", 0, "truncated", 8, 9.8, None, 8000),  # cut; seen at 10
            _attempt_row("a", 0, "transport_error", 9, 12, None, 4400),  # still running at 10
            _attempt_row("a", 0, "http_error", 5, 6, None, 4000, 400),  # refused earlier
            _attempt_row("a", 0, "transport_error", 9.9, 9.9, None, 9000,  # after the kill
                         error="ConnectionRefusedError: [Errno 111] Connection refused"),
            _attempt_row("a", 0, "ok", 11, 12, 1000, 4000)]  # sent after it
    data = RunData(path=Path("."), columns=RecordColumns.of(r | {"attempt_id": str(i)} for i, r in enumerate(rows)),
                   events=[{"event": "server_down", "ts": 10.0, "reason": "connection refused"}])
    (crash,) = classify_crashes(data)
    assert crash["conditions"] == {"requests_in_flight": 2, "max_prompt_tokens": 2000,
                                   "max_prompt_tokens_estimated": True, "prompt_tokens_unknown": 0,
                                   "max_max_tokens": 64}
    result, _ = judge_resources(data, MetricIndex([]), {})
    assert "2 requests in flight, largest prompt ~2000 tokens (estimated from the bytes sent)" in result.reasons[0]


def test_a_run_cut_short_says_the_plan_did_not_finish_and_is_never_go(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.yaml").write_text(yaml.safe_dump({"name": "p", "stages": [
        {"name": "load", "kind": "load", "duration_s": 5, "users": 1, "mix": {"agent": 1}},
        {"name": "soak", "kind": "soak", "duration_s": 5, "users": 1, "mix": {"agent": 1}}]}))
    (run / "events.jsonl").write_text(json.dumps({"ts": 1, "event": "stage_start", "stage": "load", "kind": "load",
                                                  "users": 1}) + "\n")  # killed -9 during load: no run_end
    (run / "compat.json").write_text(json.dumps(PRECHECK_PASSED))  # one pillar judged (issue 38)
    judgment = analyze(run)
    assert judgment.verdict != "go"
    assert "the plan did not finish, the run was cut short (no run_end in events.jsonl): stages soak not run" \
        in judgment.because
    pillars = _pillars()
    assert verdict_of(pillars, [_step(2, [])], ramp_of([_step(2, [])]), "the plan did not finish, x")[0] == "limited"


def test_requests_refused_while_the_server_was_down_are_the_crashs_not_load_errors():
    rows = [_attempt_row("a", 0, "ok", t, t + 0.5, 100, 400) for t in range(0, 10)]
    rows += [_attempt_row("a", 0, "truncated", 9.8, 10.1, None, 400)]  # cut by the crash
    rows += [_attempt_row("a", 0, "transport_error", t + 0.5, t + 0.6, None, 400,
                          error="ConnectionRefusedError: [Errno 111] Connection refused") for t in range(10, 30)]
    rows += [_attempt_row("a", 0, "ok", t, t + 0.5, 100, 400) for t in range(30, 60)]
    rows = [r | {"attempt_id": str(i), "stage": "restart", "drill": False, "completion_tokens": 10,
                 "primary_layer": None if r["status"] == "ok" else "gateway"} for i, r in enumerate(rows)]
    data = RunData(path=Path("."), columns=RecordColumns.of(rows),
                   stages=[StageWindow("restart", "restart", 0, 60, 4)],
                   events=[{"event": "server_down", "ts": 10.2, "reason": "connection refused"},
                           {"event": "server_up", "ts": 30.0}])
    result, table = judge_resources(data, MetricIndex([]), thresholds(None))
    (stage,) = table
    assert stage.sent_while_down == 20 and stage.errors == 1
    assert [p.id for p in stage.problems] == ["stability.server_down"]  # 1 cut of 41: no error breach
    assert "(20 sent while it was down, not counted as load errors); no restart command of ours ran: something " \
        "else restarted it" in result.reasons[0]
    verdict, because, _ = verdict_of(_pillars(resources=FAIL), table, ramp_of(table))
    assert verdict == "limited" and not any("without a resource signal" in b for b in because)


def _monitoring_item(events: list[dict]) -> dict:
    data = RunData(path=Path("."), metrics=[_line(float(t), **{WAIT: 0}) | {"source": "a"} for t in range(4)],
                   events=events)
    return next(i for i in build_checklist(data, _pillars()) if i["item"].startswith("Server metrics"))


def test_monitoring_is_refused_only_while_the_engines_series_are_still_missing():
    """A restarted engine serves /metrics without its gauges for a moment: that spell ended, and
    monitoring works; a source whose gauges never came back (one of two here) is still refused."""
    def missing(ts: float, source: str, reason: str) -> dict:
        return {"event": "metrics_missing", "ts": ts, "source": source, "reason": reason}

    def back(ts: float, source: str) -> dict:
        return {"event": "metrics_back", "ts": ts, "source": source}

    assert _monitoring_item([])["ok"] and "absent" not in _monitoring_item([])["detail"]
    spell = _monitoring_item([missing(1.0, "a", "no vllm: series"), back(2.0, "a")])
    assert spell["ok"] and "absent 1 time(s) and came back (last: no vllm: series)" in spell["detail"]
    assert "events.jsonl" in spell["evidence"]
    for events in ([missing(1.0, "a", "gauges gone")],
                   [missing(1.0, "a", "x"), back(2.0, "a"), missing(3.0, "a", "gauges gone")],
                   [missing(1.0, "a", "x"), missing(1.5, "b", "gauges gone"), back(2.0, "a")]):
        item = _monitoring_item(events)
        assert not item["ok"] and "monitoring is not possible as deployed: gauges gone" in item["detail"], events


def test_the_restart_check_says_whether_our_restart_command_ran():
    rows = [_attempt_row("a", 0, "ok", t, t + 0.5, 100, 400) | {"attempt_id": str(t)} for t in (1, 2, 40)]
    down = {"event": "server_down", "ts": 10.0, "reason": "connection refused"}
    command = {"event": Event.RESTART_COMMAND, "ts": 10.5, "attempt": 1, "pid": 7, "log": "restart-1.log"}
    earlier = {"event": Event.RESTART_COMMAND, "ts": 5.0, "attempt": 1, "pid": 6, "log": "restart-0.log"}

    def restart(*events: dict) -> dict:
        up = any(e["event"] == "server_up" for e in events)  # served after it only where it came back
        records = RecordColumns.of(rows if up else rows[:2])
        (crash,) = classify_crashes(RunData(path=Path("."), columns=records, events=[down, *events]))
        return crash["restart"]

    came_back = restart(command, {"event": "server_up", "ts": 30.0})
    assert came_back["recovered"] and came_back["command_run"] == {"attempt": 1, "log": "restart-1.log"}
    assert came_back["detail"].endswith("; restart command 1 ran (log restart-1.log)")
    never = restart(command)
    assert not never["recovered"] and never["detail"] == (
        "the server did not come back within the run; restart command 1 ran (log restart-1.log) without "
        "bringing it back")
    alone = restart(earlier)  # a command before this crash is not this crash's restart
    assert alone["command_run"] is None and "no restart command ran (--k3-restart-cmd not given" in alone["detail"]


def test_a_planned_family_that_never_ran_keeps_the_checklist_open_and_the_run_from_go(tmp_path: Path) -> None:
    """Issue 38: a family the plan mixed in that sent nothing (a worker lost, a scenario file missing where it
    started) leaves an open line, named, and so never `go`."""
    agent = _attempt_row("a", 0, "ok", 0, 1, 100, 400) | {"family": "agent"}
    data = RunData(path=tmp_path, columns=RecordColumns.of([agent]))
    data.plan = parse_plan({"name": "p", "stages": [{"name": "soak", "kind": "soak", "duration_s": 5, "users": 2,
                                                     "mix": {"agent": 1, "cold": 1}}]}, "plan")
    line = _families(data)
    assert line["status"] == "open" and line["detail"] == "family cold (planned in soak) never ran: no attempt recorded"
    assert verdict_of(_pillars(), [_step(2, [])], ramp_of([_step(2, [])]), checklist=[line])[0] == "limited"
    data.columns = RecordColumns.of([agent, agent | {"family": "cold"}])
    assert _families(data)["status"] == "ok"


def test_a_worker_lost_mid_run_is_counted_said_and_keeps_the_run_from_go(tmp_path: Path) -> None:
    """Issue 38: the master's worker count falling is a `worker_lost` event (k3load.loadgen.worker_count), and
    the checklist's line names it; with every worker to the end the line says the count per stage."""
    from locust.runners import STATE_MISSING, STATE_RUNNING, MasterRunner, WorkerNodes

    from k3load.analysis.decision.checklist import _workers
    from k3load.loadgen.worker_count import WorkerCount
    from k3load.rundir import JsonlLog

    class Master(MasterRunner):  # the count is Locust's own property over its worker nodes; no sockets here
        def __init__(self) -> None:
            self.clients = WorkerNodes()

        def __del__(self) -> None:
            pass

    runner = Master()
    for n in range(2):
        runner.clients[f"w{n}"] = SimpleNamespace(id=f"w{n}", state=STATE_RUNNING)
    events = JsonlLog(tmp_path / "events.jsonl")
    count = WorkerCount()
    count.check(runner, events, "load")
    runner.clients["w1"].state = STATE_MISSING
    count.check(runner, events, "soak")
    count.check(runner, events, "soak")  # said once
    assert count.now(object()) is None  # a local or worker runner: no count
    events.close()
    written = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["workers_before"], e["workers_now"]) for e in written] == [("worker_lost", 2, 1)]
    data = RunData(path=tmp_path, events=written)
    line = _workers(data)
    assert line["status"] == "open" and "in stage soak: 1 of 2 workers left" in line["detail"]
    data.events = [{"event": "stage_start", "ts": 1.0, "stage": "load", "workers": 2}]
    assert _workers(data)["status"] == "ok" and _workers(data)["detail"] == "workers per stage: 2"
