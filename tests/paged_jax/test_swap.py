"""Preemption by swapping, below the engine: the host block pool's free list and reference counts
(exact host block ids), and the batched copies moving every leaf of a KV cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.core.host_pool import HostBlockPool
from paged_jax.worker import swap
from paged_jax.worker.attention import KVCache


def test_host_pool_hands_out_lowest_ids_and_swaps_a_shared_block_once():
    pool, copies = HostBlockPool(4), []
    # A: device blocks 5, 9 (version 1 each); B shares 5 (a forked prompt block) and holds 7.
    assert pool.swap_out([5, 9], [1, 1], copies) == [0, 1]
    assert pool.swap_out([5, 7], [1, 3], copies) == [0, 2]
    assert copies == [(5, 0), (9, 1), (7, 2)]  # block 5 went to host memory once
    assert pool.ref.tolist() == [2, 1, 1, 0] and pool.num_free == 1
    # Device block 5 handed out again (version 2) is other contents: a new host block.
    assert pool.swap_out([5], [2], copies) == [3] and copies[-1] == (5, 3)
    before = (pool.ref.tolist(), list(pool.free_ids), dict(pool.holds), list(copies))
    assert pool.swap_out([8], [1], copies) is None  # full: nothing changes, the caller recomputes
    assert (pool.ref.tolist(), list(pool.free_ids), dict(pool.holds), copies) == before
    pool.free([0, 1])  # A resumes: host block 0 stays (B still swapped out), 1 returns
    assert pool.ref.tolist() == [1, 0, 1, 1] and pool.free_ids == [1]
    assert pool.swap_out([9, 5], [1, 1], copies) == [1, 0] and copies[-1] == (9, 1)
    pool.free([1, 0])
    pool.free([0, 2])
    pool.free([3])
    pool.check_invariants()
    assert pool.num_free == 4 and pool.holds == {} and sorted(pool.free_ids) == [0, 1, 2, 3]


def test_host_pool_refuses_a_negative_size():
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 0, got -1"):
        HostBlockPool(-1)


@pytest.mark.parametrize("layout", ["paged", "tpu"])
def test_blocks_go_to_host_memory_and_back_in_every_layer(layout):
    """Blocks 2 and 5 of a 2-layer cache out to host blocks 1 and 0, back into device blocks 6 and
    3: every leaf, every layer, nothing else touched. One batched copy each way, padding dropped."""
    rng = np.random.default_rng(0)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype),
                         KVCache.create(2, 8, 4, 2, 16, layout=layout))
    host = swap.HostKVCache(cache, 3)
    assert swap.HostKVCache.block_bytes(cache) == 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, f32
    copying = host.start_copy_out(cache, np.array([2, 5, 0, 0, 0, 0, 0, 0], np.int32))
    assert host.finish_copy_out(copying, [1, 0]) == 2 * swap.HostKVCache.block_bytes(cache)
    back = swap.scatter_blocks(cache, jnp.array([3, 6, -1, -1], jnp.int32), host.read([0, 1, 2, 2]))
    for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(back)):
        axis = swap.block_axis(before, 2 * 8)

        def block(x, ids):  # [..., layer, block, ...]
            x = np.asarray(x)
            return np.take(x.reshape(x.shape[:axis] + (2, 8) + x.shape[axis + 1:]), ids, axis=axis + 1)

        np.testing.assert_array_equal(block(after, 3), block(before, 5))
        np.testing.assert_array_equal(block(after, 6), block(before, 2))
        np.testing.assert_array_equal(block(after, [0, 1, 2, 4, 5, 7]), block(before, [0, 1, 2, 4, 5, 7]))
