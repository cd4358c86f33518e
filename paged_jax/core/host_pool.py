"""The host block pool for preemption by swapping (the paper's section 4.5, vLLM V0's CPU block
allocator): the bookkeeping of a pool of host-memory blocks, with its own free list and reference
counts. The blocks' contents live with the worker (`paged_jax.worker.swap.HostKVCache`); this
module only decides which host block holds which device block.

A device block shared by several sequences (a fork's full blocks, a prefix hit) is swapped out
once: the host block it went to is remembered under the device block's (id, version), and a later
victim holding the same block takes another reference on that host block instead of a copy. Full
blocks never change while they are held, and a device block that is handed out again gets a new
version, so an entry can never stand for other contents.
"""
from __future__ import annotations

import heapq

import numpy as np


class HostBlockPool:
    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
        self.num_blocks = int(num_blocks)
        self.free_ids = list(range(self.num_blocks))  # a heap: the lowest free host block first
        self.ref = np.zeros(self.num_blocks, np.int32)
        self.holds: dict[tuple[int, int], int] = {}  # (device block, version) -> host block
        self.key_of: dict[int, tuple[int, int]] = {}  # host block -> (device block, version)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free / max(self.num_blocks, 1)

    def swap_out(self, blocks, versions, copies: list[tuple[int, int]]) -> list[int] | None:
        """Host blocks for a sequence's device blocks (in table order, with their versions) -> one
        host block id per device block; the device -> host copies this needs are appended to
        `copies` as (device block, host block). None, changing nothing, when the free host blocks
        do not suffice (the caller recomputes the sequence instead)."""
        keys = [(int(b), int(v)) for b, v in zip(blocks, versions)]
        new = list(dict.fromkeys(k for k in keys if k not in self.holds))
        if len(new) > self.num_free:
            return None
        for key in new:
            host = heapq.heappop(self.free_ids)
            self.holds[key], self.key_of[host] = host, key
            copies.append((key[0], host))
        ids = [self.holds[k] for k in keys]
        np.add.at(self.ref, ids, 1)
        return ids

    def free(self, host_ids) -> None:
        """Drop one reference per listed host block (a sequence swapped back in, or finished while
        swapped out); a block with none left returns to the free list."""
        ids = np.asarray(host_ids, np.int64)
        np.subtract.at(self.ref, ids, 1)
        for host in dict.fromkeys(ids.tolist()):
            if self.ref[host] == 0:
                del self.holds[self.key_of.pop(host)]
                heapq.heappush(self.free_ids, host)

    def check_invariants(self) -> None:
        """Tests: AssertionError naming the broken invariant."""
        assert np.all(self.ref >= 0), f"negative host ref counts at {np.flatnonzero(self.ref < 0).tolist()}"
        held = sorted(self.key_of)
        assert held == np.flatnonzero(self.ref > 0).tolist(), f"held host blocks {held} != referenced ones"
        assert sorted(self.free_ids) == np.flatnonzero(self.ref == 0).tolist(), "free list != unreferenced blocks"
        assert len(self.holds) == len(self.key_of), "the two host maps disagree"
