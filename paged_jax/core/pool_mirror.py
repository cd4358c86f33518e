"""The host's mirror of the device block pool, kept for planning: the scheduler decides who runs,
and what the step's pool operations are, on it, so the device replays them and cannot fail.

The device pool is the owner of every fact here. After each call it returns a `PoolDelta`: the
rows of the slots that ran (or just the entries that may have changed), their lengths and block
versions, and the free count; frees the host itself decides are applied here at once. Every update
costs the rows it touches, never the capacity (`max_num_seqs x max_blocks_per_seq`) nor the pool.
Tests check the mirror against the device pool (`check_against`).
"""
from __future__ import annotations

import numpy as np

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
        np.subtract.at(self.ref, blocks, 1)
        self.num_free += int(np.sum(self.ref[blocks] == 0))
        self.tables[slot, : self.num_blocks_of(slot)] = 0
        self.lens[slot] = self.skipped[slot] = 0

    def remove_skipped(self, slot: int, num_skipped: int) -> int:
        """Entries [0, num_skipped) of `slot` fell out of the sliding window (the device unmaps them
        before the next call) -> the blocks that returned to the free queue."""
        row = self.tables[slot, :num_skipped]
        blocks = row[row > 0]
        np.subtract.at(self.ref, blocks, 1)
        freed = int(np.sum(self.ref[blocks] == 0))
        self.num_free += freed
        row[:] = 0
        self.skipped[slot] = num_skipped
        return freed

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
            newer = versions != self.version[blocks]
            reissued += blocks[newer].tolist()
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
