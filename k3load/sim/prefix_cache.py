"""The sim's KV block pool with a hash-addressed prefix cache, modelled on vLLM's v1 BlockPool.

Why a real one: pillar 3 must be rehearsed against a cache that behaves like vLLM's, including the
ways it legitimately fails to hit (different bytes, eviction under capacity, a prefix shorter than
the hybrid state-checkpoint grid). Blocks are chained by hash so a hit needs an identical prefix;
freed blocks stay findable until the LRU order hands them out again (that is eviction).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of a token sequence (a partial last block has none)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = array("I", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """Fixed number of KV blocks; free blocks kept in LRU order, cached ones indexed by hash.

    Block 0 is vLLM's null block: its BlockPool takes the first free block as a placeholder no request gets,
    and `get_usage` divides by num_gpu_blocks - 1 (vllm/v1/core/block_pool.py, 0.32), so a real CPU server of
    24 blocks gives requests 23 and reads 11 of them as 0.478. The sim gives and counts the same."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of the blocks requests can hold that live requests hold (vLLM's kv_cache_usage_perc)."""
        usable = self.num_blocks - 1
        return (usable - len(self._free)) / usable if usable else 0.0

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`."""
        hit: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a hit); a free one leaves the eviction queue."""
        for block in blocks:
            if self._ref[block] == 0:
                self._free.pop(block, None)
            self._ref[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks, evicting the least recently freed cached ones; None if too few."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:
                self._hash[block] = None
                if self._cached.get(old) == block:
                    del self._cached[old]
                    self.evictions += 1
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a computed full block findable by later requests."""
        if self._hash[block] is None and block_hash not in self._cached:
            self._hash[block] = block_hash
            self._cached[block_hash] = block

    def free(self, blocks: list[int]) -> None:
        """Drop references; tail blocks are queued first so they are evicted before the shared head."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def reset(self) -> None:
        """Forget every cached hash (as vLLM's /reset_prefix_cache); live blocks keep their data."""
        for block, h in enumerate(self._hash):
            if h is not None:
                self._hash[block] = None
        self._cached.clear()


def cacheable_hit_tokens(hit_blocks: int, prompt_len: int, block_size: int, hybrid_block_size: int) -> int:
    """Tokens a request may reuse: never the whole prompt (the last token is recomputed, as in vLLM),
    and in hybrid mode only up to a state-checkpoint boundary (KDA/mamba state is not per token)."""
    tokens = min(hit_blocks, (prompt_len - 1) // block_size) * block_size
    if hybrid_block_size:
        tokens -= tokens % hybrid_block_size
    return max(tokens, 0)
