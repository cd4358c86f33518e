"""The host's mirror of the device block pool, kept for planning: the scheduler decides who runs,
and what the step's pool operations are, on it, so the device replays them and cannot fail.

The device pool is the owner of every fact here. After each call it returns a `PoolDelta`: the
rows of the slots that ran (or just the entries that may have changed), their lengths and block
versions, and the free count; frees the host itself decides are applied here at once. Every update
costs the rows it touches, never the capacity (`max_num_seqs x max_blocks_per_seq`) nor the pool.
Tests check the mirror against the device pool (`check_against`).

It also follows the device's free queue as far as eviction needs (for the prefix cache's host
tier): a freed block holding a cache entry goes to the queue's tail and every other free block is
handed out before it (`block_pool`'s order), so the queue is always [blocks without an entry] +
`cached_tail`, and the next n hand-outs take the first n - (num_free - len(cached_tail)) blocks of
`cached_tail`. The frees of one device call return blocks in the device's processing order (skips
before frees, slots in plan order, each tail block first, a shared block at its last release),
which `settle` replays from what each host release recorded.
"""
from __future__ import annotations

import numpy as np

from paged_jax.core import block_pool
from paged_jax.core.model_output import PoolDelta


class PoolMirror:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        self.block_size = block_size
        self.tables = np.zeros((max_seqs, max_blocks_per_seq), np.int32)
        self.lens = np.zeros(max_seqs, np.int32)
        self.skipped = np.zeros(max_seqs, np.int32)  # leading entries unmapped by a sliding window
        self.ref = np.zeros(num_blocks, np.int32)
        self.version = np.zeros(num_blocks, np.int32)  # as last seen; the device bumps it on hand-out
        self.num_free = num_blocks - 1
        self.cached = np.zeros(num_blocks, bool)  # the device's `cached` flags, marks included once sent
        self.cached_tail: dict[int, None] = {}  # free blocks appended to the device queue's tail, in order
        self.released: list[tuple[bool, np.ndarray]] = []  # (by a skip, blocks tail first) since `settle`

    def num_blocks_of(self, slot: int) -> int:
        return -(-int(self.lens[slot]) // self.block_size)

    def slot_blocks(self, slot: int) -> np.ndarray:
        """The blocks `slot` holds (its skipped, null entries left out)."""
        row = self.tables[slot, : self.num_blocks_of(slot)]
        return row[row > 0]

    def blocks_freed_by(self, slot: int) -> int:
        """Blocks that would return to the free queue if `slot` were released now."""
        return int(np.sum(self.ref[self.slot_blocks(slot)] == 1))

    def release(self, slot: int) -> None:
        """The host freed `slot` (the device frees it at the start of the next call)."""
        blocks = self.slot_blocks(slot)
        self.released.append((False, blocks[::-1]))
        np.subtract.at(self.ref, blocks, 1)
        self.num_free += int(np.sum(self.ref[blocks] == 0))
        self.tables[slot, : self.num_blocks_of(slot)] = 0
        self.lens[slot] = self.skipped[slot] = 0

    def remove_skipped(self, slot: int, num_skipped: int) -> int:
        """Entries [0, num_skipped) of `slot` fell out of the sliding window (the device unmaps them
        before the next call) -> the blocks that returned to the free queue."""
        row = self.tables[slot, :num_skipped]
        blocks = row[row > 0]
        self.released.append((True, blocks[::-1]))
        np.subtract.at(self.ref, blocks, 1)
        freed = int(np.sum(self.ref[blocks] == 0))
        self.num_free += freed
        row[:] = 0
        self.skipped[slot] = num_skipped
        return freed

    def settle(self) -> None:
        """The releases since the last call are planned for the next device call: the blocks they
        return that hold a cache entry join `cached_tail` in the order the device appends them."""
        if not self.released:
            return
        order = np.concatenate([blocks for skip in (True, False) for by_skip, blocks in self.released
                                if by_skip == skip])
        self.released = []
        first_from_end = np.unique(order[::-1], return_index=True)[1]
        returned = order[np.sort(len(order) - 1 - first_from_end)]  # each block at its last release
        returned = returned[(self.ref[returned] == 0) & self.cached[returned]]
        self.cached_tail.update(dict.fromkeys(returned.tolist()))

    def next_evictions(self, num_new: int, revived) -> list[int]:
        """The cached blocks the next call's `num_new` hand-outs take (after settle), once the prefix
        hits of `revived` took their blocks out of the queue."""
        ahead = self.num_free - len(self.cached_tail)  # handed out before any block with an entry
        evicted = []
        for block in self.cached_tail:
            if len(evicted) >= num_new - ahead:
                break
            if block not in revived:
                evicted.append(block)
        return evicted

    def uncache_all(self) -> None:
        """The device dropped every cache flag (blocks keep their queue positions)."""
        self.cached[:] = False

    def apply(self, delta: PoolDelta) -> list[int]:
        """Take a device call's changes -> the blocks it handed out again (their old prefix-cache
        entries are gone: vLLM's `_maybe_evict_cached_block`)."""
        reissued = []
        for i in np.flatnonzero(delta.slots >= 0):
            slot, start = int(delta.slots[i]), int(delta.start[i])
            old_nb, new_nb = self.num_blocks_of(slot), -(-int(delta.seq_lens[i]) // self.block_size)
            end = min(start + delta.blocks.shape[1], new_nb)
            blocks, versions = delta.blocks[i, : end - start], delta.versions[i, : end - start]
            fresh = np.arange(start, end) >= old_nb  # entries the mirror did not have
            np.add.at(self.ref, blocks[fresh], 1)
            for block in blocks[fresh].tolist():  # handed out, or revived by a prefix hit
                self.cached_tail.pop(block, None)
            newer = versions != self.version[blocks]
            reissued += blocks[newer].tolist()
            self.cached[blocks[newer]] = False
            self.version[blocks] = versions
            self.tables[slot, start:end] = blocks
            self.lens[slot] = delta.seq_lens[i]
        self.num_free = int(delta.num_free)
        return reissued

    def check_against(self, pool) -> None:
        """Tests: the mirror equals the device pool; AssertionError naming what differs."""
        assert np.array_equal(self.tables, np.asarray(pool.block_tables)), "block tables differ"
        assert np.array_equal(self.lens, np.asarray(pool.seq_lens)), "seq_lens differ"
        assert np.array_equal(self.ref, np.asarray(pool.ref_cnt)), "ref counts differ"
        assert self.num_free == int(pool.num_free_blocks), f"free {self.num_free} != {int(pool.num_free_blocks)}"
        mapped = self.tables[self.tables > 0]
        assert np.array_equal(self.version[mapped], np.asarray(pool.version)[mapped]), "versions differ"
        assert np.array_equal(self.cached, np.asarray(pool.cached)), \
            f"cached flags differ at {np.flatnonzero(self.cached != np.asarray(pool.cached)).tolist()}"
        queue = block_pool.free_order(pool).tolist()
        tail = list(self.cached_tail)
        assert queue[len(queue) - len(tail):] == tail, f"the free queue {queue} does not end with {tail}"
