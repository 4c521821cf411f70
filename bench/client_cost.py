"""What the streaming client costs per chunk and how late it sees first tokens, per transport.

Reference: "httpx" (the k3load ChatClient over httpx `iter_raw`), measured in the same run, against
the same server, as the default "geventhttpclient" transport. Printed ratios are
geventhttpclient / httpx: below 1 means cheaper (CPU) or tighter (lateness).

Server: a bare paced SSE writer (aiohttp, separate process, pinned to CPU 0 where there are two or
more) with an engine-step clock: every `streams / rate` seconds it writes one pre-serialised
vLLM-shaped chunk to every open stream, like a real engine step. The first token's chunk carries the
time it was written, so first-token lateness = client first_token_ts - server write time (same
machine, same clock). The server's own CPU share is printed: a busy server makes the numbers its own.

Client: this process, gevent-patched first (as under Locust), pinned to CPU 1; one ChatClient per
simulated user (as one per Locust user), each sending requests back to back. CPU per chunk = process
CPU seconds over the round / token-bearing chunks received (per-request overhead included).

    .venv/bin/python bench/client_cost.py [--rate 10000] [--streams 16 128] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and "--serve" not in sys.argv:
    from gevent import monkey

    monkey.patch_all()  # before anything imports socket/ssl: the client runs as under Locust

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import gevent
import psutil

from k3load.client.chat import ChatClient

ROOT = Path(__file__).resolve().parents[1]
REFERENCE, CANDIDATE = "httpx", "geventhttpclient"


def _chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": None}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


ROLE = _chunk({"role": "assistant", "content": ""})
TOKEN = _chunk({"content": " token"})
LAST = _chunk({"content": " token"}, "length")
TAIL = (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"tiny","choices":[],'
        b'"usage":{"prompt_tokens":8,"completion_tokens":0,"total_tokens":8}}\n\ndata: [DONE]\n\n')


# -- the server (a subprocess: `client_cost.py --serve STEP_MS`) -------------------------------------
def serve(step_ms: float) -> None:
    """One engine-step loop writes a token to every active stream each step."""
    from aiohttp import web

    active: list[list] = []  # [response, tokens left, first?, done future]

    async def handler(request: web.Request) -> web.StreamResponse:
        tokens = (await request.json()).get("max_tokens", 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(ROLE)
        done = asyncio.get_running_loop().create_future()
        active.append([resp, tokens, True, done])
        await done
        await resp.write(TAIL)
        return resp

    async def step_loop() -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += step_ms / 1000
            await asyncio.sleep(max(next_at - loop.time(), 0))
            for stream in list(active):
                await _step(stream, active)

    async def main() -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", handler)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
        print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await step_loop()

    asyncio.run(main())


async def _step(stream: list, active: list[list]) -> None:
    resp, left, first, done = stream
    chunk = _chunk({"content": f"@{time.time():.6f}"}) if first else (LAST if left == 1 else TOKEN)
    stream[1], stream[2] = left - 1, False
    try:
        await resp.write(chunk)
    except ConnectionError:
        stream[1] = 0
    if stream[1] <= 0:
        active.remove(stream)
        done.set_result(None)


def start_server(step_ms: float, log: Path, cpu: int | None) -> tuple[subprocess.Popen[bytes], str]:
    out = log.open("wb")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(step_ms)], stdout=out, stderr=subprocess.STDOUT)
    if cpu is not None:
        os.sched_setaffinity(proc.pid, {cpu})
    for _ in range(200):
        text = log.read_text()
        if "listening on " in text:
            return proc, text.split("listening on ")[1].split()[0]
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"bench server did not start: {log.read_text()[-2000:]}")


# -- the client ------------------------------------------------------------------------------------
@dataclass
class Round:
    us_per_chunk: float
    late_p50_ms: float
    late_p99_ms: float
    client_cpu: float  # share of one core
    server_cpu: float
    chunks_per_s: float


def one_round(url: str, transport: str, streams: int, tokens: int, requests: int,
              server: psutil.Process) -> Round:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    clients = [ChatClient(url, transport=transport, max_connections=1) for _ in range(streams)]
    gevent.joinall([gevent.spawn(c.send, body, 60.0) for c in clients])  # warm: connections open
    results = []

    def user(client: ChatClient) -> None:
        for _ in range(requests):
            results.append(client.send(body, 60.0))

    cpu0, server0, wall0 = time.process_time(), sum(server.cpu_times()[:2]), time.perf_counter()
    gevent.joinall([gevent.spawn(user, c) for c in clients])
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    server_cpu = sum(server.cpu_times()[:2]) - server0
    for client in clients:
        client.close()
    bad = [r for r in results if r.status != "ok"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0].status}: {bad[0].error}")
    chunks = sum(len(r.chunk_ts) for r in results)
    late = sorted((first - float(r.content[1:].split(" ")[0])) * 1000 for r in results
                  if (first := r.first_token_ts) is not None)
    if len(late) < len(results):
        raise RuntimeError(f"{len(results) - len(late)} answers without a first token")
    return Round(cpu / chunks * 1e6, statistics.median(late), late[min(int(len(late) * 0.99), len(late) - 1)],
                 cpu / wall, server_cpu / wall, chunks / wall)


def measure(streams: int, args: argparse.Namespace, logs: Path, cpus: tuple[int | None, int | None]
            ) -> dict[str, Round]:
    step_ms = streams / args.rate * 1000
    proc, url = start_server(step_ms, logs / f"server-{streams}.log", cpus[0])
    requests = max(1, round(args.rate * args.round_s / (streams * args.tokens)))
    rounds: dict[str, list[Round]] = {REFERENCE: [], CANDIDATE: []}
    try:
        server = psutil.Process(proc.pid)
        for _ in range(args.rounds):  # alternate transports so drift hits both alike
            for transport in rounds:
                rounds[transport].append(one_round(url, transport, streams, args.tokens, requests, server))
    finally:
        proc.terminate()
        proc.wait()
    return {t: Round(*(statistics.median(getattr(r, f) for r in rs) for f in Round.__dataclass_fields__))
            for t, rs in rounds.items()}


def report(streams: int, got: dict[str, Round]) -> None:
    for transport, r in got.items():
        print(f"{transport:17s} {streams:4d} streams  {r.us_per_chunk:6.1f} µs CPU/chunk  first-token late "
              f"p50 {r.late_p50_ms:6.2f} / p99 {r.late_p99_ms:6.2f} ms  {r.chunks_per_s:7,.0f} chunks/s  "
              f"client CPU {r.client_cpu:4.0%}  server CPU {r.server_cpu:4.0%}")
    ref, cand = got[REFERENCE], got[CANDIDATE]
    print(f"  ratio {CANDIDATE}/{REFERENCE} at {streams} streams: CPU/chunk {cand.us_per_chunk / ref.us_per_chunk:.2f}x"
          f", lateness p50 {cand.late_p50_ms / ref.late_p50_ms:.2f}x, p99 {cand.late_p99_ms / ref.late_p99_ms:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=10000, help="offered chunks/s over all streams")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--round-s", type=float, default=3.0, help="about how long one round lasts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per transport (median reported)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin server and client to separate CPUs")
    parser.add_argument("--serve", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    first_two = sorted(os.sched_getaffinity(0))[:2]
    cpus: tuple[int | None, int | None] = (first_two[0], first_two[1]) if pin else (None, None)
    if pin:
        os.sched_setaffinity(0, {first_two[1]})
    logs = ROOT / ".cache" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    where = f"server on CPU {cpus[0]}, client on CPU {cpus[1]}" if pin else "unpinned"
    print(f"offered {args.rate:,.0f} chunks/s, {args.tokens} tokens/request, {args.rounds} rounds of "
          f"~{args.round_s:g} s, {where}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"reference: {REFERENCE}")
    for streams in args.streams:
        report(streams, measure(streams, args, logs, cpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
