"""The go-live hand-over: `alerts.yaml` and `dashboard.json` of judged run directories, checked by the real
tools. Debian's `promtool` checks and unit-tests the rules (the alerts fire just above the accepted limits,
not at them); a real Debian `prometheus` on loopback scrapes vLLM 0.32's own /metrics capture plus
dcgm-exporter text and answers every dashboard and alert query (a query that does not parse is a 400);
the dashboard's thresholds are the run's verdict limits and the plan's SLOs.

Run directories are hand-made (no Locust run): the limits come from `analyze()` judging them, exactly as
after a real run. `held`: every step within limits; `limited`: the top step ran out of KV; `unloaded`: no
step held and the KV cache stayed empty; `bare`: stage events only (nothing measured). `go` is `held`
with its verdict set to go: the rules read the limits, the verdict only names itself in the header (the
whole go pipeline, Locust and sim, is test_verdicts' healthy run, which writes the same files). The runs are
written by tests/sim/handover_runs.py; all the tests here share one module-scoped set of judged runs and one
real Prometheus.

Outside CI a missing binary skips (with the reason); under CI=true it fails, as test_prometheus does."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3load.analysis.analyze import analyze, judge
from k3load.analysis.outputs import alerts, dashboard
from k3load.analysis.outputs.manifest import verify
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS, thresholds
from tests.probes import WIRE
from tests.sim.handover_runs import CARD_MIB, RESERVED_MIB, RUNS, THRESHOLDS, _tool, _write_run
from tests.unit.test_sampler_units import DCGM_BODY


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each hand-made run judged by `analyze()`; `go` is `held` rendered with a go verdict."""
    root = tmp_path_factory.mktemp("handover")
    out = {}
    for name, (stages, kv, prompts) in RUNS.items():
        _write_run(root / name, stages, kv, prompts)
        analyze(root / name)
        out[name] = root / name
    bare = root / "bare"
    bare.mkdir()
    (bare / "run.json").write_text(json.dumps({"run_id": "bare", "model": "tiny", "started_ts": 0}))
    (bare / "events.jsonl").write_text(json.dumps({"ts": 1, "event": "stage_start", "stage": "load", "kind": "load",
                                                   "users": 1}) + "\n")
    (bare / "compat.json").write_text(json.dumps({"status": "pass", "recipe": {"name": "local-dev"}, "rules": []}))
    analyze(bare)  # the precheck passed (every pillar not_run would be a harness error, issue 38)
    out["bare"] = bare
    go = root / "go"
    shutil.copytree(out["held"], go)
    judgment = dataclasses.replace(judge(go), verdict="go")
    (go / "alerts.yaml").write_text(alerts.render(judgment))
    (go / "dashboard.json").write_text(dashboard.render(judgment))
    out["go"] = go
    return out


def _verdict(run: Path) -> dict[str, Any]:
    return json.loads((run / "verdict.json").read_text())


def _rules(run: Path) -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((run / "alerts.yaml").read_text())
    return {r["alert"]: r for r in doc["groups"][0]["rules"]}


def _threshold(expr: str) -> float:
    return float(re.search(r"> ([0-9.e+-]+)$", expr).group(1))


def test_the_runs_are_what_the_cases_say(runs):
    """Guards the fixtures: the judgment gave each hand-made run the verdict and limits its case needs."""
    verdicts = {name: _verdict(run) for name, run in runs.items() if name != "go"}
    assert {n: v["verdict"] for n, v in verdicts.items()} == {"held": "limited", "limited": "limited",
                                                               "unloaded": "scale_up", "bare": "limited"}
    assert verdicts["held"]["limits"] | {"max_model_len": None} == {
        "max_concurrency": 4, "max_input_tokens": 1800, "kv_cache_usage_ceiling": 0.4231, "ran_out_first": None,
        "max_model_len": None}
    assert verdicts["limited"]["limits"]["max_concurrency"] == 4
    assert verdicts["limited"]["limits"]["ran_out_first"] == "KV cache"
    assert verdicts["limited"]["limits"]["kv_cache_usage_ceiling"] == 0.5512
    assert verdicts["unloaded"]["limits"]["kv_cache_usage_ceiling"] == 0.0
    assert verdicts["unloaded"]["limits"]["max_concurrency"] is None
    assert all(v is None for k, v in verdicts["bare"]["limits"].items() if k != "max_concurrency")


def test_alert_files_pass_promtool_and_the_kv_alert_is_the_measured_ceiling(runs):
    promtool = _tool("promtool")
    files = [str(runs[name] / "alerts.yaml") for name in sorted(runs)]
    check = subprocess.run([promtool, "check", "rules", *files], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("SUCCESS") == len(files), check.stdout
    for name in ("held", "limited", "go"):
        rules = _rules(runs[name])
        ceiling = _verdict(runs[name])["limits"]["kv_cache_usage_ceiling"]
        assert _threshold(rules["K3KVCachePressure"]["expr"]) == ceiling, name
        assert _threshold(rules["K3ConcurrencyAboveAccepted"]["expr"]) == 4
        assert "measured ceiling" in rules["K3KVCachePressure"]["annotations"]["summary"]
    assert (runs["go"] / "alerts.yaml").read_text().startswith("# Generated by k3load from run held (verdict go).")


def test_limits_the_run_did_not_establish_are_omitted_with_the_reason(runs):
    held, limited = (runs[n] / "alerts.yaml" for n in ("held", "limited"))
    assert 'le=~"2000|2000[.]0"' in _rules(runs["held"])["K3InputAboveAccepted"]["expr"]
    assert "prompts of 1801-2000 tokens pass unseen" in held.read_text()
    assert "K3InputAboveAccepted" not in _rules(runs["limited"])
    assert ("# K3InputAboveAccepted omitted: the server's largest finite prompt-length bucket (2000 tokens) is "
            "below the accepted 2400 tokens") in limited.read_text()
    default = DEFAULT_THRESHOLDS["resources"]["max_kv_usage"]  # bare has no plan
    for name, why, plan_max in (
            ("unloaded", "KV usage stayed at 0% in every stage within limits: the run never loaded", 0.95),
            ("bare", "no stage within limits read vllm:kv_cache_usage_perc", default)):
        text, rules = (runs[name] / "alerts.yaml").read_text(), _rules(runs[name])
        assert _threshold(rules["K3KVCachePressure"]["expr"]) == plan_max, name
        assert f"# K3KVCachePressure: no measured ceiling ({why}" in text, text
        summary = rules["K3KVCachePressure"]["annotations"]["summary"]
        assert f"the plan's max_kv_usage ({plan_max:.0%}) instead" in summary
        assert not {"K3ConcurrencyAboveAccepted", "K3InputAboveAccepted"} & set(rules), name
        assert "# K3InputAboveAccepted omitted: no input length was measured within limits" in text
    assert "# K3ConcurrencyAboveAccepted omitted: no concurrency step held within limits" in \
        (runs["unloaded"] / "alerts.yaml").read_text()
    assert "# K3ConcurrencyAboveAccepted omitted: no stage held within limits" in \
        (runs["bare"] / "alerts.yaml").read_text()


def _alert_case(rules: dict[str, dict[str, Any]], name: str, at: str, labels: dict[str, str] | None) -> dict:
    """A promtool alert_rule_test: `labels` None means the alert must not be firing at `at`."""
    rule = rules[name]
    fired = [] if labels is None else [{"exp_labels": labels | rule["labels"], "exp_annotations": rule["annotations"]}]
    return {"eval_time": at, "alertname": name, "exp_alerts": fired}


def test_alerts_fire_just_above_the_accepted_limits_and_not_at_them(runs, tmp_path):
    """promtool's rule unit tests on held's rules: a minute is one sample; KV at the ceiling for 10 minutes
    then 0.0001 above; 4 requests (the accepted concurrency) then 5; prompts within the 2000-token bucket
    then over it, once as vLLM spells `le` and once as Prometheus 3 normalises it."""
    promtool = _tool("promtool")
    shutil.copy(runs["held"] / "alerts.yaml", tmp_path / "alerts.yaml")
    rules, engine = _rules(runs["held"]), 'engine="0",model_name="tiny"'
    ceiling = _verdict(runs["held"])["limits"]["kv_cache_usage_ceiling"]
    tiny = {"model_name": "tiny"}
    groups = [{"interval": "1m", "input_series": [
        {"series": f"vllm:kv_cache_usage_perc{{{engine}}}", "values": f"{ceiling}x10 {ceiling + 0.0001}x10"},
        {"series": f"vllm:num_requests_running{{{engine}}}", "values": "4x20"},
        {"series": f"vllm:num_requests_waiting{{{engine}}}", "values": "0x10 1x10"},
        {"series": f"vllm:request_prompt_tokens_count{{{engine}}}", "values": "0+1x20"},
        {"series": f'vllm:request_prompt_tokens_bucket{{{engine},le="{le}"}}', "values": "0+1x10 10x10"}],
        "alert_rule_test": [_alert_case(rules, "K3KVCachePressure", "10m", None),
                            _alert_case(rules, "K3KVCachePressure", "17m", {}),
                            _alert_case(rules, "K3ConcurrencyAboveAccepted", "10m", None),
                            _alert_case(rules, "K3ConcurrencyAboveAccepted", "17m", tiny),
                            _alert_case(rules, "K3InputAboveAccepted", "10m", None),
                            _alert_case(rules, "K3InputAboveAccepted", "13m", tiny)]} for le in ("2000.0", "2000")]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["alerts.yaml"], "evaluation_interval": "1m",
                                                        "tests": groups}))
    run = subprocess.run([promtool, "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def _panels(run: Path) -> list[dict[str, Any]]:
    return json.loads((run / "dashboard.json").read_text())["panels"]


def _lines(panel: dict[str, Any]) -> list[float]:
    return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"][1:]]


def test_dashboard_is_grafana_json_with_the_runs_limits_as_thresholds(runs):
    for name, run in runs.items():
        board = json.loads((run / "dashboard.json").read_text())
        assert board["schemaVersion"] == 39 and board["uid"].startswith("k3load-") and len(board["uid"]) <= 40
        assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "model_name", "instance", "gpu_host"]
        panels = {p["title"]: p for p in board["panels"]}
        for panel in board["panels"][1:]:
            assert panel["type"] == "timeseries" and panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        limits = _verdict(run)["limits"] if name != "go" else _verdict(runs["held"])["limits"]
        plan = thresholds(THRESHOLDS if (run / "plan.yaml").exists() else None)  # bare has no plan: defaults
        res, slo = plan["resources"], plan["slo"]
        kv = limits["kv_cache_usage_ceiling"] or res["max_kv_usage"]
        assert _lines(panels["KV cache usage"]) == sorted({kv, res["max_kv_usage"]}), name
        concurrency = limits["max_concurrency"]
        assert _lines(panels["Requests running and waiting"]) == ([concurrency] if concurrency else []), name
        tokens = limits["max_input_tokens"]
        assert _lines(panels["Prompt length"]) == ([tokens] if tokens else []), name
        for title, key in (("Time to first token", "ttft_p95_ms"), ("Inter-token latency", "itl_p95_ms"),
                           ("End-to-end latency", "e2e_p95_ms")):
            assert _lines(panels[title]) == [slo[key] / 1000], (name, title)
        assert _lines(panels["Preemptions per minute"]) == [res["max_preemptions_per_min"]]
        floor = [] if name == "bare" else [(CARD_MIB - RESERVED_MIB) * (1 - res["max_gpu_growth_pct"] / 100)]
        assert _lines(panels["GPU memory free"]) == floor, name  # the reservation's free memory, less the growth
        assert f"the accepted slo.ttfa_p95_ms is {slo['ttfa_p95_ms']:,.0f} ms" in \
            panels["Time to first token"]["description"]  # TTFA: said, as vLLM has no series for it
        assert "# No TTFA alert: time to the first answer token after the reasoning (TTFA) has no vLLM series" in \
            (run / "alerts.yaml").read_text()
        assert "vLLM exports no tool-call schema-failure metric" in \
            panels["Tool-call parser: outputs with no tool call"]["description"]
    assert "No accepted concurrency drawn: no concurrency step held within limits" in \
        {p["title"]: p for p in _panels(runs["unloaded"])}["Requests running and waiting"]["description"]


def test_gpu_alerts_never_page_on_a_reserved_node_and_page_on_growth_and_creep(runs, tmp_path):
    """vLLM's reservation (95.5% used from start to end) is the baseline: a day of it never fires either GPU alert;
    free memory under the run's floor (the reservation's free less max_gpu_growth_pct) fires K3GPUMemoryGrowth;
    a steady fall that would empty the card within min_gpu_runway_h fires K3GPUMemoryCreep after two hours of it;
    a restart (an empty card, then the reservation again) fires neither."""
    promtool = _tool("promtool")
    shutil.copy(runs["held"] / "alerts.yaml", tmp_path / "alerts.yaml")
    rules, free = _rules(runs["held"]), CARD_MIB - RESERVED_MIB
    floor = float(re.search(r"< ([0-9.]+)$", rules["K3GPUMemoryGrowth"]["expr"]).group(1))
    assert floor == round(free * (1 - DEFAULT_THRESHOLDS["resources"]["max_gpu_growth_pct"] / 100))
    assert "K3GPUMemoryHeadroom" not in rules  # the card's share is no alarm on a node vLLM reserved
    series = 'DCGM_FI_DEV_FB_FREE{Hostname="gpu-node-1",gpu="0"}'
    cases = {  # free memory, one sample a minute
        "reserved": (f"{free}x1440", [("K3GPUMemoryGrowth", "1440m", None), ("K3GPUMemoryCreep", "1440m", None)]),
        "grown": (f"{free}x30 {floor - 1}x30", [("K3GPUMemoryGrowth", "30m", None),
                                               ("K3GPUMemoryGrowth", "40m", {})]),
        "creeping": (f"{free}-10x300", [("K3GPUMemoryCreep", "100m", None), ("K3GPUMemoryCreep", "200m", {})]),
        "restarted": (f"{free}x60 {CARD_MIB}x5 {free}x300", [("K3GPUMemoryCreep", "300m", None),
                                                            ("K3GPUMemoryGrowth", "300m", None)]),
    }
    groups = [{"interval": "1m", "input_series": [{"series": series, "values": values}],
               "alert_rule_test": [_alert_case(rules, name, at, labels) for name, at, labels in checks]}
              for values, checks in cases.values()]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["alerts.yaml"], "evaluation_interval": "1m",
                                                        "tests": groups}))
    run = subprocess.run([promtool, "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr
    summary = rules["K3GPUMemoryGrowth"]["annotations"]["summary"]
    assert f"{free:,.0f} MiB, vLLM's reservation included" in summary, summary


def test_outputs_are_stable_bytes_and_signed(runs, tmp_path):
    again = tmp_path / "again"
    shutil.copytree(runs["limited"], again)
    analyze(again)
    for name in ("alerts.yaml", "dashboard.json", "verdict.json"):
        assert (again / name).read_bytes() == (runs["limited"] / name).read_bytes(), name
    assert verify(runs["limited"]) == []
    assert "dashboard.json" in (runs["limited"] / "manifest.sha256").read_text()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        body = error.read()
        try:
            return error.code, json.loads(body or b"{}")
        except ValueError:  # a Prometheus still starting answers 503 "Service Unavailable" in plain text
            return error.code, {"error": body.decode(errors="replace")}
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A real Prometheus scraping, every second, a loopback file server that serves vLLM 0.32's captured
    /metrics and dcgm-exporter text as one body; (its base URL, the target's instance) once two scrapes
    are in (rate() needs two)."""
    binary = _tool("prometheus")
    folder = tmp_path_factory.mktemp("handover-prometheus")
    (folder / "www").mkdir()
    (folder / "www" / "metrics").write_text((WIRE / "metrics_end.txt").read_text() + DCGM_BODY)
    target, url = _free_port(), f"http://127.0.0.1:{_free_port()}"
    (folder / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n"
        f"  - job_name: vllm\n    static_configs: [{{targets: ['127.0.0.1:{target}']}}]\n")
    log = (folder / "log").open("wb")
    procs = [subprocess.Popen([sys.executable, "-m", "http.server", str(target), "--bind", "127.0.0.1", "--directory",
                               str(folder / "www")], stdout=log, stderr=subprocess.STDOUT),
             subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder}/db",
                               f"--web.listen-address={url.removeprefix('http://')}"], stdout=log,
                              stderr=subprocess.STDOUT)]
    try:
        deadline = time.monotonic() + 60
        query = url + "/api/v1/query?query=" + urllib.parse.quote("count_over_time(up[1m]) >= 2 and up == 1")
        while not (_get(query)[1].get("data") or {}).get("result"):
            assert time.monotonic() < deadline, (folder / "log").read_text()[-3000:]
            time.sleep(0.25)
        yield url, f"127.0.0.1:{target}"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        log.close()


def _as_promql(expr: str, instance: str) -> str:
    """Grafana's substitution with the values a user would pick (never `.*`, which matches a misspelt label
    too): the served model, the scraped instance, dcgm-exporter's Hostname."""
    picked = {"$__rate_interval": "1m", "$model_name": "tiny", "$instance": instance, "$gpu_host": "gpu-node-1"}
    for name, value in picked.items():
        expr = expr.replace(name, value)
    return expr


def test_every_query_parses_and_reads_real_series_on_a_real_prometheus(runs, prometheus, tmp_path):
    """Each dashboard query answers series from vLLM's and dcgm-exporter's own text (so names and labels are
    the real ones), each variable's label exists, each alert expression parses; promtool checks the same
    dashboard queries as recording rules. A query that does not parse is refused (400): the check bites."""
    url, instance = prometheus
    query = url + "/api/v1/query?query="
    assert _get(query + urllib.parse.quote("sum(rate(vllm:num_requests_running[1m]"))[0] == 400
    board = json.loads((runs["held"] / "dashboard.json").read_text())
    exprs = sorted({_as_promql(t["expr"], instance) for p in board["panels"] for t in p.get("targets", [])})
    for expr in exprs:
        status, body = _get(query + urllib.parse.quote(expr))
        assert status == 200 and body["status"] == "success" and body["data"]["result"], (expr, body)
    for variable in board["templating"]["list"][1:]:
        selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"]).groups()
        status, body = _get(query + urllib.parse.quote(f"count by ({label}) ({_as_promql(selector, instance)})"))
        assert status == 200 and [r["metric"].get(label) for r in body["data"]["result"]] != [None], variable
    for rule in _rules(runs["held"]).values():
        status, body = _get(query + urllib.parse.quote(rule["expr"]))
        assert status == 200 and body["status"] == "success", (rule["alert"], body)
    recorded = {"groups": [{"name": "dashboard", "rules": [{"record": f"k3load:panel_{i}", "expr": e}
                                                           for i, e in enumerate(exprs)]}]}
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump(recorded))
    check = subprocess.run([_tool("promtool"), "check", "rules", str(tmp_path / "panels.yaml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in check.stdout, check.stdout + check.stderr
