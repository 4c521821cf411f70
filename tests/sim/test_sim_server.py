"""The sim as a server: its knobs, its engine model and every injected fault, over real HTTP."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
import sys
import time

import httpx

from k3load.sim.config import FaultProfile, SimConfig, help_of
from tests.probes import Target, chat, long_system_prompt, scrape, stream_chat, total

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _target(sim) -> Target:
    return Target("sim", sim.base_url, "tiny")


def test_help_documents_every_knob():
    out = subprocess.run([sys.executable, "-m", "k3load", "sim", "--help"], capture_output=True, text=True,
                         check=True).stdout
    fields = [(cls, f.name) for cls in (SimConfig, FaultProfile) for f in dataclasses.fields(cls) if f.name != "faults"]
    flat = "".join(out.split())  # argparse wraps lines, also at hyphens
    for cls, name in fields:
        assert "--" + name.replace("_", "-") in out
        assert help_of(cls, name) and "".join(help_of(cls, name).split()) in flat
    assert "neverevidence" in flat


def test_port_zero_prints_a_reachable_url(sim, client):
    assert sim.base_url.startswith("http://127.0.0.1:") and not sim.base_url.endswith(":0")
    assert client.get(f"{sim.base_url}/health").status_code == 200


def test_reasoning_is_kept_apart_from_content_streamed_and_final(sim, client):
    t = _target(sim)
    got = stream_chat(t, client, messages=[{"role": "user", "content": "hello"}])
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning", "") for c in got.chunks if c.get("choices"))
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in got.chunks if c.get("choices"))
    assert reasoning.startswith("Let me think") and content and reasoning not in content
    message = chat(t, client, messages=[{"role": "user", "content": "hello"}]).json()["choices"][0]["message"]
    assert message["reasoning"].startswith("Let me think") and "Let me think" not in message["content"]


def test_kimi_tool_call_ids_and_k3_whole_call_delta(sim, client):
    t = _target(sim)
    got = stream_chat(t, client, messages=ASK_WEATHER, tools=[WEATHER])
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in got.chunks
             if c.get("choices") and c["choices"][0]["delta"].get("tool_calls")]
    assert len(calls) == 1 and calls[0]["id"] == "functions.get_weather:0"
    assert json.loads(calls[0]["function"]["arguments"])["city"]
    assert got.chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    history = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function", "function": calls[0]["function"]}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21C"},
        {"role": "user", "content": "And the weather in Rome?"}]
    again = chat(t, client, messages=history, tools=[WEATHER]).json()["choices"][0]["message"]
    assert again["tool_calls"][0]["id"] == "functions.get_weather:1"


def test_answer_after_a_tool_result_and_no_tool_when_none_fits(sim, client):
    t = _target(sim)
    after = [*ASK_WEATHER, {"role": "assistant", "tool_calls": [{"id": "functions.get_weather:0", "type":
             "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
             {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    body = chat(t, client, messages=after, tools=[WEATHER]).json()["choices"][0]
    assert body["finish_reason"] == "stop" and body["message"]["tool_calls"] == []
    assert body["message"]["content"].startswith("Based on the tool result")
    chatty = chat(t, client, messages=[{"role": "user", "content": "Tell me a joke"}], tools=[WEATHER]).json()
    assert chatty["choices"][0]["message"]["tool_calls"] == []


def test_identical_requests_replay_identically_for_a_seed(start_sim, client):
    body = {"messages": [{"role": "user", "content": "Summarise the plan"}], "max_tokens": 40}
    a, b, c = start_sim("--seed", "5"), start_sim("--seed", "5"), start_sim("--seed", "6")
    texts = [chat(_target(s), client, **body).json()["choices"][0]["message"]["content"] for s in (a, b, c)]
    assert texts[0] == texts[1] != texts[2]


def _ttft_s(target: Target, client: httpx.Client, messages: list) -> float:
    start = time.perf_counter()
    with client.stream("POST", f"{target.base_url}/v1/chat/completions",
                       json={"model": "tiny", "messages": messages, "stream": True, "max_tokens": 4}) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if '"content"' in line or '"reasoning"' in line:
                elapsed = time.perf_counter() - start
                for _ in lines:
                    pass
                return elapsed
    raise AssertionError("no token arrived")


def test_ttft_follows_uncached_prompt_tokens(start_sim, client):
    sim = start_sim("--prefill-ms-per-token", "1.0", "--block-size", "16")
    t = _target(sim)
    system = {"role": "system", "content": long_system_prompt()}
    cold = _ttft_s(t, client, [system, {"role": "user", "content": "first question"}])
    warm = _ttft_s(t, client, [system, {"role": "user", "content": "second question"}])
    assert cold > 3 * warm, (cold, warm)  # ~1,000 uncached tokens at 0.1 ms each vs a few blocks


def _mean_itl(target: Target, client: httpx.Client, concurrency: int) -> float:
    before = scrape(target, client)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: chat(target, client, max_tokens=32, ignore_eos=True,
                                     messages=[{"role": "user", "content": f"n{i}"}]), range(concurrency)))
    after = scrape(target, client)
    n = "vllm:inter_token_latency_seconds"
    return (total(after, n + "_sum") - total(before, n + "_sum")) / (
        total(after, n + "_count") - total(before, n + "_count"))


def test_inter_token_delay_grows_with_the_batch(start_sim, client):
    t = _target(start_sim("--step-per-seq-ms", "1.0", "--step-base-ms", "2"))
    alone, crowded = _mean_itl(t, client, 1), _mean_itl(t, client, 24)
    assert crowded > 2 * alone, (alone, crowded)


def _hits(target: Target, client: httpx.Client, system: str) -> list[float]:
    out = []
    for q in ("one", "two"):
        before = scrape(target, client)
        chat(target, client, max_tokens=2, messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": q}])
        after = scrape(target, client)
        out.append(total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total"))
    return out


def test_hybrid_hits_resume_only_at_checkpoint_boundaries(start_sim, client):
    t = _target(start_sim("--block-size", "16", "--hybrid-block-size", "256"))
    cold, warm = _hits(t, client, long_system_prompt())
    assert cold == 0 and warm > 0 and warm % 256 == 0
    short = _hits(t, client, "Short shared prefix of about forty tokens, shorter than one checkpoint. " * 2)
    assert short == [0, 0]
    info = next(dict(ls) for (n, ls) in scrape(t, client) if n == "vllm:cache_config_info")
    assert info["mamba_block_size"] == "256" and info["cache_hit_alignment_tokens"] == "256"


def test_lru_eviction_under_capacity_loses_hits(start_sim, client):
    t = _target(start_sim("--block-size", "16", "--num-gpu-blocks", "100"))
    first = long_system_prompt()
    cold, warm = _hits(t, client, first)
    assert cold == 0 and warm > 600
    _hits(t, client, "Another tenant. " + long_system_prompt(430))  # needs the pool: evicts the first's tail
    assert 0 < _hits(t, client, first)[0] < warm  # the head survives: vLLM frees tail blocks first


def test_client_going_away_frees_its_kv(start_sim, client):
    t = _target(start_sim("--step-base-ms", "50"))
    with client.stream("POST", f"{t.base_url}/v1/chat/completions", json={
            "model": "tiny", "stream": True, "max_tokens": 500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "long"}]}) as resp:
        next(resp.iter_lines())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and total(scrape(t, client), "vllm:num_requests_running"):
        time.sleep(0.05)
    samples = scrape(t, client)
    assert total(samples, "vllm:num_requests_running") == 0 and total(samples, "vllm:kv_cache_usage_perc") == 0
    assert total(samples, "vllm:request_success_total", finished_reason="abort") == 1


def test_simulated_gpu_memory_is_labelled_and_stays_at_vllms_reservation_while_kv_fills(start_sim, client):
    """vLLM reserves --gpu-memory-utilization of each card at start (Worker.determine_available_memory): the sim's
    DCGM gauges sit there from the first scrape and stay there while a request fills the KV pool, whose fill
    shows only in vllm:kv_cache_usage_perc; cache_config_info says the same share."""
    t = _target(start_sim("--step-base-ms", "40"))
    idle = scrape(t, client)
    used_idle = total(idle, "DCGM_FI_DEV_FB_USED", gpu="0", simulated="true")
    assert used_idle == round(0.9 * 288 * 1024 + 1536) and total(idle, "k3load_sim_info") == 1
    assert total(idle, "vllm:cache_config_info", gpu_memory_utilization="0.9") == 1
    with client.stream("POST", f"{t.base_url}/v1/chat/completions", json={
            "model": "tiny", "stream": True, "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "system", "content": long_system_prompt()}, {"role": "user", "content": "q"}]}
    ) as resp:
        lines = resp.iter_lines()
        next(lines)
        busy = scrape(t, client)
        for _ in lines:
            pass
    assert total(busy, "DCGM_FI_DEV_FB_USED", gpu="0") == used_idle
    assert total(busy, "vllm:kv_cache_usage_perc") > 0
