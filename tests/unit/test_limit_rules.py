"""Rules declared once (analysis/pillars/limit_rules.py, thresholds_table.py): the defaults, the plan schema's
`thresholds`, the ramp's "ran out first" and the docs' rules table all follow from the rows."""

from __future__ import annotations

from dataclasses import replace

from k3load.analysis.decision.ramp import ramp_of
from k3load.analysis.pillars import rule_docs
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.headroom.stages import stage_breaches
from k3load.analysis.pillars.limit_rules import EXHAUSTED_BY_RULE, LIMIT_RULES, RULES, RanOut, RuleId, ran_out_first
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS, thresholds
from k3load.analysis.pillars.rules import Breach
from k3load.analysis.pillars.thresholds_table import THRESHOLDS
from k3load.outcomes import Signal

REGENERATE = "regenerate with `.venv/bin/python -m k3load.analysis.pillars.rule_docs --write`"


def test_the_committed_plan_schema_is_what_the_table_renders() -> None:
    current = rule_docs.SCHEMA.read_text()
    assert rule_docs.schema_text(current) == current, f"k3load/schemas/plan.schema.json is stale: {REGENERATE}"


def test_the_committed_rules_table_in_the_docs_is_what_the_table_renders() -> None:
    current = rule_docs.DOCS.read_text()
    assert rule_docs.docs_text(current) == current, f"docs/verdict-rules.md's rules table is stale: {REGENERATE}"
    assert all(f"`{rule.id}`" in current for rule in RULES)


def test_every_rule_id_is_declared_once_and_its_ran_out_follows_the_id_order() -> None:
    ids = [rule.id for rule in RULES]
    assert sorted(ids) == sorted(RuleId) and len(set(ids)) == len(ids)
    order = list(RanOut)
    ran_out = [order.index(RanOut(name)) for _, name in EXHAUSTED_BY_RULE]
    assert ran_out == sorted(ran_out)  # a RuleId placed among another resource's would read out of turn
    assert ran_out_first({"slo.ttft_p95", "resources.preemptions", "resources.kv_usage"}) == "KV cache"
    assert ran_out_first({"no.such_rule"}) == "unknown" and type(ran_out_first({"slo.itl_p95"})) is str


def test_the_defaults_come_from_the_table_each_limit_once() -> None:
    paths = [t.path for t in THRESHOLDS]
    assert len(set(paths)) == len(paths)
    for rule in LIMIT_RULES:
        assert DEFAULT_THRESHOLDS[rule.section][rule.key] == rule.threshold.default
    assert "recovery_hold_s" not in DEFAULT_THRESHOLDS["resources"]  # no fixed default: not in the defaults
    assert thresholds({"agent": {"min_reproducible_share": 0.5}})["agent_api"]["min_reproducible_share"] == 0.5


def test_a_limit_rule_breaches_typed_and_is_plain_data_in_the_stage_row() -> None:
    stats = StageRow.of(stage="load", kind="load", ttft_p95_ms=5000.0, kv_usage_max=0.99, waiting_sustained_s=3.0)
    typed = stage_breaches(stats, thresholds(None))
    assert [(b.id, b.signal) for b in typed] == [(RuleId.SLO_TTFT_P95, Signal.QUEUE_LATENCY),
                                                 (RuleId.KV_USAGE, Signal.RESOURCE)]
    assert all(isinstance(b, Breach) for b in typed)
    rows = replace(stats, problems=tuple(typed)).to_dict()["problems"]
    assert rows[0] == {"id": "slo.ttft_p95", "pillar": "resources", "status": "fail",
                       "reason": "TTFT p95 5000 ms > 3000 ms", "measured": 5000.0, "limit": 3000.0,
                       "signal": "queue_latency", "evidence": ["records.jsonl stage=load"], "interval": None}
    assert all(type(v) is str for row in rows for v in (row["id"], row["signal"], row["pillar"], row["status"]))
    step = StageRow.of(stage="c8", kind="concurrency", users=8, problems=tuple(typed))
    assert ramp_of([step]).ran_out_first == "KV cache"
