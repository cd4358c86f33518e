"""Swapping KV blocks between the device pool and host memory (the paper's section 4.5; vLLM V0's
CacheEngine.swap_in / swap_out): the host copy of the KV cache and the two batched copies.

Each step moves its blocks in one gather (device -> host) and one scatter (host -> device), never a
loop of single-block copies. Every leaf of the KV-cache pytree travels, whatever the cache holds
(K and V pages, or one interleaved array, and any array kept beside them, such as quantization
scales) along the cache's block axis (`KVCache.block_axis`), which stacks num_layers x num_blocks
blocks layer-major in every layout.

The device -> host copy overlaps with the step's compute: the gather is dispatched before the model
call, its transfer started at once (`copy_to_host_async`), and it is read only after the model call
is dispatched. On platforms with host memory kinds (GPU: "pinned_host") the gathered blocks go to
pinned host memory, which the DMA engines copy to without a staging buffer; on CPU the host copy is
plain numpy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _stacked_ids(block_ids, num_layers: int, num_blocks: int):
    """i32[n] block ids -> i32[num_layers * n], the same blocks in every layer, layer-major."""
    return (block_ids[None, :] + num_blocks * jnp.arange(num_layers, dtype=jnp.int32)[:, None]).reshape(-1)


@jax.jit
def gather_blocks(cache, block_ids):
    """Blocks `block_ids` (i32[n]) of every leaf -> the same pytree with each block axis num_layers x n."""
    idx = _stacked_ids(block_ids, cache.num_layers, cache.num_blocks)
    return jax.tree.map(lambda leaf: jnp.take(leaf, idx, axis=cache.block_axis), cache)


def scatter_blocks(cache, block_ids, blocks):
    """Write `blocks` (as `gather_blocks` returns them) into blocks `block_ids` (i32[n]; -1 skips)."""
    total = cache.num_layers * cache.num_blocks
    idx = _stacked_ids(block_ids, cache.num_layers, cache.num_blocks)
    idx = jnp.where(jnp.repeat(block_ids[None, :] >= 0, cache.num_layers, axis=0).reshape(-1), idx, total)

    def put(leaf, new):
        return leaf.at[(slice(None),) * cache.block_axis + (idx,)].set(new.astype(leaf.dtype), mode="drop")

    return jax.tree.map(put, cache, blocks)


class HostKVCache:
    """The host pool's block contents: per cache leaf, an array whose block axis holds
    num_layers x num_blocks host blocks (zeros are not touched until written, so an unused
    swap_space costs address space, not memory)."""

    def __init__(self, cache, num_blocks: int):
        self.num_layers, self.num_blocks, self.axis = cache.num_layers, int(num_blocks), cache.block_axis
        self.storage = jax.tree.map(
            lambda leaf: np.zeros(leaf.shape[:self.axis] + (self.num_layers * self.num_blocks,)
                                  + leaf.shape[self.axis + 1:], leaf.dtype), cache)
        device = jax.tree.leaves(cache)[0].sharding
        kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
        self.host_sharding = (device.with_memory_kind("pinned_host")
                              if jax.default_backend() != "cpu" and "pinned_host" in kinds else None)

    @staticmethod
    def block_bytes(cache) -> int:
        """Bytes one block takes in every layer and leaf together."""
        return sum(leaf.nbytes for leaf in jax.tree.leaves(cache)) // cache.num_blocks

    def _index(self, host_ids) -> np.ndarray:
        ids = np.asarray(host_ids, np.int64)
        return (ids[None, :] + self.num_blocks * np.arange(self.num_layers)[:, None]).reshape(-1)

    def start_copy_out(self, cache, block_ids):
        """Dispatch the gather of device blocks `block_ids` (i32[n]) and start its transfer."""
        blocks = gather_blocks(cache, jnp.asarray(block_ids, jnp.int32))
        if self.host_sharding is not None:
            return jax.device_put(blocks, self.host_sharding)
        for leaf in jax.tree.leaves(blocks):
            leaf.copy_to_host_async()
        return blocks

    def finish_copy_out(self, blocks, host_ids, positions=None) -> int:
        """Store blocks of a started copy in host blocks `host_ids`: block positions[i] of the copy
        (default: i) in host_ids[i], so one gathered block may fill several -> bytes stored."""
        idx = self._index(host_ids)
        positions = np.arange(len(host_ids)) if positions is None else np.asarray(positions, np.int64)
        moved = 0

        def store(host, leaf):
            nonlocal moved
            axis = self.axis
            got = np.asarray(leaf)
            got = got.reshape(got.shape[:axis] + (self.num_layers, -1) + got.shape[axis + 1:])
            got = np.take(got, positions, axis=axis + 1).reshape(got.shape[:axis] + (-1,) + got.shape[axis + 2:])
            host[(slice(None),) * axis + (idx,)] = got
            moved += got.nbytes

        jax.tree.map(store, self.storage, blocks)
        return moved

    def read(self, host_ids):
        """Host blocks `host_ids` of every leaf, as `gather_blocks` lays them out (numpy)."""
        idx = self._index(host_ids)
        return jax.tree.map(lambda host: np.take(host, idx, axis=self.axis), self.storage)
