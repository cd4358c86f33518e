"""The block pool's one owner (vLLM V1's KVCacheManager): the scheduler's host-side `BlockPool`
(numpy, `block_pool.init(..., host=True)`), changed only through the pool's own pure functions on
the rows an operation touches, so each costs those rows, never the capacity. The device never holds
the pool: each call receives its rows' block tables (and slots) from here.

Every operation here is planned to succeed (the scheduler checks `num_free` first); one that fails
anyway raises, naming it, instead of leaving the pool and the plan apart.
"""
from __future__ import annotations

import numpy as np

from paged_jax.core import block_pool as bp
from paged_jax.core.host_memory import HostMemory
from paged_jax.core.prefix_cache import PrefixCache, extend_block_hashes
from paged_jax.core.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int, *,
                 prefix_cache: PrefixCache | None = None, host: HostMemory | None = None,
                 sliding_window: int | None = None):
        """`prefix_cache`: the hash -> block map this pool's cached blocks are entered in; `host`: the
        host tier that keeps evicted ones; `sliding_window`: every layer's window (tokens), whose
        blocks behind it go back to the pool."""
        self.block_size = block_size
        self.pool = bp.init(num_blocks, block_size, max_seqs, max_blocks_per_seq, host=True)
        self.prefix_cache = prefix_cache or PrefixCache(enabled=False)
        self.host = host or HostMemory(None, swap_preemption=False, tier=False, block_size=block_size)
        self.sliding_window = sliding_window

    # -- what the scheduler reads -------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return int(self.pool.num_free_blocks)

    def usage(self) -> float:
        return float(bp.usage(self.pool))

    def num_mapped(self, slot: int) -> int:
        """Token slots mapped to `slot` (its computed tokens plus any reserved lookahead)."""
        return int(self.pool.seq_lens[slot])

    def num_blocks_of(self, slot: int) -> int:
        return -(-self.num_mapped(slot) // self.block_size)

    def blocks_of(self, slot: int) -> np.ndarray:
        """The blocks `slot` holds, sliding-window (null) entries left out."""
        row = self.pool.block_tables[slot, : self.num_blocks_of(slot)]
        return row[row != bp.NULL_BLOCK]

    def num_skipped(self, slot: int) -> int:
        """Leading table entries a sliding window unmapped."""
        row = self.pool.block_tables[slot, : self.num_blocks_of(slot)]
        return int(np.argmax(row != bp.NULL_BLOCK)) if np.any(row) else len(row)

    def blocks_freed_by(self, slot: int) -> int:
        """Blocks that would return to the free queue if `slot` were freed now."""
        return int(np.sum(self.pool.ref_cnt[self.blocks_of(slot)] == 1))

    def ref(self, block: int) -> int:
        return int(self.pool.ref_cnt[block])

    def version(self, blocks):
        return self.pool.version[np.asarray(blocks, np.int32)]

    def next_evictions(self, num_new: int) -> list[int]:
        """The cached blocks the next `num_new` hand-outs take from the free queue's head (vLLM's
        eviction order), before they are handed out."""
        pool = self.pool
        n = min(num_new, self.num_free)
        head = (int(pool.head) + np.arange(n)) % pool.num_blocks
        blocks = pool.queue[head]
        return blocks[pool.cached[blocks]].tolist()

    def tables_for(self, slots, pauses=None) -> tuple[np.ndarray, np.ndarray]:
        """(i32[rows, width] block tables, i32[rows] mapped token slots) of sequence slots (-1: a
        finished row, null), as wide as the most blocks one maps: what the device reads of the pool.
        `pauses`: where the first rows of a decode call stop (`reserve_lookahead`), before the end
        of what they map where a rejected tail left more."""
        slots = np.asarray(slots, np.int32)
        num_mapped = np.where(slots >= 0, self.pool.seq_lens[slots], 0).astype(np.int32)
        width = max(-(-int(num_mapped.max(initial=0)) // self.block_size), 1)
        if pauses is not None:
            num_mapped[: len(pauses)] = np.minimum(num_mapped[: len(pauses)], pauses)
        return bp.rows(self.pool, slots, width).block_tables, num_mapped

    # -- what the scheduler does --------------------------------------------------------------

    def _on_rows(self, slots, fn):
        slots = np.asarray(slots, np.int32)
        width = max([self.num_blocks_of(int(s)) for s in slots if s >= 0] + [1])
        view = bp.rows(self.pool, slots, width)
        view, *out = fn(view)
        self.pool = bp.put_rows(self.pool, view, slots)
        return out

    def allocate(self, slots, new_lens) -> list[int]:
        """Grow each slot to its new length (never shrink) -> the cached blocks this evicted (their
        prefix-cache entries are gone)."""
        slots, new_lens = np.asarray(slots, np.int32), np.asarray(new_lens, np.int32)
        need = sum(max(0, -(-int(n) // self.block_size) - self.num_blocks_of(int(s))) for s, n in zip(slots, new_lens))
        evicted = self.next_evictions(need)
        width = max(-(-int(new_lens.max(initial=1)) // self.block_size),
                    max([self.num_blocks_of(int(s)) for s in slots] + [1]))
        view = bp.rows(self.pool, slots, width)
        view, ok = bp.allocate(view, np.maximum(new_lens, view.seq_lens), max_new_blocks=max(need, 1))
        if not ok:
            raise RuntimeError(f"internal error: allocating {need} blocks for slots {slots.tolist()} "
                               f"failed with {self.num_free} free")
        self.pool = bp.put_rows(self.pool, view, slots)
        return evicted

    def free(self, slots) -> None:
        """Release the slots now, tail blocks first (vLLM's order)."""
        self._on_rows(slots, lambda view: (bp.free(view, np.ones(view.max_seqs, bool)),))

    def remove_skipped(self, slot: int, num_skipped: int) -> int:
        """Entries [0, num_skipped) of `slot` left its sliding window -> blocks returned to the queue."""
        before = self.num_free
        self._on_rows([slot], lambda view: (bp.remove_skipped(view, np.array([num_skipped], np.int32)),))
        return self.num_free - before

    def share(self, slot: int, hits: list[int], versions: list[int]) -> None:
        """Map a prefix hit's blocks into the empty `slot`."""
        if not hits:
            return
        view = bp.rows(self.pool, np.array([slot], np.int32), len(hits))
        view, ok = bp.share(view, 0, np.array(hits, np.int32), len(hits), np.array(versions, np.int32))
        if not ok:
            raise RuntimeError(f"internal error: the prefix hit {hits} (versions {versions}) is stale")
        self.pool = bp.put_rows(self.pool, view, np.array([slot], np.int32))

    def fork(self, parent: int, child: int) -> tuple[int, int]:
        """`child` becomes a copy-on-write fork of `parent` -> (copy_src, copy_dst), -1 when the
        parent ends on a block boundary; the caller copies that block's KV on the device."""
        if self.num_mapped(parent) % self.block_size:  # the child's copy of the tail takes a block
            self.evict_next_block()
        width = self.num_blocks_of(parent) + 1
        slots = np.array([parent, child], np.int32)
        view = bp.rows(self.pool, slots, width)
        view, ok, src, dst = bp.fork(view, 0, 1)
        if not ok:
            raise RuntimeError(f"internal error: forking slot {parent} into slot {child} failed")
        self.pool = bp.put_rows(self.pool, view, slots)
        return int(src), int(dst)

    def mark_cached(self, blocks: list[int]) -> None:
        if blocks:
            self.pool = bp.mark_cached(self.pool, np.array(blocks, np.int32), len(blocks))

    # -- sequences: prefix caching, the sliding window, lookahead (vLLM's request-level calls) ----

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, seqs: list[Sequence], new_lens: list[int]) -> None:
        """Grow the sequences' slots; the cached blocks handed out lose their prefix-cache entries
        (the host tier keeps a copy of each first)."""
        if seqs:
            self._forget(self.allocate([s.slot for s in seqs], new_lens))

    def evict_next_block(self) -> None:
        """The next block handed out (a fork's tail copy) loses its prefix-cache entry."""
        self._forget(self.next_evictions(1))

    def _forget(self, evicted: list[int]) -> None:
        """Cached blocks handed out again: the host tier keeps a copy (their hashes are read before
        the entries go), then the prefix cache drops them."""
        self.host.keep_evicted(evicted, self.prefix_cache)
        self.prefix_cache.evict(evicted)

    def lookahead_len(self, seq: Sequence, computed: int, num_output: int, num_decode_steps: int) -> int:
        """Token slots a decoding row can use in one decode call that starts with `computed` tokens
        in the cache and `num_output` sampled: num_decode_steps more (fewer near its max_tokens),
        within the longest table."""
        steps = 1 if seq.request.one_step_per_call else num_decode_steps
        if seq.request.params.max_tokens is not None:
            steps = min(steps, seq.request.params.max_tokens - num_output)
        return min(computed + max(steps, 0), self.pool.max_seq_len)

    def reserve_lookahead(self, seqs: list[Sequence], computed: list[int], num_output: list[int],
                          num_decode_steps: int) -> bool:
        """vLLM's lookahead slots: before a decode call every row gets the blocks of the tokens the
        call may add (row i starts with computed[i] tokens in the cache and num_output[i] sampled;
        `lookahead_len`): the most steps J (up to num_decode_steps) whose blocks all rows can have
        at once; each row pauses at its J-th token (the call stops it there). No row is preempted
        for lookahead: preemption happens exactly when a row cannot get its next token's block, and
        the call then stops where the pool ran dry, as the in-loop allocation it replaces did.
        -> where each row pauses: its J-th token, or further where its table maps more (a
        rejected tail), up to num_decode_steps and its end; None where a row that can still run
        got no step."""
        ends = [self.lookahead_len(seq, c, o, num_decode_steps) for seq, c, o in zip(seqs, computed, num_output)]
        mapped = [self.num_mapped(seq.slot) for seq in seqs]
        have = [self.num_blocks_for(m) for m in mapped]

        def targets(steps):
            return [max(min(c + steps, end), m) for c, end, m in zip(computed, ends, mapped)]

        def need(steps):
            return sum(max(0, self.num_blocks_for(t) - h) for t, h in zip(targets(steps), have))

        if need(1) > self.num_free:
            return None
        steps = 1
        while steps < num_decode_steps and need(steps + 1) <= self.num_free:
            steps += 1
        grown = targets(steps)
        self.grow(seqs, grown)
        return [min(target, end) for target, end in zip(grown, ends)]

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry, the host tier's too; False, changing nothing, while any
        block is held by a request."""
        if self.num_free != self.pool.num_blocks - 1:
            return False
        self.prefix_cache.reset()
        self.pool = bp.uncache_all(self.pool)
        self.host.reset_tier()
        return True

    def remove_skipped_blocks(self, seq: Sequence, computed: int | None = None) -> None:
        """vLLM's SlidingWindowManager.remove_skipped_blocks: the next token (position num_computed)
        and every later one attend to positions > num_computed - window, so the blocks wholly before
        that go back to the pool (the table entry becomes the null block). A long generation then
        holds about window / block_size + 1 blocks, not its whole length. `computed`: the tokens it
        will have in the cache when the next call starts (an overlapped call), else num_computed."""
        if self.sliding_window is None:
            return
        computed = seq.num_computed if computed is None else computed
        skipped = max(0, computed - self.sliding_window + 1) // self.block_size
        if skipped > self.num_skipped(seq.slot):
            self.remove_skipped(seq.slot, skipped)

    def prefix_hits(self, seq: Sequence) -> list[tuple[int, int]]:
        """Leading cached blocks (block, version); at most (num_tokens - 1) // bs, so a fully cached
        prompt still computes its last token for logits (vLLM). Every entry is current: the map
        drops one as soon as the pool hands its block out again. A request that skips reading the
        cache (Request.skip_reading_prefix_cache) reads none, but its blocks still enter it."""
        if seq.request.skip_reading_prefix_cache:
            return []
        return self.prefix_cache.candidates(seq.block_hashes, (seq.num_tokens - 1) // self.block_size)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's computed full blocks in the prefix cache (prompt and output alike,
        so a follow-up turn that repeats the conversation hits)."""
        if not self.prefix_cache.enabled or seq.slot < 0:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.request.block_hash_key)
        full = min(seq.num_computed, seq.num_tokens) // self.block_size
        table = self.pool.block_tables[seq.slot]
        marks = []
        for i in range(seq.num_cached_blocks, full):
            block = int(table[i])
            if block > 0 and self.prefix_cache.insert(seq.block_hashes[i], block, int(self.version(block))):
                marks.append(block)
        self.mark_cached(marks)
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def stats(self) -> dict:
        used, usable, cache = self.pool.num_blocks - 1 - self.num_free, self.pool.num_blocks - 1, self.prefix_cache
        return dict(kv_cache_usage=used / usable, num_blocks_used=used, prefix_cache_queries=cache.queries,
                    prefix_cache_hits=cache.hits, prefix_cache_hit_rate=cache.hits / max(cache.queries, 1),
                    **self.host.stats())

    def reset_counters(self) -> None:
        self.prefix_cache.queries = self.prefix_cache.hits = 0
        self.host.reset_counters()
