"""The host block pool (vLLM V0's CPU block allocator, the paper's section 4.5): the bookkeeping of
a pool of host-memory blocks with its own free list and reference counts. The blocks' contents live
with the worker (`paged_jax.worker.swap.HostKVCache`); this module only decides which host block
holds what. It serves two users:

- Preemption by swapping. A device block shared by several sequences (a fork's full blocks, a
  prefix hit) is swapped out once: the host block it went to is remembered under the device block's
  (id, version), and a later victim holding the same block takes another reference on that host
  block instead of a copy. Full blocks never change while they are held, and a device block that is
  handed out again gets a new version, so an entry can never stand for other contents.
- The host tier of the prefix cache. A cached block the device pool is about to hand out again
  (evict) is kept here under its prefix hash, and a prefix hit on it copies it back instead of
  computing it again. Tier blocks hold no reference: like the device's cached free blocks they are
  evicted least recently used first, whenever a swap or a newer tier block needs the room, so a
  swap never fails while the tier holds blocks.
"""
from __future__ import annotations

import collections
import heapq

import numpy as np


class HostBlockPool:
    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
        self.num_blocks = int(num_blocks)
        self.free_ids = list(range(self.num_blocks))  # a heap: the lowest empty host block first
        self.ref = np.zeros(self.num_blocks, np.int32)
        self.holds: dict[tuple[int, int], int] = {}  # (device block, version) -> host block
        self.key_of: dict[int, tuple[int, int]] = {}  # host block -> (device block, version)
        self.tier: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # hash -> host block, LRU first
        self.hash_of: dict[int, bytes] = {}  # tier host block -> its hash

    @property
    def num_free(self) -> int:
        """Host blocks a swap can take: empty ones and tier ones (evicted for it)."""
        return len(self.free_ids) + len(self.tier)

    def usage(self) -> float:
        """Fraction of host blocks holding something (swapped or tier blocks)."""
        return 1.0 - len(self.free_ids) / max(self.num_blocks, 1)

    def _take(self) -> int:
        if self.free_ids:
            return heapq.heappop(self.free_ids)
        _, host = self.tier.popitem(last=False)
        del self.hash_of[host]
        return host

    # -- swap ------------------------------------------------------------------------------------

    def swap_out(self, blocks, versions, copies: list[tuple[int, int]]) -> list[int] | None:
        """Host blocks for a sequence's device blocks (in table order, with their versions) -> one
        host block id per device block; the device -> host copies this needs are appended to
        `copies` as (device block, host block). None, changing nothing, when the host pool does not
        have the room (the caller recomputes the sequence instead)."""
        keys = [(int(b), int(v)) for b, v in zip(blocks, versions)]
        new = list(dict.fromkeys(k for k in keys if k not in self.holds))
        if len(new) > self.num_free:
            return None
        for key in new:
            host = self._take()
            self.holds[key], self.key_of[host] = host, key
            copies.append((key[0], host))
        ids = [self.holds[k] for k in keys]
        np.add.at(self.ref, ids, 1)
        return ids

    def free(self, host_ids) -> None:
        """Drop one reference per listed host block (a sequence swapped back in, or finished while
        swapped out); a block with none left is empty again."""
        ids = np.asarray(host_ids, np.int64)
        np.subtract.at(self.ref, ids, 1)
        for host in dict.fromkeys(ids.tolist()):
            if self.ref[host] == 0:
                del self.holds[self.key_of.pop(host)]
                heapq.heappush(self.free_ids, host)

    # -- the prefix cache's host tier ------------------------------------------------------------

    def store(self, block_hash: bytes) -> int | None:
        """A host block for the evicted device block of `block_hash` -> its id (the caller copies
        the block there), or None when the tier has it already or every host block is swapped."""
        if block_hash in self.tier:
            self.tier.move_to_end(block_hash)
            return None
        if not self.free_ids and not self.tier:
            return None
        host = self._take()
        self.tier[block_hash], self.hash_of[host] = host, block_hash
        return host

    def lookup(self, hashes) -> list[int]:
        """The tier blocks of the longest run of leading `hashes` it holds, each now the most
        recently used. The caller reads them in the step it plans now, before any host block taken
        later in that plan is written."""
        found = []
        for block_hash in hashes:
            host = self.tier.get(block_hash)
            if host is None:
                break
            self.tier.move_to_end(block_hash)
            found.append(host)
        return found

    def reset_tier(self) -> None:
        """Forget every tier block (`LLM.reset_prefix_cache`)."""
        for host in self.tier.values():
            heapq.heappush(self.free_ids, host)
        self.tier.clear()
        self.hash_of.clear()

    def check_invariants(self) -> None:
        """Tests: AssertionError naming the broken invariant."""
        assert np.all(self.ref >= 0), f"negative host ref counts at {np.flatnonzero(self.ref < 0).tolist()}"
        held = sorted(self.key_of)
        assert held == np.flatnonzero(self.ref > 0).tolist(), f"held host blocks {held} != referenced ones"
        assert len(self.holds) == len(self.key_of), "the two swap maps disagree"
        assert sorted(self.hash_of) == sorted(self.tier.values()), "the two tier maps disagree"
        assert not set(self.hash_of) & set(held), "a tier block is also swapped"
        empty = set(range(self.num_blocks)) - set(held) - set(self.hash_of)
        assert sorted(self.free_ids) == sorted(empty), "free list != blocks holding nothing"
