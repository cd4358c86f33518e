"""The scheduler's use of host memory (core/host_pool.py holds the blocks' bookkeeping): preemption
by swapping (vLLM V0's preemption_mode="swap", the paper's section 4.5) and the prefix cache's host
tier, which keeps the cached blocks the device hands out again and copies them back on a hit.
Without a host pool every method is a no-op, so the scheduler asks no question first."""
from __future__ import annotations

from typing import TYPE_CHECKING

from paged_jax.core.host_pool import HostBlockPool
from paged_jax.core.prefix_cache import PrefixCache
from paged_jax.core.sequence import Sequence

if TYPE_CHECKING:  # it builds on this module
    from paged_jax.core.kv_cache_manager import KVCacheManager


class HostMemory:
    def __init__(self, pool: HostBlockPool | None, *, swap_preemption: bool, tier: bool, block_size: int):
        self.pool = pool
        self.swap_preemption = swap_preemption and pool is not None
        self.tier = tier and pool is not None
        self.block_size = block_size
        self._tier_out: list[tuple[int, int]] = []  # evictions since the last plan: (device, host) copies
        self.reset_counters()

    def reset_counters(self) -> None:
        self.num_swap_preemptions = 0  # preemptions by swapping
        self.num_swap_fallbacks = 0  # swap preemptions the full host pool turned into recomputes
        self.num_tier_hit_tokens = 0  # prompt tokens whose KV a prefix hit copied back from the tier

    # -- the prefix cache's host tier ----------------------------------------------------------

    def keep_evicted(self, evicted: list[int], prefix_cache: PrefixCache) -> None:
        """The cached device blocks about to be handed out again: each gets a host block under its
        hash, copied out before the step writes it (one that a swap-out of the same plan copies
        anyway is gathered once: the runner gathers each device block once)."""
        if not self.tier:
            return
        for block in evicted:
            block_hash = prefix_cache.hash_of.get(block)
            host = None if block_hash is None else self.pool.store(block_hash)
            if host is not None:
                self._tier_out.append((block, host))

    def take_tier_out(self) -> list[tuple[int, int]]:
        """The copies a plan carries out: every eviction since the last plan."""
        copies, self._tier_out = self._tier_out, []
        return copies

    def tier_hits(self, seq: Sequence, num_device_hits: int) -> list[int]:
        """Host blocks continuing a prefix hit past the device's run (the tail of a chain is evicted
        first, so the device keeps the start); at most (num_tokens - 1) // block_size in all."""
        if not self.tier or seq.request.skip_reading_prefix_cache:
            return []
        end = (seq.num_tokens - 1) // self.block_size
        return self.pool.lookup(seq.block_hashes[num_device_hits:end])

    def count_tier_hit(self, num_blocks: int) -> None:
        self.num_tier_hit_tokens += num_blocks * self.block_size

    def reset_tier(self) -> None:
        if self.tier:
            self.pool.reset_tier()

    # -- swapping ------------------------------------------------------------------------------

    def swap_out(self, victim: Sequence, kv: KVCacheManager, swap_out: list[tuple[int, int]], *,
                 sliding_window: int | None) -> list[int]:
        """The victim's host blocks when it is preempted by swapping (its device -> host copies
        join `swap_out`), or [] to recompute it: in recompute mode, when it has unforked children
        or a sliding window unmapped some of its blocks, and when the host pool is full (counted)."""
        if not self.swap_preemption or victim.children or sliding_window is not None or victim.num_computed == 0:
            return []
        blocks = kv.blocks_of(victim.slot)[: -(-victim.num_computed // self.block_size)]
        host = self.pool.swap_out(blocks, kv.version(blocks), swap_out)
        self.num_swap_preemptions += host is not None
        self.num_swap_fallbacks += host is None
        return host or []

    def release(self, seq: Sequence) -> None:
        """A swapped-out sequence's host blocks go back (it finished, or it resumes: the runner reads
        them before any later swap-out can reuse them)."""
        if seq.host_blocks:
            self.pool.free(seq.host_blocks)
            seq.host_blocks = []

    def stats(self) -> dict:
        return dict(num_swap_preemptions=self.num_swap_preemptions, num_swap_fallbacks=self.num_swap_fallbacks,
                    host_kv_usage=self.pool.usage() if self.pool else 0.0,
                    host_prefix_cache_hits=self.num_tier_hit_tokens)
