"""`k3load sim`: an aiohttp server speaking vLLM's OpenAI-compatible API over the sim engine.

Why aiohttp: a real asyncio server whose writes reach the socket per chunk, so a client's timing
of first tokens and inter-token gaps measures the engine model and not a buffering artefact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import signal
import sys
import uuid
from collections import OrderedDict
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from k3load.sim import faults as fault_rules
from k3load.sim import gateway, stream_parser
from k3load.sim.config import SimConfig
from k3load.sim.engine import Engine, Sequence
from k3load.sim.engine_death import EngineDeath
from k3load.sim.generate import OutputPlan, Piece, plan_output, truncate
from k3load.sim.metrics import SimMetrics
from k3load.sim.protocol import ApiError, ChunkWriter, completion, error_body, usage_body, validation_error
from k3load.sim.request_checks import effective_max_tokens, validate_request
from k3load.sim.tokenizer import prompt_token_ids, token_id, tokenize

log = logging.getLogger("k3load.sim")
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class SimServer:
    """Routes, per-request determinism and fault decisions; the engine does the scheduling."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.metrics = SimMetrics(config)
        self.engine = Engine(config, self.metrics)
        self._seen: OrderedDict[str, int] = OrderedDict()  # body hash -> times seen (bounded)
        self.front = gateway.FrontDoor(config.faults)
        self.death = EngineDeath(config.faults.engine_death_after_requests, config.faults.engine_death_exit_s)
        self.app = web.Application(client_max_size=64 * 2**20)
        self.app.add_routes([
            web.post("/v1/chat/completions", self.chat),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/version", self.version),
            web.get("/metrics", self.prom),
            web.post("/tokenize", self.tokenize),
        ])
        self.app.on_startup.append(self._start_engine)
        self.app.on_cleanup.append(self._stop_engine)
        if config.enable_request_id_headers:
            self.app.on_response_prepare.append(_echo_request_id)

    async def _start_engine(self, _app: web.Application) -> None:
        self._engine_task = asyncio.get_running_loop().create_task(self.engine.run())

    async def _stop_engine(self, _app: web.Application) -> None:
        self._engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._engine_task

    # -- simple endpoints -------------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        """As the load balancer in front answers it: flaps when health_flap_period_s is set."""
        return web.Response(status=self.death.health_status(self.front.health_status()))

    async def engine_health(self, _request: web.Request) -> web.Response:
        """The engine's own /health on the metrics port: 200 while the engine lives (a flap is the front's)."""
        return web.Response(status=self.death.health_status(200))

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": self.config.vllm_version})

    async def models(self, _request: web.Request) -> web.Response:
        card = {"id": self.config.model, "object": "model", "created": 0, "owned_by": "vllm",
                "root": self.config.model, "parent": None, "max_model_len": self.config.max_model_len,
                "permission": []}
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` (raw text) or `messages` (+ `tools`, chat template applied)."""
        try:
            body = await request.json()
            if "messages" in body:
                ids = prompt_token_ids(body["messages"], body.get("tools"))
            else:
                ids = [token_id(p) for p in tokenize(str(body["prompt"]))]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            return _error(400, f"Invalid tokenize request: {exc}", "BadRequestError")
        return web.json_response({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                                  "token_strs": None})

    async def prom(self, request: web.Request) -> web.Response:
        """/metrics through the gateway: refused when metrics_http_status is set, else the engine's."""
        refusal = self.front.metrics_refusal()
        if refusal is not None:
            return refusal
        return await self.engine_prom(request)

    async def engine_prom(self, _request: web.Request) -> web.Response:
        """The engine's /metrics (also on the metrics port), held while the stall window is open."""
        await self.front.stall()
        self.engine.refresh_memory()
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def metrics_app(self) -> web.Application:
        """The second listener of `metrics_port`: the engine's /metrics and /health, nothing else."""
        app = web.Application()
        app.add_routes([web.get("/metrics", self.engine_prom), web.get("/health", self.engine_health)])
        return app

    # -- chat -------------------------------------------------------------------------------------
    def _rng(self, raw: bytes) -> random.Random:
        """Seed from (seed, body, occurrence): identical requests replay identically run to run,
        while a retry of the same body gets its own draw."""
        digest = hashlib.sha256(raw).hexdigest()
        nth = self._seen.pop(digest, 0)
        self._seen[digest] = nth + 1
        if len(self._seen) > 100_000:
            self._seen.popitem(last=False)
        return random.Random(f"{self.config.seed}:{digest}:{nth}")

    def _greedy_key(self, body: dict[str, Any]) -> str | None:
        """At temperature 0 a model is greedy: what it writes depends only on the request. The key is
        (seed, the body without `stream` and `stream_options`, canonical), so a streamed request and its
        whole twin, every retry, and a control pair's warm twin (the cold one's bytes again) share it.
        None at any other temperature."""
        temperature = body.get("temperature")
        if type(temperature) not in (int, float) or temperature != 0:
            return None
        twin = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        text = json.dumps(twin, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return f"{self.config.seed}:greedy:{hashlib.sha256(text.encode()).hexdigest()}"

    def _plan_rng(self, body: dict[str, Any], fault_rng: random.Random) -> random.Random:
        """The generator the answer is planned from: the greedy key's at temperature 0 (the same request
        plans the same answer, while the stack's faults stay drawn per attempt, so a retry can escape
        one); otherwise the attempt's draws, as it always did."""
        key = self._greedy_key(body)
        return fault_rng if key is None else random.Random(key)

    def _greedy_model_faults(self, body: dict[str, Any], fault: fault_rules.FaultDecision) -> fault_rules.FaultDecision:
        """A weak model is the model: at temperature 0 it fails the same request the same way every time,
        cold or warm, streamed or whole, so the draw comes from the greedy key (its own generator, so the
        answer's draws are unchanged). Drawn per attempt, a cached twin would break at random where its
        cold twin did not, and the cache would be blamed for the model. A model that skips tool calls is
        the model's choice too (the same request answered in prose every time), and only under tool_choice
        auto: required and named choices force the call. So is K3 leaving out its think-to-answer transition
        (vllm#53246): the matrix's cache rule failed on its coin flips as it had on the weak model's."""
        key = self._greedy_key(body)
        rate, skip = self.config.faults.weak_answer_rate, self.config.faults.skip_tool_call_rate
        if key is not None and rate > 0:
            fault = dataclasses.replace(fault, weak_answer=random.Random(f"{key}:weak").random() < rate)
        if key is not None and skip > 0:  # a model that skips a call skips it for the same request every time
            fault = dataclasses.replace(fault, skip_tool_call=random.Random(f"{key}:skip").random() < skip)
        missing = self.config.faults.missing_think_transition_rate
        if key is not None and missing > 0:  # K3 omitting its think-to-answer transition is the model too
            fault = dataclasses.replace(fault, missing_think_transition=random.Random(f"{key}:think").random()
                                        < missing)
        if body.get("tool_choice", "auto") != "auto":  # required / named: decoding forces the call
            fault = dataclasses.replace(fault, skip_tool_call=False)
        return fault

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.front.saw_chat()
        dead = self.death.on_chat()
        if dead is not None:
            return dead
        raw = await request.read()
        try:
            body = json.loads(raw)
            validate_request(body, self.config)
            prompt_ids = prompt_token_ids(body["messages"], body.get("tools"))
            max_tokens = effective_max_tokens(body, len(prompt_ids), self.config)
        except json.JSONDecodeError as exc:
            err = validation_error("json_invalid", f"body.{exc.pos}", "JSON decode error", 0, exc.msg)
            return web.json_response(err.body(), status=400)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        rng = self._rng(raw)
        fault = fault_rules.decide(self.config.faults, rng, self.config.time_scale)
        if fault.connection_reset:
            gateway.reset(request)  # before any response byte
            return web.Response(status=499)  # never reaches the client: the socket is gone
        if fault.http_error:
            return gateway.injected_error(self.config.faults)
        fault = self._greedy_model_faults(body, fault)
        rng = self._plan_rng(body, rng)
        answer_len = rng.randint(self.config.answer_tokens_min, self.config.answer_tokens_max)
        plan = plan_output(body, rng, self.config.reasoning_tokens, answer_len, self.config.tool_call_style)
        plan = truncate(fault_rules.apply_to_plan(plan, fault), max_tokens, bool(body.get("ignore_eos")), rng,
                        body.get("min_tokens") or 0)
        if body.get("stream"):  # the streaming parser's own failures; the whole twin never has them
            crowded = self.engine.held + 1 >= self.config.faults.stream_empty_tool_calls_min_running
            plan = stream_parser.apply_streaming(plan, fault, crowded)
        seq = Sequence(request_id="", prompt_ids=prompt_ids, plan=plan, max_tokens=max_tokens)
        self.engine.submit(seq)
        writer = ChunkWriter(self.config.model, self.config.vllm_version,
                             named_tool=isinstance(body.get("tool_choice"), dict), has_tools=bool(body.get("tools")),
                             request_id=request.headers.get("X-Request-Id"))
        try:
            if body.get("stream"):
                return await self._stream(request, body, seq, writer, fault)
            response = await self._complete(seq, writer)
            self._count_parser(body, seq, streaming=False)
            return response
        finally:
            if not (fault.ignore_disconnect and sys.exc_info()[0] is not None):
                self.engine.abort(seq)  # no-op when it finished; frees KV when the client went away
            # else the fault: the client went away and the engine never hears of it, decoding on to the end

    def _usage(self, seq: Sequence) -> dict[str, Any]:
        cache = None
        if self.config.enable_prompt_tokens_details:
            full = len(seq.prompt_ids) // self.config.block_size * self.config.block_size
            created = max(full - seq.cached_tokens, 0) if self.config.enable_prefix_caching else 0
            cache = (seq.cached_tokens, created)
        return usage_body(len(seq.prompt_ids), seq.generated, cache,
                          sum(1 for p in seq.plan.pieces[: seq.generated] if p.kind == "reasoning"))

    def _count_parser(self, body: dict[str, Any], seq: Sequence, streaming: bool, chunks: int = 1) -> None:
        """As vLLM 0.32 counts: only auto tool choice runs the parser, once per streamed chunk."""
        if body.get("tools") and body.get("tool_choice", "auto") == "auto":
            called = any(p.kind in ("tool_header", "tool_whole") for p in seq.plan.pieces[: seq.generated])
            for _ in range(chunks):
                self.metrics.count_parser(streaming, called)

    def _think_s(self, plan: OutputPlan) -> float:
        """Wall seconds of thinking added after each reasoning token: --think-ms spread over the answer's
        reasoning tokens. Added on the wire (the engine's steps, KV and batch seats are not held longer)."""
        tokens, think_ms = plan.reasoning_token_count, self.config.think_ms
        return self.config.time_s(think_ms) / tokens if tokens > 0 and think_ms > 0 else 0.0

    async def _complete(self, seq: Sequence, writer: ChunkWriter) -> web.Response:
        pieces: list[Piece] = []
        while (item := (await seq.queue.get())[0]) is not None:
            pieces.append(item)
        if think_s := self._think_s(seq.plan):
            await asyncio.sleep(think_s * sum(1 for p in pieces if p.kind == "reasoning"))
        return web.json_response(completion(writer, seq.plan, pieces, self._usage(seq)))

    async def _stream(self, request: web.Request, body: dict[str, Any], seq: Sequence, writer: ChunkWriter,
                      fault: fault_rules.FaultDecision) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        last = len(seq.plan.pieces)
        cut_at = max(last // 2, 1)
        count = 0
        burst_s = fault.tool_args_burst_s  # vllm#50604: silence before the first tool-call delta
        think_s = self._think_s(seq.plan)
        while (piece := (await seq.queue.get())[0]) is not None:
            if count == 0:
                if fault.slow_first_token_s:
                    await asyncio.sleep(fault.slow_first_token_s)
                await _send(resp, writer.role())
            elif fault.slow_drip_s:
                await asyncio.sleep(fault.slow_drip_s)
            if burst_s and piece.kind in stream_parser.TOOL_DELTA_KINDS:
                await asyncio.sleep(burst_s)
                burst_s = 0.0
            count += 1
            if count == cut_at and (fault.midstream_error or fault.truncate_stream or fault.midstream_reset):
                return await self._break_stream(request, resp, fault)
            if count == last:
                self._count_parser(body, seq, streaming=True, chunks=count)
                await _send(resp, writer.finish(seq.plan.finish_reason, piece, seq.plan))
            elif (chunk := writer.delta(piece, seq.plan)) is not None:
                await _send(resp, chunk)
            if think_s and piece.kind == "reasoning":  # the first reasoning token on time, the answer later
                await asyncio.sleep(think_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            await _send(resp, writer.usage(self._usage(seq)))
        await resp.write(b"data: [DONE]\n\n")
        if fault.hold_after_done_s and not await gateway.hold_open(request, fault.hold_after_done_s):
            return resp  # the client left while the body was held: nothing more to send
        await resp.write_eof()
        return resp

    async def _break_stream(self, request: web.Request, resp: web.StreamResponse,
                            fault: fault_rules.FaultDecision) -> web.StreamResponse:
        if fault.midstream_error:
            await _send(resp, error_body(500, "k3load sim: injected engine error mid-stream",
                                         "InternalServerError"))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        elif fault.midstream_reset:
            gateway.reset(request)  # a reset (RST), not a clean close
        elif request.transport is not None:
            request.transport.close()  # truncated: no finish chunk, no [DONE]
        return resp


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's XRequestIdMiddleware (entrypoints/serve/middleware/x_request_id.py): every response carries
    the request's X-Request-Id, or a fresh one."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id", uuid.uuid4().hex)


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _error(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response(error_body(status, message, err_type), status=status)


def startup_kv_lines(config: SimConfig) -> list[str]:
    """vLLM's own start-up lines about the KV pool it reserved (vllm/v1/worker/gpu_worker.py
    `determine_available_memory`, vllm/v1/core/kv_cache_utils.py), so a run reads the sim's reservation where
    it reads a real server's."""
    tokens = config.num_gpu_blocks * config.block_size
    pool_gib = tokens * config.kv_bytes_per_token / config.gpu_count / 2**30  # one worker's share, as vLLM logs it
    return [f"INFO [gpu_worker.py:760] Available KV cache memory: {pool_gib:.2f} GiB",
            f"INFO [kv_cache_utils.py:2328] GPU KV cache size: {tokens:,} tokens, Maximum concurrency for "
            f"{config.max_model_len:,} tokens per request: {tokens / config.max_model_len:.2f}x"]


async def serve(config: SimConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM; prints the URL once listening (port 0 picks a free one)."""
    server = SimServer(config)
    runner = web.AppRunner(server.app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    host, port = runner.addresses[0][:2]
    metrics_runner = await _start_metrics_port(server, config) if config.metrics_port else None
    for line in startup_kv_lines(config):
        print(line, flush=True)
    print(f"k3load sim (a stand-in, never evidence) listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runner.cleanup()


async def _start_metrics_port(server: SimServer, config: SimConfig) -> web.AppRunner:
    """Serve the engine's /metrics and /health on a second port of the same host (-1: a free one), as
    an engine whose metrics are reachable on another address than its API gateway. Its line is printed
    before the `listening on` line, so whoever waits for that one has both."""
    runner = web.AppRunner(server.metrics_app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, max(config.metrics_port, 0), reuse_address=True)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"k3load sim metrics on http://{host}:{port}/metrics", flush=True)
    return runner
