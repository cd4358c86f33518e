"""The host-memory traffic of device calls: the device -> host copies a plan makes (swapped victims,
cached blocks the host prefix cache keeps) and its host -> device loads (swapped rows resuming,
host prefix-cache hits), over one `swap.HostKVCache` per cache of the device state.

A copy-out is dispatched before its call and stored in host memory when the call is fetched, or
earlier: a call that loads host blocks first stores the copies of the calls before it still in
flight, since under overlapped scheduling the call before it, whose copies it may read back, is not
fetched yet. Its own copies land after its loads are read: a host block a resumed swap gave back
when the call was planned may be where one of them goes.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax.core.plan import Plan
from paged_jax.worker import batching, swap


@dataclasses.dataclass(eq=False)
class CopyOut:
    """A started device -> host copy: each device block of the plan's copies gathered once."""

    plan: Plan
    blocks: list  # per host cache, the gathered blocks in transfer
    unique: list[int]  # the device blocks gathered, in order


class HostTransfers:
    def __init__(self, caches, swap_space_gib: float, enabled: bool):
        """`caches`: the device state's KV caches (a draft's too): each host block holds a device
        block of every one; `swap_space_gib` of them when `enabled`, else none."""
        self.block_bytes = sum(swap.HostKVCache.block_bytes(cache) for cache in caches)
        self.num_blocks = int(swap_space_gib * 2**30) // self.block_bytes if enabled else 0
        self.caches = [swap.HostKVCache(cache, self.num_blocks) for cache in caches] if self.num_blocks else []
        self._in_flight: list[CopyOut] = []

    def start_copy_out(self, plan: Plan, device_caches) -> CopyOut | None:
        """Dispatch the gather of the plan's device -> host copies, each device block once, before the
        plan's call can reuse them; the transfer runs while the call is dispatched."""
        copies = plan.swap_out + plan.tier_out
        if not copies:
            return None
        unique = list(dict.fromkeys(d for d, _ in copies))
        ids = batching.padded(unique)
        copy = CopyOut(plan, [host.start_copy_out(cache, ids) for host, cache in zip(self.caches, device_caches)],
                       unique)
        self._in_flight.append(copy)
        return copy

    def finish_copy_out(self, copy: CopyOut | None, counters: dict) -> None:
        """Store a started copy in its host blocks (once; nothing for None)."""
        if copy is None or copy not in self._in_flight:
            return
        self._in_flight.remove(copy)
        plan, position = copy.plan, {d: i for i, d in enumerate(copy.unique)}
        copies = plan.swap_out + plan.tier_out
        for host, part in zip(self.caches, copy.blocks):
            host.finish_copy_out(part, [h for _, h in copies], [position[d] for d, _ in copies])
        counters["num_blocks_swapped_out"] += len(plan.swap_out)
        counters["swap_bytes_out"] += len(plan.swap_out) * self.block_bytes
        counters["host_prefix_cache_blocks_out"] += len(plan.tier_out)
        counters["host_prefix_cache_bytes_out"] += len(plan.tier_out) * self.block_bytes

    def load(self, plan: Plan, num_rows: int, counters: dict):
        """The host blocks the plan loads (rows resuming after a swap, host prefix-cache hits), in the
        order of the batch's swap_blocks (`num_rows` of them): one host read for all, scattered by
        the prefill step -> the blocks (numpy), one entry per cache, or None when it loads none."""
        host_ids = [h for _, ids, _ in plan.host_loads for h in ids]
        if not host_ids:
            return None
        for copy in [c for c in self._in_flight if c.plan is not plan]:  # an unfetched call's copies
            self.finish_copy_out(copy, counters)  # may be what this reads; its own land after it reads
        blocks = tuple(host.read(np.pad(host_ids, (0, num_rows - len(host_ids)))) for host in self.caches)
        swapped, tier = (sum(len(ids) for _, ids, _ in loads) for loads in (plan.swap_in, plan.tier_in))
        counters["num_blocks_swapped_in"] += swapped
        counters["swap_bytes_in"] += swapped * self.block_bytes
        counters["host_prefix_cache_blocks_in"] += tier
        counters["host_prefix_cache_bytes_in"] += tier * self.block_bytes
        counters["bytes_to_device"] += sum(x.nbytes for x in jax.tree.leaves(blocks))
        return blocks
