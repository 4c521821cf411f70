"""Agent-API rules on hand-made attempts (no sockets): intervals, one primary layer per failure,
duplicate work from drill retries, context-length refusals per family."""

from __future__ import annotations

from k3load.analysis.pillars.agent.pillar_agent import judge_agent_api
from k3load.analysis.pillars.pillar import DEFAULT_THRESHOLDS
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.records import Attempt, Finding

LIMITS = DEFAULT_THRESHOLDS["agent_api"]
CONTEXT_400 = ('{"error":{"message":"This model\'s maximum context length is 1024 tokens. However, your prompt '
               'contains 1532 input tokens and requested 64 output tokens.","type":"BadRequestError",'
               '"param":"input_tokens","code":400}}')


def _attempt(i: int, findings: list[Finding] | None = None, **kw) -> Attempt:
    findings = findings or [Finding("transport", True)]
    failed = [f for f in findings if not f.ok]
    base = dict(run_id="r", attempt_id=f"a{i}", chain_id=f"c{i}", attempt=1, stage="load", scenario="s",
                family="agent", turn=0, turn_kind="tool_call", user_id="u", request_sha256=f"q{i}",
                prefix_sha256="p", transport="t", status="ok", send_ts=float(i), end_ts=i + 0.5,
                findings=findings, valid=not failed, failed_layers=sorted({f.layer for f in failed}),
                primary_layer=failed[0].layer if failed else None)
    return Attempt(**(base | kw))


def test_a_rate_at_the_threshold_is_inconclusive_with_how_many_more_attempts():
    attempts = [_attempt(i) for i in range(30)]
    result = judge_agent_api(attempts, LIMITS)
    assert result.status == INCONCLUSIVE
    assert "100.0% of 30 distinct requests (95% CI 88.6%-100.0%), 30 attempts valid" in result.reasons[0]
    assert "about 43 more distinct requests at this rate would decide" in result.reasons[0]
    assert judge_agent_api([_attempt(i) for i in range(80)], LIMITS).status == PASS


def test_repeats_of_few_requests_at_temperature_0_are_not_new_trials():
    """400 clean attempts of 40 request bodies: the interval is 40 requests' (it passed as 400 attempts)."""
    attempts = [_attempt(i, request_sha256=f"q{i % 40}", temperature=0.0) for i in range(400)]
    result = judge_agent_api(attempts, LIMITS)
    assert result.status == INCONCLUSIVE
    assert "100.0% of 40 distinct requests (95% CI 91.2%-100.0%), 400 attempts valid" in result.reasons[0]
    assert result.numbers["distinct_requests"] == 40
    few = judge_agent_api([_attempt(i, request_sha256=f"q{i % 7}") for i in range(400)], LIMITS)
    assert few.status == INCONCLUSIVE and "inconclusive, because only 7 distinct requests" in few.reasons[0]
    drawn = [_attempt(i, request_sha256=f"q{i % 7}", temperature=0.7) for i in range(400)]  # each a new draw
    assert judge_agent_api(drawn, LIMITS).status == PASS


def test_a_parser_fault_is_counted_once_under_the_parser():
    lost = [Finding("tool_call.present", False, "parser", "finish_reason tool_calls with no tool_calls"),
            Finding("expect.tool_call", False, "model_output", "expected a tool call, got an answer")]
    attempts = [_attempt(i, lost, primary_layer="parser", finish_reason="tool_calls") for i in range(10)] + \
        [_attempt(i) for i in range(10, 30)]
    result = judge_agent_api(attempts, LIMITS)
    numbers = result.numbers
    assert result.status == FAIL
    assert numbers["failed_by_layer"]["parser"] == 10 and numbers["failed_by_layer"]["model_output"] == 0
    assert numbers["failed_by_check"] == {"tool_call.present": 10}
    assert numbers["secondary_failures_by_check"] == {"expect.tool_call": 10}
    assert numbers["tool_call_schema_accuracy"] == 0.0 and numbers["tool_call_schema_accuracy_ci95"][1] < 0.35
    assert numbers["check_failure_rates"]["tool_call.present"]["ci95"][0] > 0.15


def test_timeout_drill_retries_are_duplicate_work_with_the_tokens_spent():
    attempts = [_attempt(i) for i in range(25)]
    for i in range(3):  # a drill: the short first deadline expires, the retry of the same bytes is answered
        attempts.append(_attempt(100 + i, [Finding("transport", False, "client", "timeout")], chain_id=f"d{i}",
                                 drill=True, will_retry=True, status="timeout", request_sha256=f"d{i}", chunks=4))
        attempts.append(_attempt(200 + i, chain_id=f"d{i}", attempt=2, request_sha256=f"d{i}", prompt_tokens=900))
    requests = judge_agent_api(attempts, LIMITS).numbers["requests"]
    assert requests["duplicate_attempts"] == requests["duplicate_attempts_drill"] == 3
    assert requests["abandoned_prompt_tokens"] == 2700 and requests["abandoned_output_chunks"] == 12


def test_context_length_refusals_are_named_per_family_with_the_servers_limit():
    refused = [_attempt(i, [Finding("request.context_length", False, "server", "too long")], status="http_error",
                        http_status=400, error_body=CONTEXT_400, family="long_input") for i in range(5)]
    result = judge_agent_api(refused + [_attempt(i) for i in range(5, 30)], LIMITS)
    assert result.numbers["context_length_refusals"] == {"long_input": {
        "refused": 5, "attempts": 5, "max_model_len": 1024, "prompt_tokens_min": 1532, "prompt_tokens_max": 1532,
        "counted_only_to_the_limit": False, "prompt_tokens_estimated": None, "completion_tokens_max": None}}
    assert any("long_input 5 of 5 (prompts 1532 tokens > max_model_len 1024)" in r for r in result.reasons)
    assert result.numbers["failed_by_layer"]["server"] == 5


def test_a_refusal_counted_only_to_the_limit_is_a_floor_with_the_size_estimated_from_the_bytes():
    """Seen on SmolLM2 with --max-model-len 1024: ~1,400-token prompts read "at least 1025" in vLLM's 400."""
    floor = CONTEXT_400.replace("contains 1532 input tokens", "contains at least 1025 input tokens")
    refused = [_attempt(i, [Finding("request.context_length", False, "server", "too long")], status="http_error",
                        http_status=400, error_body=floor, family="cold", request_bytes=5600) for i in range(5)]
    answered = [_attempt(i, prompt_tokens=250, request_bytes=1000) for i in range(5, 30)]  # 0.25 tokens a byte
    result = judge_agent_api(refused + answered, LIMITS)
    cold = result.numbers["context_length_refusals"]["cold"]
    assert cold["counted_only_to_the_limit"] and cold["prompt_tokens_estimated"] == 1400
    assert any("cold 5 of 5 (prompts at least 1025 tokens, ~1400 estimated from the bytes sent > max_model_len "
               "1024)" in r for r in result.reasons), result.reasons


def test_an_estimate_below_the_servers_own_floor_is_raised_to_it():
    """Seen on SmolLM2: an agent's late turn, dense with tool JSON, came to 1,018 tokens at the run's average
    tokens per byte, while vLLM had counted at least 1,025 before refusing it."""
    floor = CONTEXT_400.replace("contains 1532 input tokens", "contains at least 1025 input tokens")
    refused = [_attempt(0, [Finding("request.context_length", False, "server", "too long")], status="http_error",
                        http_status=400, error_body=floor, family="agent", request_bytes=4000)]
    answered = [_attempt(i, prompt_tokens=250, request_bytes=1000) for i in range(1, 30)]  # 4,000 B -> 1,000
    agent = judge_agent_api(refused + answered, LIMITS).numbers["context_length_refusals"]["agent"]
    assert agent["prompt_tokens_estimated"] == 1025 and agent["prompt_tokens_max"] == 1025


def test_a_refusal_of_the_output_budget_is_not_told_as_a_prompt_over_the_context():
    """Older and gateway-fronted vLLMs refuse prompt + max_tokens over the context with the sum in the message
    ("you requested 1100 tokens (1000 in the messages, 100 in the completion)"): the prompt fit, and saying
    "prompts 1100 tokens" would send the operator to shorten prompts instead of max_tokens."""
    body = CONTEXT_400.replace("However, your prompt contains 1532 input tokens",
                               "However, you requested 1100 tokens (1000 in the messages, 100 in the completion)")
    assert "1000 in the messages" in body
    refused = [_attempt(i, [Finding("request.context_length", False, "server", "too long")], status="http_error",
                        http_status=400, error_body=body, family="agent", request_bytes=4000) for i in range(3)]
    answered = [_attempt(i, prompt_tokens=250, request_bytes=1000) for i in range(3, 30)]
    result = judge_agent_api(refused + answered, LIMITS)
    agent = result.numbers["context_length_refusals"]["agent"]
    assert agent["prompt_tokens_max"] == 1000 and agent["completion_tokens_max"] == 100
    assert agent["prompt_tokens_estimated"] == 1000  # the bytes' estimate, not raised to a count that is no floor
    assert any("(prompts 1000 tokens, ~1000 estimated from the bytes sent, + up to 100 asked for the completion > "
               "max_model_len 1024)" in r for r in result.reasons), result.reasons
