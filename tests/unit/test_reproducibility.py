"""Tool calls that must repeat and the trigger rate per stage, on hand-made attempts (no sockets):
what a repeat is, what is compared, the batch-dependent wording, the agent pillar's verdict on them."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.analysis.pillars.agent.pillar_agent import judge_agent_api
from k3load.analysis.pillars.agent.reproducibility import judge, reproducibility, what_differs
from k3load.analysis.pillars.agent.trigger_by_stage import trigger_by_stage
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
from k3load.analysis.run.answer_signature import (
    SIGNATURE_CAP,
    Canonical,
    answer_signature,
    payload_signature,
    signature_of_calls,
)
from k3load.analysis.run.record_columns import Rows
from k3load.analysis.run.rundata import columns_of
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.records import Attempt, Finding
from k3load.workload.plan import parse_plan

LIMITS = DEFAULT_THRESHOLDS["agent_api"]
PLAN = parse_plan({"name": "p", "stages": [
    {"name": "load", "kind": "load", "duration_s": 5, "users": 4, "mix": {"agent": 1}},
    {"name": "concurrency", "kind": "concurrency", "duration_s": 5, "steps": [2, 12], "mix": {"agent": 1}}]}, "p")
USERS = {s.name: s.users for s in PLAN.stages}



def _rows(attempts: list[Attempt]) -> Rows:
    return columns_of(attempts).rows()

def _call(name: str, arguments: str, call_id: str = "functions.x:0") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _attempt(i: int, request: str, calls: list[dict] | None = None, stage: str = "load", **kw) -> Attempt:
    calls = [_call("get_weather", '{"city": "Paris"}')] if calls is None else calls
    ok = Finding("expect.tool_call", bool(calls), None if calls else "model_output")
    base = dict(run_id="r", attempt_id=f"a{i}", chain_id=f"c{i}", attempt=1, stage=stage, scenario="s", family="agent",
                turn=0, turn_kind="tool_call", user_id="u", request_sha256=request, prefix_sha256="p", transport="t",
                status="ok", send_ts=float(i), end_ts=i + 0.5, tool_calls=calls, findings=[ok], valid=bool(calls),
                temperature=0.0, finish_reason="tool_calls" if calls else "stop")
    return Attempt(**(base | kw))


def _repeated(n_requests: int, stage: str, start: int, calls=None) -> list[Attempt]:
    """Each of n requests answered twice in `stage`, in two chains."""
    return [_attempt(start + 2 * r + k, f"q{r}", calls, stage) for r in range(n_requests) for k in range(2)]


# -- what is compared ---------------------------------------------------------------------------------

canonical_values = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
                                lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.dictionaries(st.text(max_size=5), canonical_values,
                                                                                  max_size=4)), max_size=4),
       seed=st.integers(0, 2**16))
def test_the_signature_ignores_key_order_spacing_ids_and_call_order(calls, seed):
    """The same action written otherwise (keys reordered, spaces, other call ids, a parallel list in another
    order) is the same signature; another argument value never is."""
    rng = random.Random(seed)
    one = [_call(n, json.dumps(a), f"id{i}") for i, (n, a) in enumerate(calls)]
    shuffled = [(n, dict(rng.sample(list(a.items()), len(a)))) for n, a in calls]
    rng.shuffle(shuffled)
    two = [_call(n, json.dumps(a, indent=rng.choice([None, 2])), f"other{i}") for i, (n, a) in enumerate(shuffled)]
    assert answer_signature("tool_call", one, "") == answer_signature("tool_call", two, "x")  # content: not compared
    if calls and len(answer_signature("tool_call", one, "")) < SIGNATURE_CAP:
        name, arguments = calls[0]
        changed = [_call(name, json.dumps({**arguments, "__extra": 1})), *one[1:]]
        assert answer_signature("tool_call", changed, "") != answer_signature("tool_call", one, "")


any_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                        max_leaves=10)
any_arguments = st.one_of(st.text(), any_json.map(json.dumps), any_json)  # text, JSON text, or a decoded value
any_call = st.one_of(
    st.builds(lambda n, a: {"function": {"name": n, "arguments": a}}, st.one_of(st.text(), st.none(), st.integers()),
              any_arguments),
    st.builds(lambda n, a: {"name": n, "arguments": a}, st.text(), any_arguments),
    st.builds(lambda f: {"function": f}, st.dictionaries(st.text(max_size=3), any_json, max_size=2)),
    any_json)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["tool_call", "json", "answer", None]), calls=st.lists(any_call, max_size=4),
       content=st.one_of(st.none(), st.text(), any_json.map(json.dumps)), cap=st.integers(1, 4))
def test_the_joined_signature_is_the_payloads_text_on_any_calls(kind, calls, content, cap):
    """The signature joined from remembered canonical pieces is byte for byte the payload written whole, on any
    recorded calls (names and arguments of every JSON shape, text that is not JSON, a memory that starts again)."""
    canonical = Canonical()
    canonical.CAP, canonical.LONGEST = cap, 8  # a tiny memory: cleared and refilled within one answer, long texts
    # never kept
    expected = payload_signature(kind, calls, content)
    assert answer_signature(kind, calls, content) == expected
    pairs = [(str(((c.get("function") or {}).get("name") if isinstance(c, dict) else None)
                   or (c.get("name") if isinstance(c, dict) else None) or ""),
              ((c.get("function") or {}).get("arguments", c.get("arguments")) if isinstance(c, dict) else None))
             for c in calls]
    assert signature_of_calls(kind, pairs, content, canonical) == expected
    assert signature_of_calls(kind, pairs, content, canonical) == expected  # again, from what it remembered


def test_what_is_compared_per_turn_kind():
    assert answer_signature("answer", [], "any prose") is None  # prose may differ and still be right
    assert answer_signature("json", [], '{"b": 1.0, "a": [1]}') == answer_signature("json", [], '{"a":[1],"b":1}')
    assert answer_signature("json", [], '{"a": 1}') != answer_signature("json", [], '{"a": 2}')
    raw = answer_signature("tool_call", [_call("f", '{"a": 1, oops')], "")  # not JSON: its raw text
    assert "oops" in raw and raw != answer_signature("tool_call", [_call("f", '{"a": 1,  oops')], "")
    assert answer_signature("tool_call", [_call("f", "[" * 5000 + "]" * 5000)], "").startswith("sha256:")
    a = answer_signature("tool_call", [_call("get_weather", '{"city": "Paris", "unit": "c"}')], "")
    b = answer_signature("tool_call", [_call("get_weather", '{"city": "Lyon", "unit": "c"}')], "")
    assert what_differs(a, b) == 'get_weather arguments city: "Paris" vs "Lyon"'
    c = answer_signature("tool_call", [_call("search", "{}")], "")
    assert what_differs(a, c) == "tools called: ['get_weather'] vs ['search']"


# -- what a repeat is ---------------------------------------------------------------------------------

def test_retries_failures_drills_and_sampled_requests_are_not_repeats():
    lyon = [_call("get_weather", '{"city": "Lyon"}')]
    attempts = [
        _attempt(0, "q0"), _attempt(1, "q0", lyon, chain_id="c0", attempt=2),  # a retry: the same chain
        _attempt(2, "q1"), _attempt(3, "q1", lyon, status="timeout"),  # a transport failure is no answer
        _attempt(4, "q2"), _attempt(5, "q2", lyon, drill=True),  # the timeout drill's own
        _attempt(6, "q3", temperature=0.7), _attempt(7, "q3", lyon, temperature=0.7),  # fresh draws
        _attempt(8, "q4", temperature=None), _attempt(9, "q4", lyon, temperature=None),  # the server's default
        _attempt(10, "q5", temperature=0.7, seed=3), _attempt(11, "q5", temperature=0.7, seed=3),  # seeded: compared
        _attempt(12, "q6", turn_kind="answer"), _attempt(13, "q6", lyon, turn_kind="answer")]  # prose: not compared
    found = reproducibility(_rows(attempts), USERS)
    assert (found.rate.n, found.rate.k, found.answers) == (1, 1, 2)


def test_a_deterministic_server_reads_fully_reproducible_but_99_needs_more_repeats():
    attempts = _repeated(40, "load", 0) + _repeated(40, "concurrency-c12", 100)
    found = reproducibility(_rows(attempts), USERS)
    assert (found.rate.n, found.rate.k, found.rate.value) == (40, 40, 1.0) and not found.differences
    assert found.to_dict()["by_stage"]["concurrency-c12"]["share"] == 1.0
    rule = judge(found, 0.99)
    assert rule.status == INCONCLUSIVE and "about" in rule.reason  # 40 of 40: the interval reaches below 99%
    result = judge_agent_api(attempts, LIMITS | {"min_valid_rate": 0.9}, PLAN)  # 40 requests clear 90%
    assert result.status == PASS and result.numbers["reproducibility"]["share"] == 1.0
    assert any(r.startswith("reproducibility of tool calls inconclusive") for r in result.reasons)  # said, not silent
    nothing = judge_agent_api([_attempt(i, f"q{i}") for i in range(30)], LIMITS, PLAN)
    repro = nothing.numbers["reproducibility"]
    assert repro["repeated_requests"] == 0 and repro["share"] is None and repro["status"] == INCONCLUSIVE
    assert "inconclusive, because no request that must repeat" in repro["reason"] and nothing.status != FAIL


def test_answers_that_change_only_under_load_fail_as_batch_dependent():
    lyon = [_call("get_weather", '{"city": "Lyon"}')]
    low = [_attempt(r, f"q{r}", stage="concurrency-c2") for r in range(30)]
    high = [_attempt(100 + r, f"q{r}", lyon if r % 2 else None, stage="concurrency-c12") for r in range(30)]
    alike = _repeated(5, "concurrency-c2", 200)  # agreeing repeats inside the lowest concurrency
    attempts = [*low, *high, *[_attempt(i, f"r{i // 2}", stage=a.stage) for i, a in enumerate(alike, 400)]]
    result = judge_agent_api(attempts, LIMITS, PLAN)
    repro = result.numbers["reproducibility"]
    assert result.status == FAIL and repro["status"] == FAIL
    assert repro["repeated_requests"] == 35 and repro["agreeing"] == 20 and repro["share_ci95"][1] < 0.99
    assert repro["by_stage"]["concurrency-c2"]["share"] == 1.0 and repro["by_stage"]["concurrency-c12"]["share"] == 0.5
    assert repro["batch_dependent"] is True and repro["base_stage"] == "concurrency-c2"
    first = repro["differences"][0]
    assert first["stages"] == ["concurrency-c2", "concurrency-c12"] and first["attempt_ids"] == ["a1", "a101"]
    assert first["what"] == 'get_weather arguments city: "Paris" vs "Lyon"' and first["request_sha256"] == "q1"
    reason = next(r for r in result.reasons if "non-reproducible tool calls" in r)
    assert "batch-dependent" in reason and "VLLM_BATCH_INVARIANT=1" in reason and "rollback" in reason


def test_a_request_answered_once_alone_and_once_under_load_is_batch_dependent_when_only_load_differs():
    """The plainest case (the review's): each request once at c2, once at c12; the c2 answers are only references,
    so c2 has no row of its own, and the base is still c2, not the loaded stage."""
    lyon = [_call("get_weather", '{"city": "Lyon"}')]
    low = [_attempt(r, f"q{r}", stage="concurrency-c2") for r in range(30)]
    high = [_attempt(100 + r, f"q{r}", lyon if r % 2 else None, stage="concurrency-c12") for r in range(30)]
    repro = judge_agent_api([*low, *high], LIMITS, PLAN).numbers["reproducibility"]
    assert "concurrency-c2" not in repro["by_stage"] and repro["base_stage"] == "concurrency-c2"
    assert repro["batch_dependent"] is True, repro


def test_calls_of_one_tool_pair_up_when_two_answers_are_told_apart():
    a = answer_signature("tool_call", [_call("b", '{"x": "b"}'), _call("a", '{"x": "b"}')], None)
    b = answer_signature("tool_call", [_call("b", '{"x": "c"}'), _call("a", '{"x": "b"}')], None)
    assert what_differs(a, b) == 'b arguments x: "b" vs "c"'


def test_differences_at_the_lowest_concurrency_are_not_called_batch_dependent():
    lyon = [_call("get_weather", '{"city": "Lyon"}')]
    attempts = [a for r in range(20) for a in (_attempt(2 * r, f"q{r}", stage="concurrency-c2"),
                                               _attempt(2 * r + 1, f"q{r}", lyon, stage="concurrency-c2"))]
    repro = judge_agent_api(attempts, LIMITS, PLAN).numbers["reproducibility"]
    assert repro["status"] == FAIL and repro["batch_dependent"] is False
    assert "not only under load" in repro["reason"] and "VLLM_BATCH_INVARIANT=1" in repro["reason"]


def test_a_few_differences_that_cannot_decide_hold_the_pillar_inconclusive():
    lyon = [_call("get_weather", '{"city": "Lyon"}')]
    attempts = [*_repeated(29, "load", 0), _attempt(900, "z"), _attempt(901, "z", lyon, stage="concurrency-c12")]
    attempts += [_attempt(1000 + i, f"single{i}") for i in range(60)]  # the valid rate clears 90%: not what decides
    result = judge_agent_api(attempts, LIMITS | {"min_valid_rate": 0.5}, PLAN)
    assert result.numbers["reproducibility"]["status"] == INCONCLUSIVE and result.status == INCONCLUSIVE


# -- the trigger rate per stage -----------------------------------------------------------------------

def test_a_trigger_rate_that_drops_under_load_is_named_and_fails():
    load = [_attempt(i, f"q{i}") for i in range(30)]
    c12 = [_attempt(100 + i, f"q{i}", [] if i % 2 else None, stage="concurrency-c12") for i in range(30)]
    c2 = [_attempt(200 + i, f"q{i}", stage="concurrency-c2") for i in range(30)]
    numbers, rule = trigger_by_stage(_rows([*load, *c2, *c12]), PLAN)
    assert numbers["base_stage"] == "load" and numbers["changed_stages"] == ["concurrency-c12"]
    row = numbers["stages"]["concurrency-c12"]
    assert row["called"]["rate"] == 0.5 and row["called_expected"]["rate"] == 0.5 and row["tool_call_turns"] == 30
    assert row["called_drop"]["drop"] == 0.5 and row["called_drop"]["ci95"][0] > 0
    assert numbers["stages"]["concurrency-c2"]["called_drop"]["drop"] == 0.0
    assert rule is not None and rule.status == FAIL and "load changes what the model does" in rule.reason
    assert "concurrency-c12 (12 users) called a tool 50.0% against 100.0%" in rule.reason


def test_trigger_rate_steady_across_stages_passes_and_without_a_load_stage_says_so():
    attempts = [_attempt(i, f"q{i}") for i in range(20)] + \
        [_attempt(100 + i, f"q{i}", stage="concurrency-c12") for i in range(20)]
    numbers, rule = trigger_by_stage(_rows(attempts), PLAN)
    assert rule is not None and rule.status == PASS and numbers["changed_stages"] == []
    only = parse_plan({"name": "p", "stages": [{"name": "soak", "kind": "soak", "duration_s": 5, "users": 2,
                                                "mix": {"agent": 1}}]}, "p")
    numbers, rule = trigger_by_stage(_rows([_attempt(i, f"q{i}", stage="soak") for i in range(5)]), only)
    assert rule is None and "no stage of kind load" in numbers["reason"]


def test_a_stage_playing_other_turns_is_not_read_as_load_changing_the_model():
    """Like for like: a stage whose tool-call turns are other scenarios' (another family, another mix) is compared
    on the turns it shares with the base only, here none; the pillar is not failed for its own turns' habits."""
    load = [_attempt(i, f"q{i}") for i in range(30)]
    other = [_attempt(100 + i, f"o{i}", [], stage="concurrency-c12", scenario="other") for i in range(30)]
    numbers, rule = trigger_by_stage(_rows([*load, *other]), PLAN)
    row = numbers["stages"]["concurrency-c12"]
    assert row["compared_turns"] == 0 and row["called_drop"]["drop"] is None and row["called"]["rate"] == 0.0
    assert numbers["changed_stages"] == [] and rule is not None and rule.status == PASS


def test_the_reproducibility_sits_where_issue_33_names_it():
    result = judge_agent_api(_repeated(25, "load", 0), LIMITS, PLAN).to_dict()
    assert result["reproducibility"] == result["numbers"]["reproducibility"]
    assert result["reproducibility"]["repeated_requests"] == 25 and result["reproducibility"]["share"] == 1.0
