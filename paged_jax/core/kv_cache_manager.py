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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        self.block_size = block_size
        self.pool = bp.init(num_blocks, block_size, max_seqs, max_blocks_per_seq, host=True)

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

    def tables(self, slots, width: int) -> np.ndarray:
        """i32[len(slots), width]: the rows' block tables cut to `width` (-1 slots: null rows)."""
        return bp.rows(self.pool, np.asarray(slots, np.int32), width).block_tables

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

    def uncache_all(self) -> None:
        self.pool = bp.uncache_all(self.pool)
