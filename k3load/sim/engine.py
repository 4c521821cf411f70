"""The sim's engine: a step loop with vLLM's scheduling shape (v1 scheduler, recompute preemption).

Why a step loop: the effects pillar 2 and 3 must see come out of it rather than being scripted.
Time to first token grows with uncached prompt tokens and with the queue; inter-token delay grows
with the batch; a starved KV pool preempts the newest request; the prefix cache saves prefill.
Each step costs `step_base + per_seq x batch + per_token x prefill tokens` model-milliseconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from k3load.sim import faults as fault_rules
from k3load.sim.config import SimConfig
from k3load.sim.generate import OutputPlan, Piece
from k3load.sim.gpu_memory import GpuMemory
from k3load.sim.metrics import SimMetrics
from k3load.sim.prefix_cache import BlockPool, block_hashes, cacheable_hit_tokens

log = logging.getLogger("k3load.sim")


@dataclass(eq=False)  # identity: the engine looks sequences up in its queues on every step
class Sequence:
    """One admitted request as the engine sees it; events go to `queue` as (piece | None, time)."""

    request_id: str
    prompt_ids: list[int]
    plan: OutputPlan
    max_tokens: int
    queue: asyncio.Queue[tuple[Piece | None, float]] = field(default_factory=asyncio.Queue)
    arrival_ts: float = field(default_factory=time.monotonic)
    hashes: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens with KV in the pool (prompt, then generated)
    generated: int = 0
    cached_tokens: int = 0  # prefix hits at first admission (reported in usage)
    admitted_once: bool = False
    preemptions: int = 0
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished: bool = False

    @property
    def target_len(self) -> int:
        """Prompt plus generated tokens: all need KV before the next token is sampled."""
        return len(self.prompt_ids) + self.generated

    @property
    def prefill_target(self) -> int:
        """Tokens to (re)compute before decoding: the prompt, plus output kept across a preemption."""
        return len(self.prompt_ids) + max(self.generated - 1, 0)

    @property
    def decoding(self) -> bool:
        return self.generated > 0 and self.computed >= self.prefill_target


class Engine:
    """Owns the block pool, the waiting and running queues and the step loop."""

    def __init__(self, config: SimConfig, metrics: SimMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.pool = BlockPool(config.num_gpu_blocks)
        self.memory = GpuMemory(config)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wake = asyncio.Event()
        self.steps = 0

    # -- the server's side -------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if self.memory.serving_since is None:
            self.memory.serving_since = time.monotonic()
        seq.hashes = block_hashes(seq.prompt_ids, self.config.block_size)
        self.waiting.append(seq)
        seq.plan = self._batch_variant(seq)
        self._check_oom()
        self._wake.set()

    def _batch_variant(self, seq: Sequence) -> OutputPlan:
        """The fault of an engine that is not batch-invariant (`faults.batch_dependent`): decided, as the batch
        numerics are, by the request (its prompt tokens) and the batch it joins (how many requests the engine
        holds, this one included), never by chance: the same request at the same batch size answers the same,
        and alone (below --batch-dependent-args-min-running) always as the healthy sim does."""
        f = self.config.faults
        if not f.batch_dependent_args_rate or self.held < f.batch_dependent_args_min_running or not seq.plan.tool_calls:
            return seq.plan
        prompt = hashlib.sha256(array("q", seq.prompt_ids).tobytes()).hexdigest()
        return fault_rules.batch_dependent(seq.plan, f"{self.config.seed}:{prompt}:{self.held}",
                                           f.batch_dependent_args_rate)

    @property
    def held(self) -> int:
        """Requests in the engine (running + waiting), as vLLM's two gauges add up."""
        return len(self.running) + len(self.waiting)

    def abort(self, seq: Sequence) -> None:
        """Client went away: release everything the request holds."""
        if seq.finished:
            return
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
            self.pool.free(seq.blocks)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._count_finish(seq, "abort", time.monotonic())

    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._publish_gauges()
                self._wake.clear()
                await self._wake.wait()
            cost_ms, emitted = self._step()
            await asyncio.sleep(self.config.time_s(cost_ms))
            now = time.monotonic()
            self._crash_if_oom(self.memory.creep_to(now))
            self._deliver(emitted, now)

    # -- one step -------------------------------------------------------------------------------
    def _step(self) -> tuple[float, list[Sequence]]:
        self.steps += 1
        emitted: list[Sequence] = []
        for seq in [s for s in self.running if s.decoding]:
            if seq in self.running and self._grow(seq, seq.target_len):
                seq.computed = seq.target_len
                emitted.append(seq)
        budget = self.config.max_num_batched_tokens - len(emitted)
        prefill_tokens = 0
        for seq in [s for s in self.running if not s.decoding]:
            chunk = self._prefill_chunk(seq, budget, emitted)
            budget -= chunk
            prefill_tokens += chunk
        prefill_tokens += self._admit(budget, emitted)
        self._publish_gauges()
        if self.metrics.enabled:
            self.metrics.labels(self.metrics.iteration).observe(prefill_tokens + len(emitted))
        c = self.config
        cost = c.step_base_ms + c.step_per_seq_ms * len(emitted) + c.prefill_ms_per_token * prefill_tokens
        return cost, emitted

    @staticmethod
    def _prefill_chunk(seq: Sequence, budget: int, emitted: list[Sequence]) -> int:
        """Chunked prefill within the step's token budget; the step that ends it samples a token."""
        chunk = max(min(seq.prefill_target - seq.computed, budget), 0)
        seq.computed += chunk
        if chunk and seq.computed >= seq.prefill_target:
            emitted.append(seq)
        return chunk

    def _grow(self, seq: Sequence, length: int) -> bool:
        """Make room for `length` tokens of KV, preempting the newest requests if the pool is full."""
        needed = -(-length // self.config.block_size) - len(seq.blocks)
        while needed > 0:
            fresh = self.pool.allocate(needed)
            if fresh is not None:
                seq.blocks += fresh
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop its KV, put it at the head of the queue (vLLM v1)."""
        self.running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks, seq.computed = [], 0
        self.waiting.appendleft(seq)
        seq.preemptions += 1
        if self.metrics.enabled:
            self.metrics.labels(self.metrics.preemptions).inc()

    def _admit(self, budget: int, emitted: list[Sequence]) -> int:
        """Move waiting requests into the batch while seats, blocks and token budget allow."""
        c, prefill = self.config, 0
        while self.waiting and len(self.running) < c.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            hit_blocks = [] if c.faults.prefix_cache_never_hits or not c.enable_prefix_caching \
                else self.pool.lookup(seq.hashes)
            hit_tokens = cacheable_hit_tokens(len(hit_blocks), seq.prefill_target, c.block_size,
                                              c.hybrid_block_size)
            reused = hit_blocks[: hit_tokens // c.block_size]
            self.pool.touch(reused)
            fresh = self.pool.allocate(-(-seq.prefill_target // c.block_size) - len(reused))
            if fresh is None:
                self.pool.free(reused)
                break
            self.waiting.popleft()
            seq.blocks, seq.computed = reused + fresh, hit_tokens
            self.running.append(seq)
            self._record_admission(seq, hit_tokens)
            self._crash_if_oom(self.memory.prefill(seq.prefill_target - hit_tokens))
            chunk = self._prefill_chunk(seq, budget, emitted)
            budget -= chunk
            prefill += chunk
        return prefill

    def _record_admission(self, seq: Sequence, hit_tokens: int) -> None:
        if seq.admitted_once:  # vLLM leaves preempted requests out of prefix-cache stats
            return
        seq.admitted_once = True
        seq.cached_tokens = hit_tokens
        seq.scheduled_ts = time.monotonic()
        m = self.metrics
        if m.enabled:
            prompt = len(seq.prompt_ids)
            m.labels(m.queries).inc(prompt)
            m.labels(m.hits).inc(hit_tokens)
            m.labels(m.ext_queries).inc(0)
            m.labels(m.ext_hits).inc(0)

    # -- after the step's time has passed ---------------------------------------------------------
    def _deliver(self, emitted: list[Sequence], now: float) -> None:
        for seq in emitted:
            if seq.finished or seq not in self.running:
                continue
            self._register_full_blocks(seq)
            piece = seq.plan.pieces[seq.generated]
            seq.generated += 1
            self._time_token(seq, now)
            if self.metrics.enabled:  # per token, as vLLM counts each step's: it rises while a request decodes
                self.metrics.labels(self.metrics.gen_tokens).inc()
            seq.queue.put_nowait((piece, now))
            if seq.generated >= len(seq.plan.pieces):
                self._finish(seq, now)

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Computed prompt blocks become findable only after their step (as in vLLM)."""
        if not self.config.enable_prefix_caching:
            return
        full = min(len(seq.hashes), seq.computed // self.config.block_size, len(seq.blocks))
        for index in range(full):
            self.pool.register(seq.blocks[index], seq.hashes[index])

    def _time_token(self, seq: Sequence, now: float) -> None:
        m = self.metrics
        if seq.first_token_ts is None:
            seq.first_token_ts = now
            if m.enabled:
                m.labels(m.ttft).observe(now - seq.arrival_ts)
        elif m.enabled and seq.last_token_ts is not None:
            m.labels(m.itl).observe(now - seq.last_token_ts)
        seq.last_token_ts = now

    def _finish(self, seq: Sequence, now: float) -> None:
        seq.finished = True
        self.running.remove(seq)
        self.pool.free(seq.blocks)
        self._count_finish(seq, seq.plan.finish_reason, now)
        seq.queue.put_nowait((None, now))

    def _count_finish(self, seq: Sequence, reason: str, now: float) -> None:
        m = self.metrics
        if not m.enabled:
            return
        label = {"tool_calls": "stop"}.get(reason, reason)
        m.labels(m.success, finished_reason=label).inc()
        prompt, cached = len(seq.prompt_ids), seq.cached_tokens
        m.labels(m.prompt_tokens).inc(prompt)
        m.labels(m.by_source, source="local_compute").inc(prompt - cached)
        m.labels(m.by_source, source="local_cache_hit").inc(cached)
        m.labels(m.by_source, source="external_kv_transfer").inc(0)
        m.labels(m.cached_tokens).inc(cached)
        m.labels(m.cached_by_source, source="device").inc(cached)
        m.labels(m.req_max_gen).observe(seq.max_tokens)
        m.labels(m.req_n).observe(1)
        m.labels(m.req_preemptions).observe(seq.preemptions)
        m.labels(m.e2e).observe(now - seq.arrival_ts)
        m.labels(m.req_prompt).observe(prompt)
        m.labels(m.req_gen).observe(seq.generated)
        m.labels(m.req_max_tokens).observe(seq.max_tokens)
        m.labels(m.kv_computed).observe(prompt - cached)
        if seq.scheduled_ts is not None:
            first = seq.first_token_ts or now
            m.labels(m.queue).observe(seq.scheduled_ts - seq.arrival_ts)
            m.labels(m.prefill).observe(first - seq.scheduled_ts)
            m.labels(m.decode).observe(now - first)
            m.labels(m.inference).observe(now - seq.scheduled_ts)
            if seq.generated > 1:
                m.labels(m.tpot).observe((now - first) / (seq.generated - 1))

    def _publish_gauges(self) -> None:
        m = self.metrics
        m.set_gpu_memory(self.memory.used_mib, self.memory.total_mib)  # the KV fill shows only in kv_usage
        if m.enabled:
            m.labels(m.running).set(len(self.running))
            m.labels(m.waiting).set(len(self.waiting))
            m.labels(m.waiting_by_reason, reason="capacity").set(len(self.waiting))
            m.labels(m.kv_usage).set(self.pool.usage())

    def _check_oom(self) -> None:
        """Fault: KV demand beyond the threshold kills the process the way a CUDA OOM does."""
        limit = self.config.faults.oom_kv_demand_tokens
        if not limit:
            return
        demand = sum(len(s.prompt_ids) + s.max_tokens for s in (*self.running, *self.waiting))
        if demand > limit:
            free_mib = 0
            print(f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                  f"{demand * self.config.kv_bytes_per_token // 2**20} MiB. GPU 0 has a total capacity of "
                  f"{self.config.gpu_memory_mib / 1024:.2f} GiB of which {free_mib} MiB is free. "
                  f"(k3load sim: KV demand {demand} tokens > oom_kv_demand_tokens {limit})",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def refresh_memory(self) -> None:
        """The GPU gauges as of now (a scrape between steps, or while idle, sees the creep too)."""
        self._crash_if_oom(self.memory.creep_to(time.monotonic()))
        self.metrics.set_gpu_memory(self.memory.used_mib, self.memory.total_mib)

    @staticmethod
    def _crash_if_oom(message: str | None) -> None:
        """A memory fault past the card: the process dies the way a CUDA OOM kills vLLM's engine."""
        if message:
            print(message, file=sys.stderr, flush=True)
            os._exit(1)

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.running), "waiting": len(self.waiting), "kv_usage": self.pool.usage(),
                "steps": self.steps, "evictions": self.pool.evictions}
