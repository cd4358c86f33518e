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
Validation and `check_invariants` live in `block_pool_checks`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.core.arrays import at, cond, on_host, xp
from paged_jax.core.block_pool_checks import (_check_index, _check_range, _check_shape, _concrete,
                                              check_invariants, free_order)

NULL_BLOCK = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockPool:
    block_tables: jax.Array  # i32[max_seqs, max_blocks_per_seq]; NULL_BLOCK where unmapped
    seq_lens: jax.Array  # i32[max_seqs]; token slots mapped per sequence slot
    ref_cnt: jax.Array  # i32[num_blocks]
    cached: jax.Array  # bool[num_blocks]; holds a prefix-cache entry
    version: jax.Array  # i32[num_blocks]; bumped each time the block is handed out
    queue: jax.Array  # i32[num_blocks]; ring buffer, free blocks in hand-out order from `head`
    head: jax.Array  # i32[]
    num_free_blocks: jax.Array  # i32[]; entries of the queue in use
    num_blocks: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size


def init(num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int, *, host: bool = False) -> BlockPool:
    """An empty pool: jnp arrays, or numpy ones with `host` (the scheduler's pool)."""
    for name, value, low in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1),
                             ("max_seqs", max_seqs, 1), ("max_blocks_per_seq", max_blocks_per_seq, 1)):
        if not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    i32, a = np.int32, np if host else jnp
    return BlockPool(
        block_tables=a.zeros((max_seqs, max_blocks_per_seq), i32),
        seq_lens=a.zeros((max_seqs,), i32),
        ref_cnt=a.zeros((num_blocks,), i32),
        cached=a.zeros((num_blocks,), bool),
        version=a.zeros((num_blocks,), i32),
        queue=a.arange(1, num_blocks + 1, dtype=i32) % num_blocks,  # 1..num_blocks-1, then unused
        head=a.zeros((), i32),
        num_free_blocks=a.asarray(num_blocks - 1, i32),
        num_blocks=int(num_blocks),
        block_size=int(block_size),
    )


def rows(pool: BlockPool, slots, width: int) -> BlockPool:
    """The pool seen through the sequence slots `slots` (i32[n], -1 = an empty padding row), each
    table cut to its first `width` (static) entries: every function here works on it as on a pool of
    n slots, so a step costs its batch's rows and longest table, not the capacity. Per-block state
    is shared with `pool`; `put_rows` writes the rows back."""
    a = xp(pool.block_tables)
    slots = a.asarray(slots, np.int32)
    live = slots >= 0
    safe = a.where(live, slots, 0)
    tables = a.where(live[:, None], pool.block_tables[safe, :width], NULL_BLOCK)
    return dataclasses.replace(pool, block_tables=tables, seq_lens=a.where(live, pool.seq_lens[safe], 0))


def put_rows(pool: BlockPool, view: BlockPool, slots) -> BlockPool:
    """`view` (from `rows(pool, slots, width)`) merged back into `pool`. A slot's entries past
    `width` must be unmapped (NULL_BLOCK) in `pool`, which holds when `width` covers its blocks."""
    a = xp(pool.block_tables)
    slots = a.asarray(slots, np.int32)
    target = a.where(slots >= 0, slots, pool.max_seqs)  # padding rows: dropped
    width = view.max_blocks_per_seq
    tables = at(pool.block_tables, (target, slice(None, width))).set(view.block_tables)
    return dataclasses.replace(view, block_tables=tables, seq_lens=at(pool.seq_lens, target).set(view.seq_lens))


def uncache_all(pool: BlockPool) -> BlockPool:
    """No block holds a prefix-cache entry any more (vLLM's reset_prefix_cache); the free queue keeps
    its order."""
    return dataclasses.replace(pool, cached=xp(pool.cached).zeros_like(pool.cached))


def _cdiv(n, d):
    return (n + d - 1) // d


def num_free(pool: BlockPool):
    return pool.num_free_blocks


def usage(pool: BlockPool):
    """Fraction of usable blocks held by sequences; cached-but-free blocks count as free (vLLM)."""
    return 1.0 - pool.num_free_blocks / (pool.num_blocks - 1)


def _dispatch(impl, *static_argnums):
    """`impl` as it is on a host pool, jitted on a device pool."""
    jitted = jax.jit(impl, static_argnums=static_argnums)

    def call(pool, *args):
        return impl(pool, *args) if on_host(pool.ref_cnt) else jitted(pool, *args)
    return call


def _i32(pool, x):
    return xp(pool.ref_cnt).asarray(x, np.int32)


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
    return _allocate(pool, _i32(pool, new_lens), k)


def _allocate_impl(pool: BlockPool, new_lens, k: int):
    a = xp(pool.ref_cnt)
    new_lens = a.maximum(new_lens, pool.seq_lens)
    old_nb = _cdiv(pool.seq_lens, pool.block_size)  # i32[max_seqs]
    new_nb = _cdiv(new_lens, pool.block_size)
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


_allocate = _dispatch(_allocate_impl, 2)


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
    pool = _release_impl(pool, a.where(seq_mask, _cdiv(pool.seq_lens, pool.block_size), 0))
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
    return _release(pool, _i32(pool, num_skipped))


def _release_impl(pool: BlockPool, upto):
    """Release entries [0, upto) of every slot (i32[max_seqs]) and unmap them."""
    a = xp(pool.ref_cnt)
    pos = a.arange(pool.max_blocks_per_seq)[None, :]
    leaving = pos < upto[:, None]  # bool[max_seqs, max_blocks_per_seq]
    released = leaving & (pool.block_tables != NULL_BLOCK)
    # Processing order: slot by slot, within a slot tail first.
    order = a.arange(released.size).reshape(released.shape[0], -1)[:, ::-1]
    blocks = a.where(released, pool.block_tables, pool.num_blocks)  # out of range: dropped
    ref_cnt = at(pool.ref_cnt, blocks).add(-1)
    # A block shared by two released slots returns to the queue at its last release.
    last = at(a.full(pool.ref_cnt.shape, -1, np.int32), blocks).max(order)
    safe = a.clip(blocks, 0, pool.num_blocks - 1)
    returns = released & (ref_cnt[safe] == 0) & (last[safe] == order)

    def ranks(mask):  # rank of each returning entry among `mask`, in processing order
        flat = mask[:, ::-1].reshape(-1)
        return (a.cumsum(flat) - 1).reshape(mask.shape)[:, ::-1], a.sum(flat, dtype=np.int32)

    hashed = pool.cached[safe]
    rank_u, num_u = ranks(returns & ~hashed)
    rank_h, num_h = ranks(returns & hashed)
    # Prepended one by one, the last returned block ends up at the head.
    where_u = pool.head - 1 - rank_u
    where_h = pool.head + pool.num_free_blocks + rank_h
    dest = a.where(returns, a.where(hashed, where_h, where_u) % pool.num_blocks, pool.num_blocks)
    return dataclasses.replace(
        pool,
        block_tables=a.where(leaving, NULL_BLOCK, pool.block_tables).astype(np.int32),
        ref_cnt=ref_cnt,
        queue=at(pool.queue, dest).set(pool.block_tables),
        head=a.asarray((pool.head - num_u) % pool.num_blocks, np.int32),
        num_free_blocks=a.asarray(pool.num_free_blocks + num_u + num_h, np.int32),
    )


_free = _dispatch(_free_impl)
_release = _dispatch(_release_impl)


def _remove_from_queue(pool: BlockPool, remove) -> BlockPool:
    """Take the blocks in `remove` (bool[num_blocks]) out of the free queue, keeping the order of the
    rest: one compaction pass, run only when a prefix hit revives a free block."""
    a, n = xp(pool.ref_cnt), pool.num_blocks
    ring = pool.queue[(pool.head + a.arange(n)) % n]  # i32[num_blocks], head first
    keep = (a.arange(n) < pool.num_free_blocks) & ~remove[ring]
    dest = a.where(keep, a.cumsum(keep) - 1, n)
    return dataclasses.replace(pool, queue=at(a.zeros_like(ring), dest).set(ring),
                               head=a.zeros((), np.int32),
                               num_free_blocks=a.asarray(a.sum(keep), np.int32))


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
    block_ids = a.atleast_2d(_i32(pool, block_ids))
    versions = a.full_like(block_ids, -1) if versions is None else a.atleast_2d(_i32(pool, versions))
    pool, ok = _share(pool, a.atleast_1d(_i32(pool, seq)), block_ids, a.atleast_1d(_i32(pool, n)), versions)
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
    rows = at(a.zeros((m, mb), np.int32), (slice(None), slice(None, k))).set(
        a.where(live, block_ids, NULL_BLOCK)[:, :mb])
    target = a.where(apply, slot, pool.max_seqs)  # out of range: dropped
    hits = a.where(apply[:, None] & live, block_ids, pool.num_blocks)
    revived = at(a.zeros((pool.num_blocks,), bool), hits).set(pool.ref_cnt[safe] == 0)
    pool = dataclasses.replace(
        pool,
        block_tables=at(pool.block_tables, target).set(rows),
        seq_lens=at(pool.seq_lens, target).set(n * pool.block_size),
        ref_cnt=at(pool.ref_cnt, hits).add(1),
    )
    pool = cond(a.any(revived), _remove_from_queue, _unchanged, pool, revived)
    return pool, ok


def _unchanged(pool, _):
    return pool


_share = _dispatch(_share_impl)


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
    return _fork(pool, _i32(pool, parent), _i32(pool, child))


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


_fork = _dispatch(_fork_impl)


def mark_cached(pool: BlockPool, block_ids, n) -> BlockPool:
    """The first `n` of `block_ids` (i32[k]) now hold a prefix-cache entry."""
    ids, count = _concrete(block_ids), _concrete(n)
    if ids is not None and count is not None:
        _check_range("n", count, 0, ids.shape[0])
        _check_range("block_ids", ids[: int(count)], 1, pool.num_blocks - 1)
    return _mark_cached(pool, _i32(pool, block_ids), _i32(pool, n))


def _mark_cached_impl(pool: BlockPool, block_ids, n):
    a = xp(pool.ref_cnt)
    ids = a.where((a.arange(block_ids.shape[0]) < n) & (block_ids > NULL_BLOCK), block_ids,
                  pool.num_blocks)
    return dataclasses.replace(pool, cached=at(pool.cached, ids).set(True))


_mark_cached = _dispatch(_mark_cached_impl)


def slot_mapping(pool: BlockPool, seq_ids, positions):
    """KV slot (block_id * block_size + offset) of each token -> i32[...]; -1 where the sequence id
    or the position is negative (padding), or the position is not mapped or was skipped."""
    a = xp(pool.ref_cnt)
    seq_ids = _i32(pool, seq_ids)
    positions = _i32(pool, positions)
    seq = a.clip(seq_ids, 0, pool.max_seqs - 1)
    idx = a.clip(positions // pool.block_size, 0, pool.max_blocks_per_seq - 1)
    slot = pool.block_tables[seq, idx] * pool.block_size + positions % pool.block_size
    valid = (seq_ids >= 0) & (positions >= 0) & (positions < pool.seq_lens[seq])
    return a.where(valid & (pool.block_tables[seq, idx] != NULL_BLOCK), slot, -1).astype(np.int32)
