"""The sim's GPU memory, as vLLM really uses it (not as its KV pool fills).

Why a model of its own: vLLM reserves each card's share at start-up. `Worker.determine_available_memory`
(vllm/v1/worker/gpu_worker.py) profiles a forward pass and sizes the KV pool so that the process uses
up to `--gpu-memory-utilization` of the card (default 0.9; the K3 recipe's 0.95); the CUDA context and
NCCL buffers sit beside it. From the first scrape, NVML and dcgm-exporter show that reservation, flat
under any load: the pool is preallocated and PyTorch's caching allocator keeps what it freed. How full
the cache is shows in `vllm:kv_cache_usage_perc` only (../shared/notes/production-facts.md). What moves
"used" on a real node is memory outside the pool: a prefill needing more than was profiled (the
allocator keeps its high-water mark), or a leak. Those are the two faults modelled here; either one
past the card's memory is a CUDA out-of-memory crash.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3load.sim.config import SimConfig


@dataclass
class GpuMemory:
    """One card's memory (every simulated GPU holds the same: tensor parallelism splits evenly)."""

    config: SimConfig
    crept_mib: float = 0.0  # grown outside the pool since serving began, never given back (fault)
    serving_since: float | None = None  # time.monotonic() of the first request admitted
    prefill_high_water_mib: float = 0.0  # the largest prefill buffer so far, kept by the caching allocator (fault)

    @property
    def total_mib(self) -> float:
        return float(self.config.gpu_memory_mib)

    @property
    def reserved_mib(self) -> float:
        """Weights, activations and the KV pool: `--gpu-memory-utilization` of the card, taken at start."""
        return self.config.gpu_memory_utilization * self.config.gpu_memory_mib

    @property
    def used_mib(self) -> float:
        return self.reserved_mib + self.config.gpu_context_mib + self.crept_mib + self.prefill_high_water_mib

    @property
    def free_mib(self) -> float:
        return max(self.total_mib - self.used_mib, 0.0)

    def creep_to(self, now: float) -> str | None:
        """The leak fault, in wall time since serving began (`now`: time.monotonic()); an OOM message past the
        card. Wall time rather than busy time: a steady soak then shows one straight line, as a leak does."""
        rate = self.config.faults.gpu_memory_creep_mib_per_s
        if rate <= 0 or self.serving_since is None:
            return None
        grown = rate * (now - self.serving_since)
        if self.reserved_mib + self.config.gpu_context_mib + grown + self.prefill_high_water_mib > self.total_mib:
            return self.oom_message(grown - self.crept_mib, "memory creeping outside the KV pool since serving began")
        self.crept_mib = grown
        return None

    def prefill(self, prompt_tokens: int) -> str | None:
        """The prefill-spike fault: the buffer a prompt of this length needs; an OOM message if it does not fit."""
        need = self.config.faults.prefill_spike_mib_per_1k_tokens * prompt_tokens / 1000
        extra = need - self.prefill_high_water_mib  # the allocator already holds its high-water mark
        if extra <= 0:
            return None
        if self.used_mib + extra > self.total_mib:
            return self.oom_message(extra, f"a {prompt_tokens}-token prefill beyond the profiled activations")
        self.prefill_high_water_mib = need
        return None

    def oom_message(self, asked_mib: float, why: str) -> str:
        """PyTorch's own wording (torch.OutOfMemoryError), which the log tail flags as an OOM line."""
        return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {asked_mib / 1024:.2f} GiB. "
                f"GPU 0 has a total capacity of {self.total_mib / 1024:.2f} GiB of which "
                f"{self.free_mib:.2f} MiB is free. (k3load sim: {why})")
