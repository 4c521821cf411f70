"""How many SSE chunks per second `k3load sim` delivers, against a named reference in the same run.

Reference: "bare-aiohttp", an aiohttp server that writes pre-serialised vLLM-shaped chunks with no
engine behind them (the kind of server the client-cost measurements used). The ratio says how much
the sim's engine, cache and JSON cost per chunk; the absolute rate says whether the sim can be the
bottleneck of our own tests. Both servers run as separate processes; the client is an asyncio +
aiohttp reader with C streams of N tokens each, reading every stream to [DONE].

    .venv/bin/python bench/sim_chunk_rate.py [--streams 64] [--tokens 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3load.sim.process import SimProcess  # noqa: E402

CHUNK = ("data: " + json.dumps({"id": "chatcmpl-ref", "object": "chat.completion.chunk", "created": 0,
                                "model": "tiny", "choices": [{"index": 0, "delta": {"content": " token"},
                                                              "logprobs": None, "finish_reason": None,
                                                              "token_ids": None}]}) + "\n\n").encode()


async def _reference_handler(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
    body = await request.json()
    resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(body.get("max_tokens", 16)):
        await resp.write(CHUNK)
    await resp.write(b"data: [DONE]\n\n")
    return resp


def serve_reference() -> None:
    from aiohttp import web

    async def main() -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", _reference_handler)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"reference listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


async def _one(session: aiohttp.ClientSession, url: str, tokens: int, index: int) -> int:
    body = {"model": "tiny", "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"stream {index}"}]}
    chunks = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: ") and line != b"data: [DONE]\n":
                chunks += 1
    return chunks


async def _round(url: str, streams: int, tokens: int) -> float:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_one(session, url, tokens, i) for i in range(streams)))
        return sum(counts) / (time.perf_counter() - start)


def _start_reference(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    out = log.open("wb")
    proc = subprocess.Popen([sys.executable, __file__, "--serve-reference"], stdout=out, stderr=subprocess.STDOUT)
    for _ in range(200):
        text = log.read_text()
        if "listening on " in text:
            return proc, text.split("listening on ")[1].split()[0]
        time.sleep(0.05)
    raise RuntimeError("reference server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve-reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_reference:
        serve_reference()
        return 0
    logs = ROOT / ".cache" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    # The sim with no modelled time: what its own code costs per chunk.
    sim = SimProcess(["--model", "tiny", "--time-scale", "0", "--reasoning-tokens", "0",
                      "--max-num-seqs", str(args.streams)], logs / "sim.log").start()
    ref, ref_url = _start_reference(logs / "reference.log")
    try:
        rates = {}
        for name, url in (("k3load sim", sim.base_url), ("bare-aiohttp", ref_url)):
            asyncio.run(_round(url, 4, 16))  # warm-up
            rates[name] = statistics.median(asyncio.run(_round(url, args.streams, args.tokens))
                                            for _ in range(args.rounds))
    finally:
        sim.stop()
        ref.terminate()
        ref.wait()
    for name, rate in rates.items():
        print(f"{name:14s} {rate:10,.0f} chunks/s  ({args.streams} streams x {args.tokens} tokens, "
              f"median of {args.rounds})")
    print(f"ratio sim / bare-aiohttp: {rates['k3load sim'] / rates['bare-aiohttp']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
