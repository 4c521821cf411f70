"""A paced OpenAI-compatible SSE server for client benchmarks: one engine-step clock, one token per read.

Why its own server: a client's CPU per chunk and its first-token timing only mean something against
a server that is never the bottleneck and writes like a real engine: every `step_ms` it writes one
token chunk to every open stream (the model of bench/client_cost.py's server), so each client read
holds one token, not a flood. Every response carries exactly `tokens` token chunks whatever the
request asks for, so every client (k3load, `vllm bench serve`, GuideLLM, AIPerf) gets the same
workload shape from its own request format; only the first round after start (or POST /bench/stagger)
is staggered, its lengths spread over 1..tokens, so a closed loop's streams do not end in lockstep.

First-token timing: a request joins at the next step, which writes vLLM's role chunk and the first
token chunk in one write (vLLM sends them back to back once prefill is done). That token's text is
`@<time.time()>/<time.monotonic()>`: the time it was written, on the wall clock (k3load's `*_ts`,
GuideLLM, AIPerf) and on CLOCK_MONOTONIC (`vllm bench serve`'s perf_counter start times), so a
client's first-token lateness is its receive time minus that write time, per request.

Counters for the benchmark (`--stats FILE`): token chunks written, requests started and finished,
streams open now, as four little-endian doubles rewritten every step in a 32-byte file the
benchmark reads (no HTTP poll competes with the step loop).

Endpoints: POST /v1/chat/completions and /v1/completions (streamed or whole), GET /v1/models,
/health, /version, /metrics (vLLM's request gauges), POST /tokenize (byte-level: what the harness's
prefix-reuse measurement and long-input sizing call), and GET /bench/first-tokens: the first-token
write time of every request that carried an X-Request-ID (AIPerf's records name theirs, not the text).

    .venv/bin/python bench/paced_server.py --step-ms 25.6 --tokens 128 [--stats FILE]   # prints its URL
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import mmap
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from aiohttp.http_writer import StreamWriter

MODEL = "tiny"
MAX_MODEL_LEN = 32768
STATS = struct.Struct("<4d")  # token chunks written, requests started, requests finished, streams open
PROMPT_TOKENS = 32  # what usage says: the prompt is not read


def stamp(text: str) -> float | None:
    """The wall-clock write time from an answer that starts with a first token's stamp (None: none)."""
    if not text.startswith("@"):
        return None
    try:
        return float(text[1:].split("/", 1)[0])
    except ValueError:
        return None


def _frame(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    """One vLLM-shaped `chat.completion.chunk` event."""
    return _frame({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                "token_ids": None}]})


def text_chunk(text: str, finish: str | None = None) -> bytes:
    """One vLLM-shaped `text_completion` event (the /v1/completions stream)."""
    return _frame({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})


def _tail(kind: str, tokens: int) -> bytes:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens, "total_tokens": PROMPT_TOKENS + tokens}
    return _frame({"id": "bench", "object": obj, "created": 0, "model": MODEL, "choices": [], "usage": usage}) + \
        b"data: [DONE]\n\n"


@dataclass
class Frames:
    """Pre-serialised chunks of one endpoint kind: only the first token's text is built per request."""

    kind: str  # "chat" | "text"
    tokens: int
    token: bytes = b""
    last: bytes = b""
    tail: bytes = b""
    role: bytes = b""

    def __post_init__(self) -> None:
        make = chat_chunk if self.kind == "chat" else lambda d, f=None: text_chunk(d["content"], f)
        self.token, self.last = make({"content": " token"}), make({"content": " token"}, "length")
        self.tail = _tail(self.kind, self.tokens)
        self.role = chat_chunk({"role": "assistant", "content": ""}) if self.kind == "chat" else b""

    def first(self, wall: float, only: bool) -> bytes:
        """The role chunk and the first token, stamped with the time it is written (`only`: also the last)."""
        stamp = f"@{wall:.6f}/{time.monotonic():.6f}"
        finish = "length" if only else None
        body = chat_chunk({"content": stamp}, finish) if self.kind == "chat" else text_chunk(stamp, finish)
        return self.role + body


@dataclass
class Stream:
    """One open response: how many token chunks it still gets."""

    resp: web.StreamResponse
    frames: Frames
    left: int
    done: asyncio.Future[None]
    request_id: str | None = None  # the client's X-Request-ID (AIPerf sends one)
    started: bool = False


@dataclass
class Engine:
    """The step loop and the counters the benchmark reads."""

    step_s: float
    tokens: int
    stats: mmap.mmap | None = None
    active: list[Stream] = field(default_factory=list)
    chunks: int = 0
    started: int = 0
    finished: int = 0
    first_written: dict[str, float] = field(default_factory=dict)  # X-Request-ID -> first token's write time
    streams: int = 0  # the first this many requests after `stagger_from` get staggered lengths
    stagger_from: int = 0

    def length(self) -> int:
        """Token chunks for the request starting now. A closed loop of equal answers started together
        stays in lockstep (every stream ends in the same step and the client's per-request work lands
        in one burst); the first round's lengths spread over 1..tokens put the streams' ends evenly
        over the steps, as varied answer lengths do, and every later answer is `tokens` long."""
        index = self.started - self.stagger_from
        return max(1, math.ceil(self.tokens * (index + 1) / self.streams)) if index < self.streams else self.tokens

    def publish(self) -> None:
        if self.stats is not None:
            STATS.pack_into(self.stats, 0, float(self.chunks), float(self.started), float(self.finished),
                            float(len(self.active)))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.step_s
            await asyncio.sleep(max(next_at - loop.time(), 0.0))
            if loop.time() > next_at + self.step_s:
                next_at = loop.time()  # fell a whole step behind (a stalled machine): no burst to catch up
            for stream in list(self.active):
                await self._step(stream)
            self.publish()

    async def _step(self, stream: Stream) -> None:
        if not stream.started:
            wall = time.time()
            chunk, stream.started = stream.frames.first(wall, stream.left == 1), True
            if stream.request_id is not None:
                self.first_written[stream.request_id] = wall
        else:
            chunk = stream.frames.last if stream.left == 1 else stream.frames.token
        stream.left -= 1
        self.chunks += 1
        try:
            # never wait for one client's socket to drain: a slow reader must not stall the step for every
            # other stream (an engine queues each request's output); what it has not read waits in its buffer
            # (aiohttp types the writer as the abstract one, without drain=; it is its StreamWriter, or None when gone)
            await cast(StreamWriter, stream.resp._payload_writer).write(chunk, drain=False)
        except (ConnectionError, RuntimeError, AttributeError):
            stream.left = 0  # the client went away: no more writes
        if stream.left <= 0:
            self.active.remove(stream)
            stream.done.set_result(None)


def _whole(kind: str, tokens: int) -> dict[str, Any]:
    text = " token" * tokens
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens, "total_tokens": PROMPT_TOKENS + tokens}
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "length"}
        return {"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [choice], "usage": usage}
    return {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage}


def app(engine: Engine) -> web.Application:
    frames = {kind: Frames(kind, engine.tokens) for kind in ("chat", "text")}

    def generate(kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            if not body.get("stream"):
                return web.json_response(_whole(kind, engine.tokens))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            tokens = engine.length()
            stream = Stream(resp, frames[kind], tokens, asyncio.get_running_loop().create_future(),
                            request.headers.get("X-Request-ID"))
            engine.started += 1
            engine.active.append(stream)
            try:
                await stream.done
                await resp.write(stream.frames.tail if tokens == engine.tokens else _tail(kind, tokens))
                await resp.write_eof()
            except (ConnectionError, RuntimeError):
                pass  # the client left mid-stream
            finally:
                if stream in engine.active:
                    engine.active.remove(stream)
                engine.finished += 1
            return resp

        return handler

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                              "owned_by": "bench", "root": MODEL,
                                                              "max_model_len": MAX_MODEL_LEN}]})

    async def metrics(_request: web.Request) -> web.Response:
        lines = [f'vllm:num_requests_running{{model_name="{MODEL}"}} {len(engine.active)}',
                 f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0',
                 f'vllm:request_success_total{{model_name="{MODEL}",finished_reason="length"}} {engine.finished}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages", []), sort_keys=True)
        tokens = list(str(text).encode())
        return web.json_response({"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens})

    async def first_tokens(_request: web.Request) -> web.Response:
        return web.json_response(engine.first_written)

    async def stagger(_request: web.Request) -> web.Response:
        engine.stagger_from = engine.started  # a new client: its first round is staggered again
        return web.json_response({"stagger_from": engine.stagger_from})

    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.add_routes([
        web.post("/v1/chat/completions", generate("chat")), web.post("/v1/completions", generate("text")),
        web.get("/v1/models", models), web.get("/metrics", metrics), web.post("/tokenize", tokenize),
        web.get("/bench/first-tokens", first_tokens), web.post("/bench/stagger", stagger),
        web.get("/health", lambda _r: _ok(web.Response())),
        web.get("/version", lambda _r: _ok(web.json_response({"version": "0.32.0"})))])
    return application


async def _ok(resp: web.Response) -> web.Response:
    return resp


async def serve(step_ms: float, tokens: int, streams: int, stats_path: Path | None, port: int = 0) -> None:
    stats = None
    if stats_path is not None:
        stats_path.write_bytes(b"\0" * STATS.size)
        with stats_path.open("r+b") as handle:
            stats = mmap.mmap(handle.fileno(), STATS.size)
    engine = Engine(step_ms / 1000, tokens, stats, streams=streams)
    engine.publish()
    runner = web.AppRunner(app(engine), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await engine.run()


def read_stats(stats: mmap.mmap) -> tuple[float, float, float, float]:
    """(token chunks written, requests started, requests finished, streams open) as the server left them."""
    return STATS.unpack_from(stats, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, required=True, help="engine step: one token to every stream")
    parser.add_argument("--tokens", type=int, required=True, help="token chunks in every response")
    parser.add_argument("--streams", type=int, default=0,
                        help="stagger the first this many answers' lengths (POST /bench/stagger: again from now)")
    parser.add_argument("--stats", type=Path, help="file the counters are published in")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.step_ms <= 0 or args.tokens < 1:
        parser.error("--step-ms must be positive and --tokens at least 1")
    asyncio.run(serve(args.step_ms, args.tokens, args.streams, args.stats, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
