"""Host memory below the engine: the host block pool's free list, reference counts and prefix-cache
tier (exact host block ids), which cached blocks the pool's next hand-outs evict, and the batched copies moving every leaf of a KV cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.core import block_pool as bp
from paged_jax.core.host_pool import HostBlockPool
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.plan import Plan
from paged_jax.worker import swap
from paged_jax.worker.host_transfers import HostTransfers
from paged_jax.attention import KVCache


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


def test_host_tier_evicts_least_recently_used_and_gives_way_to_swaps():
    pool, copies = HostBlockPool(3), []
    assert [pool.store(h) for h in (b"a", b"b", b"c")] == [0, 1, 2]
    assert pool.store(b"a") is None  # held already: no second copy, and now the most recent
    assert pool.lookup([b"b", b"x", b"c"]) == [1]  # the leading run only; b is now the most recent
    assert list(pool.tier) == [b"c", b"a", b"b"] and pool.num_free == 3 and pool.usage() == 1.0
    assert pool.store(b"d") == 2  # full: the least recently used (c) makes room
    assert pool.lookup([b"c"]) == [] and list(pool.tier) == [b"a", b"b", b"d"]
    # A swap takes tier blocks, least recently used first: a preempted request outranks a cache.
    assert pool.swap_out([7, 8], [1, 1], copies) == [0, 1] and copies == [(7, 0), (8, 1)]
    assert list(pool.tier) == [b"d"] and pool.num_free == 1
    assert pool.swap_out([9, 10], [1, 1], copies) is None  # 1 block left for 2: recompute instead
    pool.check_invariants()
    assert pool.store(b"e") == 2 and list(pool.tier) == [b"e"]  # d made room
    assert pool.swap_out([9], [1], copies) == [2] and pool.tier == {}
    assert pool.store(b"f") is None  # every host block holds a swapped block: the tier keeps nothing
    pool.free([0, 1, 2])
    pool.reset_tier()
    pool.check_invariants()
    assert pool.num_free == 3 and sorted(pool.free_ids) == [0, 1, 2] and pool.tier == {}


@pytest.mark.parametrize("revived, evicted", [(set(), [3, 2]), ({2}, [3, 1])])
def test_the_pool_names_the_cached_blocks_the_next_hand_outs_evict(revived, evicted):
    """Slots 0-2 hold blocks [1, 2, 3], [4, 5], [6]; 1-3 and 6 are cached. Freed in slot order,
    each tail first: 5 and 4 go to the head, 3, 2, 1 and 6 to the tail, so the queue is
    [4, 5, 7, 8, 9, 3, 2, 1, 6] and 7 hand-outs evict 3 and 2, or 3 and 1 when a prefix hit first
    takes 2 out of the queue; the allocation that follows reports the same blocks."""
    kv = KVCacheManager(10, 4, 3, 4)
    kv.allocate([0, 1, 2], [12, 8, 4])
    kv.mark_cached([1, 2, 3, 6])
    for slot in range(3):
        kv.free([slot])
    assert bp.free_order(kv.pool).tolist() == [4, 5, 7, 8, 9, 3, 2, 1, 6]
    if revived:
        kv.share(2, sorted(revived), kv.version(sorted(revived)).tolist())
    assert kv.next_evictions(5) == []
    assert kv.next_evictions(7) == evicted
    assert kv.allocate([0, 1], [16, 12]) == evicted
    bp.check_invariants(kv.pool)


def test_host_pool_refuses_a_negative_size():
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 0, got -1"):
        HostBlockPool(-1)


# 16 KV heads: the head axis is as long as the 2 x 8 stacked blocks, and must not be taken for them.
@pytest.mark.parametrize("layout, kv_heads", [("paged", 2), ("tpu", 2), ("paged", 16)])
def test_blocks_go_to_host_memory_and_back_in_every_layer(layout, kv_heads):
    """Blocks 2 and 5 of a 2-layer cache out to host blocks 1 and 0, back into device blocks 6 and
    3: every leaf, every layer, nothing else touched. One batched copy each way, padding dropped."""
    rng = np.random.default_rng(0)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype),
                         KVCache.create(2, 8, 4, kv_heads, 16, layout=layout))
    host = swap.HostKVCache(cache, 3)
    stored = 128 if layout == "tpu" else 16  # jax's TPU kernel reads head_dim padded to 128
    assert swap.HostKVCache.block_bytes(cache) == 2 * 2 * 4 * kv_heads * stored * 4  # K and V, 2 layers, f32
    copying = host.start_copy_out(cache, np.array([2, 5, 0, 0, 0, 0, 0, 0], np.int32))
    assert host.finish_copy_out(copying, [1, 0]) == 2 * swap.HostKVCache.block_bytes(cache)
    back = swap.scatter_blocks(cache, jnp.array([3, 6, -1, -1], jnp.int32), host.read([0, 1, 2, 2]))
    for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(back)):
        axis = cache.block_axis

        def block(x, ids):  # [..., layer, block, ...]
            x = np.asarray(x)
            return np.take(x.reshape(x.shape[:axis] + (2, 8) + x.shape[axis + 1:]), ids, axis=axis + 1)

        np.testing.assert_array_equal(block(after, 3), block(before, 5))
        np.testing.assert_array_equal(block(after, 6), block(before, 2))
        np.testing.assert_array_equal(block(after, [0, 1, 2, 4, 5, 7]), block(before, [0, 1, 2, 4, 5, 7]))


def test_a_load_reads_the_copies_of_a_call_not_yet_fetched():
    """Overlapped scheduling dispatches the next call before fetching this one: a call evicting
    device block 5 to host block 2 (the host prefix cache) is still in flight when the next loads
    host block 2 back; the load stores that copy first and reads block 5's K/V. The fetch then
    stores nothing twice, and counts the copy once. A call whose own copy goes to a host block it
    also loads (given back when it was planned) reads the block's old contents: its copy lands later."""
    rng = np.random.default_rng(1)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), KVCache.create(2, 8, 4, 2, 16))
    host = HostTransfers([cache], 2 * swap.HostKVCache.block_bytes(cache) * 4 / 2**30, True)
    assert host.num_blocks == 8
    counters = dict.fromkeys(["num_blocks_swapped_out", "swap_bytes_out", "host_prefix_cache_blocks_out",
                              "host_prefix_cache_bytes_out", "num_blocks_swapped_in", "swap_bytes_in",
                              "host_prefix_cache_blocks_in", "host_prefix_cache_bytes_in", "bytes_to_device"], 0)
    copy = host.start_copy_out(Plan(tier_out=[(5, 2)]), [cache])
    blocks = host.load(Plan(tier_in=[(0, [2], 0)]), 4, counters)
    assert counters["host_prefix_cache_blocks_out"] == counters["host_prefix_cache_blocks_in"] == 1
    axis = cache.block_axis

    def first_block(x, n):  # [..., layer * n + block, ...] -> block 0 of each layer
        x = np.asarray(x)
        return np.take(x.reshape(x.shape[:axis] + (2, n) + x.shape[axis + 1:]), 0, axis=axis + 1)

    want = swap.gather_blocks(cache, jnp.array([5], jnp.int32))
    for got, leaf in zip(jax.tree.leaves(blocks[0]), jax.tree.leaves(want)):
        np.testing.assert_array_equal(first_block(got, 4), first_block(leaf, 1))
    host.finish_copy_out(copy, counters)  # the call's fetch
    assert counters["host_prefix_cache_blocks_out"] == 1
    plan = Plan(swap_in=[(0, [2], 0)], tier_out=[(6, 2)])
    copy = host.start_copy_out(plan, [cache])
    again = host.load(plan, 4, counters)
    host.finish_copy_out(copy, counters)
    for got, leaf in zip(jax.tree.leaves(again[0]), jax.tree.leaves(want)):
        np.testing.assert_array_equal(first_block(got, 4), first_block(leaf, 1))
    now = swap.gather_blocks(cache, jnp.array([6], jnp.int32))
    for got, leaf in zip(jax.tree.leaves(host.caches[0].read([2])), jax.tree.leaves(now)):
        np.testing.assert_array_equal(got, leaf)
