"""The functional block pool: vLLM V1's KV-cache manager (KVCacheManager + BlockPool +
FreeKVCacheBlockQueue) as pure functions over arrays.

Every function takes a `BlockPool` and returns a new one; none raises inside `jax.jit`, failure is
a returned `ok` flag and a failed call returns the pool exactly as it was. Called eagerly with
concrete arguments, the entry points first validate them and raise `ValueError` naming the value.

The free queue is vLLM's FreeKVCacheBlockQueue as a ring buffer of block ids, so handing out n
blocks reads n entries and freeing m blocks writes m entries: no pass over the whole pool, and no
sort (XLA's CPU top_k is a full sort: 17 ms for 65,536 blocks). The order is vLLM's 2026 variant
(vLLM c59cb79, which prepends unhashed blocks):
  - a freed block that holds no prefix-cache entry goes to the head (reused first, most recently
    freed first); one that holds an entry goes to the tail, so cached blocks are evicted least
    recently freed first; never-used blocks sit between the two, in block-id order;
  - a sequence's blocks are freed tail first, so the end of a prefix chain is evicted before its
    start;
  - a prefix hit on a free cached block takes it out of the queue (vLLM's `touch`).

The engine keeps its pool on the host, made with `init(..., host=True)`: numpy arrays, updated in
place (as a pool donated under jit is; use the returned pool only), owned by the scheduler, which
sends the device only the block tables and slots of each call's rows. The same functions run
under `jax.jit` on a jnp pool (`paged_jax.core.arrays` holds the few places where the two differ).
The state and the free queue's bulk moves live in `block_pool_state`, validation and
`check_invariants` in `block_pool_checks`; every public name is here.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.core.arrays import at, cond, xp
from paged_jax.core.block_pool_checks import (_check_index, _check_range, _check_shape, _concrete,
                                              check_invariants, free_order)
from paged_jax.core.block_pool_state import (NULL_BLOCK, BlockPool, as_i32, cdiv, dispatch, init, num_free,
                                             put_rows, release_entries, remove_from_queue, rows, uncache_all,
                                             usage)

__all__ = ["NULL_BLOCK", "BlockPool", "init", "rows", "put_rows", "num_free", "usage", "allocate", "free",
           "remove_skipped", "share", "fork", "mark_cached", "uncache_all", "slot_mapping", "check_invariants",
           "free_order"]

# ---------------------------------------------------------------------------------------------
# allocate


def allocate(pool: BlockPool, new_lens, *, max_new_blocks: int | None = None):
    """Grow every sequence slot to `new_lens` tokens (never shrink) -> (pool, ok).

    new_lens: i32[max_seqs]. Slots take blocks from the head of the free queue in slot order.
    `max_new_blocks` (static) bounds the blocks one call may hand out (the decode loop needs at most
    one per sequence), so only that many queue entries are read; a call that needs more fails.
    Atomic: when the free blocks do not suffice, ok is False and the pool is returned unchanged.
    """
    lens = _concrete(new_lens)
    if lens is not None:
        _check_shape("new_lens", lens, (pool.max_seqs,))
        _check_range("new_lens", lens, 0, pool.max_seq_len)
    k = pool.num_blocks if max_new_blocks is None else max(1, min(int(max_new_blocks), pool.num_blocks))
    return _allocate(pool, as_i32(pool, new_lens), k)


def _allocate_impl(pool: BlockPool, new_lens, k: int):
    a = xp(pool.ref_cnt)
    new_lens = a.maximum(new_lens, pool.seq_lens)
    old_nb = cdiv(pool.seq_lens, pool.block_size)  # i32[max_seqs]
    new_nb = cdiv(new_lens, pool.block_size)
    need = new_nb - old_nb
    total = a.sum(need)
    ok = (total <= pool.num_free_blocks) & (total <= k) & a.all(new_nb <= pool.max_blocks_per_seq)

    candidates = pool.queue[(pool.head + a.arange(k)) % pool.num_blocks]  # i32[k], hand-out order
    first_rank = a.cumsum(need) - need  # i32[max_seqs]
    pos = a.arange(pool.max_blocks_per_seq)[None, :]
    fresh = ok & (pos >= old_nb[:, None]) & (pos < new_nb[:, None])  # bool[max_seqs, max_blocks_per_seq]
    rank = a.clip(first_rank[:, None] + pos - old_nb[:, None], 0, k - 1)
    taken = a.where(ok & (a.arange(k) < total), candidates, pool.num_blocks)  # else dropped
    taken_n = a.where(ok, total, 0)
    return dataclasses.replace(
        pool,
        block_tables=a.where(fresh, candidates[rank], pool.block_tables).astype(np.int32),
        seq_lens=a.where(ok, new_lens, pool.seq_lens).astype(np.int32),
        ref_cnt=at(pool.ref_cnt, taken).set(1),
        cached=at(pool.cached, taken).set(False),
        version=at(pool.version, taken).add(1),
        head=a.asarray((pool.head + taken_n) % pool.num_blocks, np.int32),
        num_free_blocks=a.asarray(pool.num_free_blocks - taken_n, np.int32),
    ), ok


_allocate = dispatch(_allocate_impl, 2)


# ---------------------------------------------------------------------------------------------
# free


def free(pool: BlockPool, seq_mask) -> BlockPool:
    """Release the sequence slots in `seq_mask` (bool[max_seqs]) -> pool.

    Shared blocks only lose a reference. A block whose count reaches 0 joins the free queue and keeps
    its cache entry until it is handed out again (vLLM's lazy eviction). Slots are released in slot
    order, each tail block first; unhashed blocks are prepended, hashed ones appended.
    """
    mask = _concrete(seq_mask)
    if mask is not None:
        _check_shape("seq_mask", mask, (pool.max_seqs,))
    return _free(pool, xp(pool.ref_cnt).asarray(seq_mask, bool))


def _free_impl(pool: BlockPool, seq_mask):
    a = xp(pool.ref_cnt)
    pool = release_entries(pool, a.where(seq_mask, cdiv(pool.seq_lens, pool.block_size), 0))
    return dataclasses.replace(pool, seq_lens=a.where(seq_mask, 0, pool.seq_lens).astype(np.int32))


def remove_skipped(pool: BlockPool, num_skipped) -> BlockPool:
    """Sliding window (vLLM's `remove_skipped_blocks`): entries [0, num_skipped) of each slot
    (i32[max_seqs]), which no query of that sequence will read again, become the null block and
    release their blocks as `free` does; lengths stay, so positions keep their table entries.
    Entries already skipped (null) are left alone."""
    skipped = _concrete(num_skipped)
    if skipped is not None:
        _check_shape("num_skipped", skipped, (pool.max_seqs,))
        _check_range("num_skipped", skipped, 0, pool.max_blocks_per_seq)
    return _release(pool, as_i32(pool, num_skipped))


_free = dispatch(_free_impl)
_release = dispatch(release_entries)


# ---------------------------------------------------------------------------------------------
# share / fork / mark_cached


def share(pool: BlockPool, seq, block_ids, n, versions=None):
    """Map the first `n` of `block_ids` (cached blocks: a prefix hit) into the empty slot `seq`
    -> (pool, ok).

    block_ids, versions: i32[k]. Each block gains a reference; one with none is taken back from the
    free queue (vLLM's `touch`). It fails (pool unchanged) if the slot is not empty, or a block is
    the null block, out of range, free without a cache entry, or of another `version` than given
    (its cache entry went stale).
    Batched: seq i32[m] (-1 skips a row), block_ids i32[m, k], n i32[m] map several hits at once
    -> (pool, ok bool[m]); each row succeeds or fails on its own.
    """
    a = xp(pool.ref_cnt)
    batched = np.ndim(seq) == 1
    ids, count, slots = _concrete(block_ids), _concrete(n), _concrete(seq)
    if slots is not None:
        for slot in np.atleast_1d(slots):
            if not (batched and slot == -1):
                _check_index("seq", slot, pool.max_seqs)
    if ids is not None and count is not None:
        for row, c in zip(np.atleast_2d(ids), np.atleast_1d(count)):
            _check_range("n", c, 0, min(row.shape[0], pool.max_blocks_per_seq))
            _check_range("block_ids", row[: int(c)], 1, pool.num_blocks - 1)
    block_ids = a.atleast_2d(as_i32(pool, block_ids))
    versions = a.full_like(block_ids, -1) if versions is None else a.atleast_2d(as_i32(pool, versions))
    pool, ok = _share(pool, a.atleast_1d(as_i32(pool, seq)), block_ids, a.atleast_1d(as_i32(pool, n)), versions)
    return pool, (ok if batched else ok[0])


def _share_impl(pool: BlockPool, seqs, block_ids, n, versions):
    a = xp(pool.ref_cnt)
    m, k = block_ids.shape
    mb = pool.max_blocks_per_seq
    live = (a.arange(k)[None, :] < n[:, None]) & (seqs >= 0)[:, None]  # bool[m, k]
    safe = a.clip(block_ids, 0, pool.num_blocks - 1)
    usable = ((block_ids > NULL_BLOCK) & (block_ids < pool.num_blocks)
              & ((pool.ref_cnt[safe] > 0) | pool.cached[safe])
              & ((versions < 0) | (versions == pool.version[safe])))
    # A block mapped twice into one row: sort each row's live ids, compare neighbours (O(k log k)).
    ordered = a.sort(a.where(live, block_ids, pool.num_blocks + a.arange(k)), axis=1)
    repeated = a.any(ordered[:, 1:] == ordered[:, :-1], axis=1)
    slot = a.clip(seqs, 0, pool.max_seqs - 1)
    ok = (seqs < 0) | ((pool.seq_lens[slot] == 0) & (n >= 0) & (n <= min(k, mb))
                       & a.all(usable | ~live, axis=1) & ~repeated)
    apply = ok & (seqs >= 0)
    tables = at(a.zeros((m, mb), np.int32), (slice(None), slice(None, k))).set(
        a.where(live, block_ids, NULL_BLOCK)[:, :mb])
    target = a.where(apply, slot, pool.max_seqs)  # out of range: dropped
    hits = a.where(apply[:, None] & live, block_ids, pool.num_blocks)
    revived = at(a.zeros((pool.num_blocks,), bool), hits).set(pool.ref_cnt[safe] == 0)
    pool = dataclasses.replace(
        pool,
        block_tables=at(pool.block_tables, target).set(tables),
        seq_lens=at(pool.seq_lens, target).set(n * pool.block_size),
        ref_cnt=at(pool.ref_cnt, hits).add(1),
    )
    pool = cond(a.any(revived), remove_from_queue, _unchanged, pool, revived)
    return pool, ok


def _unchanged(pool, _):
    return pool


_share = dispatch(_share_impl)


def fork(pool: BlockPool, parent, child):
    """Make slot `child` a copy-on-write fork of slot `parent` -> (pool, ok, copy_src, copy_dst).

    The child shares every full block of the parent (ref count + 1) and gets a fresh block for the
    parent's partial tail, whose KV the caller copies: `copy_blocks(pages, copy_src, copy_dst)`
    (both -1 when the parent ends on a block boundary). The paper's parallel sampling (§4.4).
    """
    p, c = _concrete(parent), _concrete(child)
    if p is not None and c is not None:
        _check_index("parent", p, pool.max_seqs)
        _check_index("child", c, pool.max_seqs)
        if int(p) == int(c):
            raise ValueError(f"fork needs two slots, got parent == child == {int(p)}")
    return _fork(pool, as_i32(pool, parent), as_i32(pool, child))


def _fork_impl(pool: BlockPool, parent, child):
    a = xp(pool.ref_cnt)
    length = pool.seq_lens[parent]
    num_full = length // pool.block_size
    has_tail = length % pool.block_size != 0
    ok = ((pool.seq_lens[child] == 0) & (parent != child)
          & (~has_tail | (pool.num_free_blocks > 0)))
    row = pool.block_tables[parent].copy()
    shared = a.where(ok & (a.arange(pool.max_blocks_per_seq) < num_full), row, NULL_BLOCK)
    child_len = a.where(ok, num_full * pool.block_size, pool.seq_lens[child])
    pool = dataclasses.replace(
        pool,
        block_tables=at(pool.block_tables, child).set(a.where(ok, shared, pool.block_tables[child])),
        seq_lens=at(pool.seq_lens, child).set(child_len),
        ref_cnt=at(pool.ref_cnt, a.where(shared > 0, shared, pool.num_blocks)).add(1),
    )
    new_lens = at(pool.seq_lens.copy(), child).set(a.where(ok, length, pool.seq_lens[child]))
    pool, _ = _allocate_impl(pool, new_lens, 1)
    copy = ok & has_tail
    last = a.minimum(num_full, pool.max_blocks_per_seq - 1)
    copy_src = a.where(copy, row[last], -1)
    copy_dst = a.where(copy, pool.block_tables[child, last], -1)
    return pool, ok, copy_src, copy_dst


_fork = dispatch(_fork_impl)


def mark_cached(pool: BlockPool, block_ids, n) -> BlockPool:
    """The first `n` of `block_ids` (i32[k]) now hold a prefix-cache entry."""
    ids, count = _concrete(block_ids), _concrete(n)
    if ids is not None and count is not None:
        _check_range("n", count, 0, ids.shape[0])
        _check_range("block_ids", ids[: int(count)], 1, pool.num_blocks - 1)
    return _mark_cached(pool, as_i32(pool, block_ids), as_i32(pool, n))


def _mark_cached_impl(pool: BlockPool, block_ids, n):
    a = xp(pool.ref_cnt)
    ids = a.where((a.arange(block_ids.shape[0]) < n) & (block_ids > NULL_BLOCK), block_ids,
                  pool.num_blocks)
    return dataclasses.replace(pool, cached=at(pool.cached, ids).set(True))


_mark_cached = dispatch(_mark_cached_impl)


def slot_mapping(pool: BlockPool, seq_ids, positions):
    """KV slot (block_id * block_size + offset) of each token -> i32[...]; -1 where the sequence id
    or the position is negative (padding), or the position is not mapped or was skipped."""
    a = xp(pool.ref_cnt)
    seq_ids = as_i32(pool, seq_ids)
    positions = as_i32(pool, positions)
    seq = a.clip(seq_ids, 0, pool.max_seqs - 1)
    idx = a.clip(positions // pool.block_size, 0, pool.max_blocks_per_seq - 1)
    slot = pool.block_tables[seq, idx] * pool.block_size + positions % pool.block_size
    valid = (seq_ids >= 0) & (positions >= 0) & (positions < pool.seq_lens[seq])
    return a.where(valid & (pool.block_tables[seq, idx] != NULL_BLOCK), slot, -1).astype(np.int32)
