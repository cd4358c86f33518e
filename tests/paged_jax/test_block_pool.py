"""The block pool against vLLM V1's KV-cache manager behaviours (tests/v1/core/test_prefix_caching.py,
block_size 16 and 11 blocks) with exact block ids, and against a plain-Python free-queue model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.core import block_pool as bp


def lens(pool, **by_slot):
    out = np.asarray(pool.seq_lens).copy()
    for slot, n in by_slot.items():
        out[int(slot[1:])] = n
    return out


def row(pool, seq):
    n = -(-int(pool.seq_lens[seq]) // pool.block_size)
    return np.asarray(pool.block_tables[seq, :n]).tolist()


@pytest.fixture(params=["device", "host"])
def pool(request):
    """Every test runs on a jnp pool and on the host's numpy pool (`init(..., host=True)`)."""
    return bp.init(num_blocks=11, block_size=16, max_seqs=4, max_blocks_per_seq=10, host=request.param == "host")


def test_init_state(pool):
    assert int(bp.num_free(pool)) == 10
    assert bp.free_order(pool).tolist() == list(range(1, 11))
    assert float(bp.usage(pool)) == 0.0
    bp.check_invariants(pool)


def test_prefill_share_free_order_and_eviction(pool):
    # 48 + 7 tokens: three full blocks and a partial one.
    pool, ok = bp.allocate(pool, lens(pool, s0=55))
    assert bool(ok) and row(pool, 0) == [1, 2, 3, 4]
    assert np.asarray(pool.ref_cnt)[1:5].tolist() == [1, 1, 1, 1]
    pool = bp.mark_cached(pool, jnp.array([1, 2, 3]), 3)

    # A second request hits the 3 cached blocks, then needs one more block for its own tail.
    pool, ok = bp.share(pool, 1, jnp.array([1, 2, 3, 0]), 3)
    assert bool(ok) and int(pool.seq_lens[1]) == 48
    pool, ok = bp.allocate(pool, lens(pool, s1=55))
    assert bool(ok) and row(pool, 1) == [1, 2, 3, 5]
    assert np.asarray(pool.ref_cnt)[1:6].tolist() == [2, 2, 2, 1, 1]
    assert int(bp.num_free(pool)) == 5
    bp.check_invariants(pool)

    # Free both: uncached tails first (newest first), never-used blocks, then the cached chain LRU,
    # its end before its start: vLLM c59cb79's [5, 4, 6..10, 3, 2, 1].
    pool = bp.free(pool, np.array([True, False, False, False]))
    pool = bp.free(pool, np.array([False, True, False, False]))
    assert bp.free_order(pool).tolist() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert np.asarray(pool.ref_cnt).tolist() == [0] * 11
    assert int(bp.num_free(pool)) == 10

    # A hit on a free cached block takes it out of the free order.
    pool, ok = bp.share(pool, 2, jnp.array([1, 2]), 2)
    assert bool(ok) and bp.free_order(pool).tolist() == [5, 4, 6, 7, 8, 9, 10, 3]
    pool = bp.free(pool, np.array([False, False, True, False]))
    assert bp.free_order(pool).tolist() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # A 10-block miss evicts in exactly that order and empties the pool.
    before = np.asarray(pool.version).copy()
    pool, ok = bp.allocate(pool, lens(pool, s3=160))
    assert bool(ok) and row(pool, 3) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert int(bp.num_free(pool)) == 0 and not np.asarray(pool.cached).any()
    assert (np.asarray(pool.version) - before)[1:].tolist() == [1] * 10
    bp.check_invariants(pool)


def test_decode_within_and_across_a_block(pool):
    pool, _ = bp.allocate(pool, lens(pool, s0=55))
    for n in range(56, 65):  # appending inside block 4 allocates nothing
        pool, ok = bp.allocate(pool, lens(pool, s0=n))
        assert bool(ok) and row(pool, 0) == [1, 2, 3, 4] and int(bp.num_free(pool)) == 6
    pool, ok = bp.allocate(pool, lens(pool, s0=65))  # crossing the boundary takes exactly one
    assert bool(ok) and row(pool, 0) == [1, 2, 3, 4, 5] and int(bp.num_free(pool)) == 5


def test_failed_allocation_changes_nothing(pool):
    pool, _ = bp.allocate(pool, lens(pool, s0=55))
    pool = bp.mark_cached(pool, jnp.array([1, 2, 3]), 3)
    pool, _ = bp.share(pool, 1, jnp.array([1, 2, 3]), 3)
    before = jax.tree.map(np.asarray, pool)
    grown, ok = bp.allocate(pool, lens(pool, s1=48 + 16 * 7))  # 7 new blocks, 6 free
    assert not bool(ok)
    for name in ("block_tables", "seq_lens", "ref_cnt", "cached", "version", "queue", "head", "num_free_blocks"):
        np.testing.assert_array_equal(getattr(grown, name), getattr(before, name), err_msg=name)
    assert np.asarray(grown.ref_cnt)[1:4].tolist() == [2, 2, 2]


def test_allocate_many_slots_at_once_in_slot_order(pool):
    pool, ok = bp.allocate(pool, np.array([20, 0, 33, 16]))
    assert bool(ok)
    assert [row(pool, s) for s in range(4)] == [[1, 2], [], [3, 4, 5], [6]]
    pool = bp.free(pool, np.array([True, False, True, False]))  # stamps: slot 0 then 2, tail first
    assert bp.free_order(pool).tolist() == [3, 4, 5, 1, 2, 7, 8, 9, 10]


def test_free_everything_returns_every_block(pool):
    pool, _ = bp.allocate(pool, np.array([20, 0, 33, 16]))
    pool, ok, _, _ = bp.fork(pool, 2, 1)
    assert bool(ok) and int(bp.num_free(pool)) == 3
    pool = bp.free(pool, np.ones(4, bool))
    assert int(bp.num_free(pool)) == 10 and np.asarray(pool.ref_cnt).tolist() == [0] * 11
    assert np.asarray(pool.block_tables).tolist() == [[0] * 10] * 4
    bp.check_invariants(pool)


def test_fork_shares_full_blocks_and_copies_the_tail(pool):
    pool, _ = bp.allocate(pool, lens(pool, s0=40))  # blocks [1, 2, 3], 8 tokens in block 3
    pool, ok, src, dst = bp.fork(pool, 0, 2)
    assert bool(ok) and (int(src), int(dst)) == (3, 4)
    assert row(pool, 2) == [1, 2, 4] and int(pool.seq_lens[2]) == 40
    assert np.asarray(pool.ref_cnt)[1:5].tolist() == [2, 2, 1, 1]
    # On a block boundary there is nothing to copy.
    pool, _ = bp.allocate(pool, lens(pool, s0=48))
    pool, ok, src, dst = bp.fork(pool, 0, 3)
    assert bool(ok) and (int(src), int(dst)) == (-1, -1) and row(pool, 3) == [1, 2, 3]
    bp.check_invariants(pool)


def test_fork_into_a_busy_slot_or_without_blocks_fails(pool):
    pool, _ = bp.allocate(pool, lens(pool, s0=40, s1=5))
    forked, ok, src, dst = bp.fork(pool, 0, 1)
    assert not bool(ok) and (int(src), int(dst)) == (-1, -1)
    np.testing.assert_array_equal(forked.ref_cnt, pool.ref_cnt)
    pool, _ = bp.allocate(pool, lens(pool, s2=16 * 6))  # the pool is now empty
    forked, ok, _, _ = bp.fork(pool, 0, 3)
    assert not bool(ok) and int(forked.seq_lens[3]) == 0


def test_share_refuses_stale_or_bad_blocks(pool):
    pool, _ = bp.allocate(pool, lens(pool, s0=32))
    pool = bp.mark_cached(pool, jnp.array([1, 2]), 2)
    version = np.asarray(pool.version)[[1, 2]]
    pool = bp.free(pool, np.array([True, False, False, False]))
    # An uncached free block is not a hit; neither is a stale version, nor a busy slot.
    _, ok = bp.share(pool, 1, jnp.array([1, 3]), 2)
    assert not bool(ok)
    _, ok = bp.share(pool, 1, jnp.array([1, 2]), 2, versions=version + 1)
    assert not bool(ok)
    shared, ok = bp.share(pool, 1, jnp.array([1, 2]), 2, versions=version)
    assert bool(ok)
    _, ok = bp.share(shared, 1, jnp.array([1]), 1)
    assert not bool(ok)
    _, ok = bp.share(pool, 1, jnp.array([2, 2]), 2)
    assert not bool(ok)


def test_slot_mapping(pool):
    pool, _ = bp.allocate(pool, np.array([20, 0, 3, 0]))  # slot 0 -> [1, 2], slot 2 -> [3]
    slots = bp.slot_mapping(pool, jnp.array([0, 0, 0, 2, 2, -1, 1]), jnp.array([0, 15, 19, 2, 3, 0, 0]))
    assert slots.tolist() == [16, 31, 35, 50, -1, -1, -1]


@pytest.mark.parametrize("call, message", [
    (lambda p: bp.allocate(p, np.array([0, 0, 0, 161])), r"new_lens must lie in \[0, 160\], got \[161\]"),
    (lambda p: bp.allocate(p, np.array([-1, 0, 0, 0])), r"new_lens .* got \[-1\]"),
    (lambda p: bp.allocate(p, np.array([1, 2])), r"new_lens must have shape \(4,\), got \(2,\)"),
    (lambda p: bp.free(p, np.ones(3, bool)), r"seq_mask must have shape \(4,\)"),
    (lambda p: bp.share(p, 4, jnp.array([1]), 1), r"seq must be a slot index in \[0, 4\), got 4"),
    (lambda p: bp.share(p, 0, jnp.array([11]), 1), r"block_ids must lie in \[1, 10\], got \[11\]"),
    (lambda p: bp.share(p, 0, jnp.array([1]), 2), r"n must lie in \[0, 1\], got \[2\]"),
    (lambda p: bp.fork(p, 1, 1), r"parent == child == 1"),
    (lambda p: bp.fork(p, -1, 1), r"parent must be a slot index .* got -1"),
    (lambda p: bp.mark_cached(p, jnp.array([0]), 1), r"block_ids must lie in \[1, 10\], got \[0\]"),
    (lambda p: bp.init(1, 16, 4, 8), r"num_blocks must be an integer >= 2, got 1"),
])
def test_bad_arguments_raise_naming_the_value(pool, call, message):
    with pytest.raises(ValueError, match=message):
        call(pool)


def test_max_new_blocks_bounds_one_call(pool):
    _, ok = bp.allocate(pool, lens(pool, s0=16 * 3), max_new_blocks=2)
    assert not bool(ok)
    grown, ok = bp.allocate(pool, lens(pool, s0=16 * 2), max_new_blocks=2)
    assert bool(ok) and row(grown, 0) == [1, 2]


def test_usage_counts_cached_free_blocks_as_free(pool):
    pool, _ = bp.allocate(pool, lens(pool, s0=80))
    assert float(bp.usage(pool)) == pytest.approx(0.5)
    pool = bp.mark_cached(pool, jnp.arange(1, 6), 5)
    pool = bp.free(pool, np.array([True, False, False, False]))
    assert float(bp.usage(pool)) == 0.0


def test_every_function_runs_inside_jit(pool):
    @jax.jit
    def step(pool):
        pool, ok1 = bp.allocate(pool, pool.seq_lens.at[0].set(40))
        pool = bp.mark_cached(pool, pool.block_tables[0], 2)
        pool, ok2 = bp.share(pool, 1, pool.block_tables[0], 2)
        pool, ok3, src, dst = bp.fork(pool, 0, 2)
        slots = bp.slot_mapping(pool, jnp.array([2]), jnp.array([39]))
        pool = bp.free(pool, jnp.array([True, False, False, False]))
        return pool, jnp.stack([ok1, ok2, ok3]), src, dst, slots, bp.num_free(pool)

    out, oks, src, dst, slots, nfree = step(pool)
    assert oks.tolist() == [True, True, True]
    assert (int(src), int(dst), slots.tolist(), int(nfree)) == (3, 4, [4 * 16 + 7], 7)
    bp.check_invariants(out)


def test_batched_share_maps_rows_independently(pool):
    pool, _ = bp.allocate(pool, lens(pool, s0=48))  # blocks [1, 2, 3]
    pool = bp.mark_cached(pool, jnp.array([1, 2, 3]), 3)
    pool = bp.free(pool, np.array([True, False, False, False]))
    seqs = jnp.array([1, -1, 2, 0])
    hits = jnp.array([[1, 2, 3], [1, 2, 3], [1, 4, 0], [1, 2, 0]])  # row 2: block 4 was never cached
    pool, ok = bp.share(pool, seqs, hits, jnp.array([3, 3, 2, 2]))
    assert ok.tolist() == [True, True, False, True]
    assert (row(pool, 1), row(pool, 2), row(pool, 0)) == ([1, 2, 3], [], [1, 2])
    assert np.asarray(pool.ref_cnt)[1:4].tolist() == [2, 2, 1]
    assert bp.free_order(pool).tolist() == [4, 5, 6, 7, 8, 9, 10]
    bp.check_invariants(pool)


def test_a_row_view_works_as_a_pool_of_those_slots(pool):
    """allocate / free through `rows` (slots 2 and 0, a padding row, tables 4 wide) and `put_rows`:
    exact block ids, the pool's invariants, and the free-queue order."""
    pool, _ = bp.allocate(pool, lens(pool, s0=20, s1=5))  # s0: blocks 1, 2; s1: block 3
    slots = jnp.array([2, -1, 0], jnp.int32)
    view = bp.rows(pool, slots, 4)
    assert np.asarray(view.block_tables).tolist() == [[0] * 4, [0] * 4, [1, 2, 0, 0]]
    view, ok = bp.allocate(view, jnp.array([33, 0, 40]))
    merged = bp.put_rows(pool, view, slots)
    bp.check_invariants(merged)
    # Blocks go out in row order (slot 2's three, then slot 0's one), as allocate hands them in slot order.
    assert bool(ok) and row(merged, 2) == [4, 5, 6] and row(merged, 0) == [1, 2, 7] and row(merged, 1) == [3]
    freed = bp.put_rows(merged, bp.free(bp.rows(merged, slots, 4), slots >= 0), slots)
    bp.check_invariants(freed)
    assert int(bp.num_free(freed)) == 9 and row(freed, 1) == [3]
    # Rows in view order, each tail first, each block prepended: the last freed is handed out first.
    assert bp.free_order(freed).tolist() == [1, 2, 7, 4, 5, 6, 8, 9, 10]


def test_share_refuses_a_block_twice_in_one_row(pool):
    pool, _ = bp.allocate(pool, lens(pool, s0=32))
    pool = bp.mark_cached(pool, jnp.array([1, 2]), 2)
    pool, ok = bp.share(pool, jnp.array([1, 2]), jnp.array([[1, 1, 0], [1, 2, 0]]), jnp.array([2, 2]))
    assert np.asarray(ok).tolist() == [False, True] and row(pool, 1) == [] and row(pool, 2) == [1, 2]


def test_remove_skipped_blocks_of_a_sliding_window(pool):
    """vLLM's remove_skipped_blocks: leading entries become the null block, their blocks return to
    the queue as a free would return them (uncached to the head, cached to the tail, tail first), a
    block another slot shares only loses a reference, and the slot keeps its length."""
    pool, _ = bp.allocate(pool, lens(pool, s0=70))  # blocks 1..5
    pool = bp.mark_cached(pool, jnp.array([1, 2]), 2)
    pool, ok = bp.share(pool, 1, jnp.array([1, 2, 3]), 3)  # slot 1 shares 1, 2, 3
    assert bool(ok)
    pool = bp.remove_skipped(pool, np.array([4, 0, 0, 0]))
    assert np.asarray(pool.block_tables[0, :5]).tolist() == [0, 0, 0, 0, 5]
    assert int(pool.seq_lens[0]) == 70
    assert np.asarray(pool.ref_cnt)[1:6].tolist() == [1, 1, 1, 0, 1]
    assert bp.free_order(pool).tolist() == [4, 6, 7, 8, 9, 10]
    bp.check_invariants(pool)
    # Skipping again up to the same entry changes nothing; slot 1 skipping its three frees them,
    # uncached 3 to the head, the cached chain to the tail in tail-first order.
    assert bp.free_order(bp.remove_skipped(pool, np.array([4, 0, 0, 0]))).tolist() == [4, 6, 7, 8, 9, 10]
    pool = bp.remove_skipped(pool, np.array([0, 3, 0, 0]))
    assert bp.free_order(pool).tolist() == [3, 4, 6, 7, 8, 9, 10, 2, 1]
    assert bp.slot_mapping(pool, jnp.array([0, 0, 0]), jnp.array([3, 63, 64])).tolist() == [-1, -1, 80]
    bp.check_invariants(pool)
    # Growing and freeing a slot with skipped entries releases only the blocks it holds.
    pool, ok = bp.allocate(pool, lens(pool, s0=81))
    assert bool(ok) and np.asarray(pool.block_tables[0, :6]).tolist() == [0, 0, 0, 0, 5, 3]
    pool = bp.free(pool, np.array([True, True, False, False]))
    assert np.asarray(pool.ref_cnt).tolist() == [0] * 11
    assert bp.free_order(pool).tolist() == [5, 3, 4, 6, 7, 8, 9, 10, 2, 1]
    bp.check_invariants(pool)
    with pytest.raises(ValueError, match="num_skipped must lie in"):
        bp.remove_skipped(pool, np.array([11, 0, 0, 0]))
