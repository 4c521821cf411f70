"""The sampler against the real vLLM CPU server (marker `vllm`, given by the fixture): a few scrapes,
a request counted between them, and the cache geometry read from `vllm:cache_config_info`."""

from __future__ import annotations

import httpx

from k3load.sampler import Sampler
from tests.sim.test_sampler_sim import events, read_metrics, wait_for


def test_real_vllm_scrapes_count_a_request_and_name_the_cache_geometry(vllm_server, tmp_path):
    out = tmp_path / "run"
    sampler = Sampler(out, vllm_server.base_url + "/metrics", interval_s=0.25, server_log=vllm_server.log_path).start()
    try:
        wait_for(lambda: read_metrics(out), what="a first scrape")
        reply = httpx.post(f"{vllm_server.openai_url}/chat/completions", timeout=120, json={
            "model": vllm_server.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert reply.status_code == 200
        wait_for(lambda: len(read_metrics(out)) >= 3, what="more scrapes")
    finally:
        sampler.stop()
    lines = read_metrics(out)
    assert all(line["ok"] for line in lines) and lines[0]["vllm_series"] > 300
    assert lines[0]["process_start_ts"] is not None and not any("_created" in k for k in lines[-1]["samples"])
    key = 'vllm:prompt_tokens_total{engine="0",model_name="' + vllm_server.model + '"}'
    assert lines[-1]["samples"][key] > lines[0]["samples"][key]
    (config,) = events(out, "cache_config")
    labels = config["labels"][0]
    assert labels["block_size"] == "128" and labels["num_gpu_blocks"] == "24"
    assert {"enable_prefix_caching", "mamba_block_size", "cache_hit_alignment_tokens"} <= set(labels)
    assert not events(out, "counter_reset") and not events(out, "server_down")
    assert (out / "server.log").read_text()  # the startup log copied from the beginning
