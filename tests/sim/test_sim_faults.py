"""Every injected fault of the sim, seen from a client over HTTP, looks like the layer that causes it."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.probes import Target, chat, scrape, stream_chat, total

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _t(sim) -> Target:
    return Target("sim", sim.base_url, "tiny")


def test_injected_http_errors_vllm_and_gateway_styles(start_sim, client):
    vllm_style = _t(start_sim("--http-error-rate", "1", "--http-error-status", "503"))
    resp = chat(vllm_style, client, messages=ASK)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
    gateway = _t(start_sim("--http-error-rate", "1", "--http-error-status", "429", "--http-error-style", "gateway"))
    resp = chat(gateway, client, messages=ASK)
    assert resp.status_code == 429 and resp.headers["content-type"].startswith("text/plain")


def test_error_rate_is_a_rate_and_retries_draw_again(start_sim, client):
    t = _t(start_sim("--http-error-rate", "0.5"))
    statuses = [chat(t, client, messages=ASK, max_tokens=2).status_code for _ in range(40)]
    assert 8 <= statuses.count(503) <= 32 and statuses.count(200) >= 8


def test_malformed_tool_arguments(start_sim, client):
    t = _t(start_sim("--malformed-tool-args-rate", "1"))
    call = chat(t, client, messages=ASK, tools=[WEATHER]).json()["choices"][0]["message"]["tool_calls"][0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(call["function"]["arguments"])


def test_empty_tool_calls_with_tool_calls_finish(start_sim, client):
    t = _t(start_sim("--empty-tool-calls-rate", "1"))
    choice = chat(t, client, messages=ASK, tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"] == []


def test_raw_tool_markup_left_in_content(start_sim, client):
    t = _t(start_sim("--raw-tool-markup-rate", "1"))
    message = chat(t, client, messages=ASK, tools=[WEATHER]).json()["choices"][0]["message"]
    assert "<|tool_calls_section_begin|>" in message["content"] and message["tool_calls"] == []


def test_reasoning_leaks_into_content(start_sim, client):
    t = _t(start_sim("--reasoning-leak-rate", "1"))
    message = chat(t, client, messages=[{"role": "user", "content": "hi"}]).json()["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"].startswith("<|open|>think<|sep|>Let me think")


def test_midstream_error_event(start_sim, client):
    t = _t(start_sim("--midstream-error-rate", "1"))
    got = stream_chat(t, client, messages=[{"role": "user", "content": "hi"}], max_tokens=30)
    assert got.status == 200 and got.done
    assert "error" in got.chunks[-1] and got.chunks[-1]["error"]["code"] == 500
    assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in got.chunks)


def test_truncated_stream_has_no_done(start_sim, client):
    t = _t(start_sim("--truncate-stream-rate", "1"))
    with pytest.raises(httpx.RemoteProtocolError):
        stream_chat(t, client, messages=[{"role": "user", "content": "hi"}], max_tokens=30)


def test_slow_first_token_and_slow_drip(start_sim, client):
    t = _t(start_sim("--slow-first-token-rate", "1", "--slow-first-token-ms", "3000",
                     "--slow-drip-rate", "1", "--slow-drip-ms", "200"))  # x0.1 time scale: 0.3 s, 20 ms
    start = time.perf_counter()
    got = stream_chat(t, client, messages=[{"role": "user", "content": "hi"}], max_tokens=11, ignore_eos=True)
    assert got.done and time.perf_counter() - start >= 0.3 + 10 * 0.02


def test_prefix_caching_on_but_never_hitting(start_sim, client):
    t = _t(start_sim("--prefix-cache-never-hits", "--block-size", "16"))
    system = {"role": "system", "content": "Shared instructions. " * 100}
    for q in ("a", "b", "c"):
        chat(t, client, messages=[system, {"role": "user", "content": q}], max_tokens=2)
    samples = scrape(t, client)
    assert total(samples, "vllm:prefix_cache_queries_total") > 0
    assert total(samples, "vllm:prefix_cache_hits_total") == 0
    assert total(samples, "vllm:cache_config_info", enable_prefix_caching="True") == 1


def test_metrics_disabled_leaves_only_the_tool_parser_counter(start_sim, client):
    """As vLLM 0.32 with --disable-log-stats: the API server's tool-parser counter stays (its 12 label sets
    from the start, still counting); every engine family is gone; the simulated DCGM gauges stay."""
    t = _t(start_sim("--metrics-disabled"))
    parser = "vllm:tool_call_parser_invocations_total"
    before = scrape(t, client)
    assert len([key for key in before if key[0] == parser]) == 12 and total(before, parser) == 0
    assert chat(t, client, messages=ASK, tools=[WEATHER]).status_code == 200
    samples = scrape(t, client)
    names = {name for name, _ in samples}
    assert {n for n in names if n.startswith("vllm:")} == {parser, "vllm:tool_call_parser_invocations_created"}
    assert total(samples, parser, mode="non_streaming", request_type="chat_completions") == 1
    assert "DCGM_FI_DEV_FB_USED" in names


def test_oom_crash_when_kv_demand_passes_the_threshold(start_sim, client):
    sim = start_sim("--oom-kv-demand-tokens", "1500")
    t = _t(sim)
    assert chat(t, client, messages=ASK, max_tokens=100).status_code == 200  # under the threshold
    with pytest.raises(httpx.HTTPError):
        chat(t, client, messages=ASK, max_tokens=2000)
    sim.proc.wait(10)
    assert sim.returncode not in (0, None)
    assert "CUDA out of memory" in sim.log_path.read_text()


def test_profile_file_sets_faults_and_flags_override_it(start_sim, client, tmp_path):
    profile = tmp_path / "faults.yaml"
    profile.write_text("engine:\n  reasoning_tokens: 0\nfaults:\n  http_error_rate: 1.0\n"
                       "  http_error_status: 502\n")
    t = _t(start_sim("--profile", str(profile)))
    assert chat(t, client, messages=ASK).status_code == 502
    t2 = _t(start_sim("--profile", str(profile), "--http-error-rate", "0"))
    message = chat(t2, client, messages=[{"role": "user", "content": "hi"}]).json()["choices"][0]["message"]
    assert message["reasoning"] is None


def test_bad_profile_is_a_clear_error_naming_the_field(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("faults:\n  http_error_rat: 1\n")
    run = subprocess.run([sys.executable, "-m", "k3load", "sim", "--profile", str(bad)], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 2 and "http_error_rat" in run.stdout + run.stderr


def test_hostile_json_arguments_and_structured_output(start_sim, client):
    """--hostile-json-rate: JSON that Python's json takes leniently or crashes on, whole and streamed; mixed draws
    each of the four shapes per answer."""
    from k3load.workload import strict_json

    t = _t(start_sim("--hostile-json-rate", "1", "--hostile-json-shape", "mixed"))
    kinds = set()
    for n in range(16):
        ask = [{"role": "user", "content": f"What is the weather in Paris? ({n})"}]
        call = chat(t, client, messages=ask, tools=[WEATHER]).json()["choices"][0]["message"]["tool_calls"][0]
        refused = strict_json.parse(call["function"]["arguments"])
        assert isinstance(refused, strict_json.Refused) and refused.strict, refused
        kinds.add(refused.kind)
    assert kinds == {strict_json.TOO_DEEP, strict_json.NUMBER_TOO_LONG, strict_json.NOT_JSON_NUMBER,
                     strict_json.DUPLICATE_KEY}
    deep = _t(start_sim("--hostile-json-rate", "1", "--hostile-json-shape", "deep"))
    got = stream_chat(deep, client, messages=ASK, tools=[WEATHER])
    arguments = "".join(tc["function"].get("arguments") or "" for c in got.chunks if c.get("choices")
                        for tc in c["choices"][0]["delta"].get("tool_calls") or [])
    assert got.done and strict_json.depth(arguments) == 60_000
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    content = chat(deep, client, messages=ASK, response_format=fmt).json()["choices"][0]["message"]["content"]
    assert strict_json.parse(content).kind == strict_json.TOO_DEEP  # type: ignore[union-attr]


def test_batch_dependent_arguments_change_under_load_and_never_alone(start_sim, client):
    """A batch-variant engine (vLLM without VLLM_BATCH_INVARIANT=1): the same temperature-0 request answers the same
    every time alone, and with other arguments (still a string city) when it joins a batch of 2 or more."""
    from concurrent.futures import ThreadPoolExecutor

    t = _t(start_sim("--batch-dependent-args-rate", "1", "--batch-dependent-args-min-running", "2",
                     "--time-scale", "1", "--step-base-ms", "20"))
    body = {"messages": ASK, "tools": [WEATHER], "temperature": 0, "stream": False}

    def arguments(resp: httpx.Response) -> str:
        return resp.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]

    alone = {arguments(chat(t, client, **body)) for _ in range(3)}
    assert len(alone) == 1  # deterministic alone: a healthy temperature-0 request repeats exactly
    with ThreadPoolExecutor(max_workers=4) as pool:
        crowded = [arguments(r) for r in pool.map(lambda _: chat(t, httpx.Client(timeout=60), **body), range(4))]
    assert set(crowded) - alone, crowded  # joined a batch: decoded otherwise
    assert all(isinstance(json.loads(a)["city"], str) for a in crowded)  # still valid against the schema
    assert {arguments(chat(t, client, **body))} == alone  # alone again: the first answer again
