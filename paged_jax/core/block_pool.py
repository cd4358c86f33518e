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
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

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


def init(num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int) -> BlockPool:
    for name, value, low in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1),
                             ("max_seqs", max_seqs, 1), ("max_blocks_per_seq", max_blocks_per_seq, 1)):
        if not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    i32 = jnp.int32
    return BlockPool(
        block_tables=jnp.zeros((max_seqs, max_blocks_per_seq), i32),
        seq_lens=jnp.zeros((max_seqs,), i32),
        ref_cnt=jnp.zeros((num_blocks,), i32),
        cached=jnp.zeros((num_blocks,), bool),
        version=jnp.zeros((num_blocks,), i32),
        queue=jnp.arange(1, num_blocks + 1, dtype=i32) % num_blocks,  # 1..num_blocks-1, then unused
        head=jnp.zeros((), i32),
        num_free_blocks=jnp.asarray(num_blocks - 1, i32),
        num_blocks=int(num_blocks),
        block_size=int(block_size),
    )


def rows(pool: BlockPool, slots, width: int) -> BlockPool:
    """The pool seen through the sequence slots `slots` (i32[n], -1 = an empty padding row), each
    table cut to its first `width` (static) entries: every function here works on it as on a pool of
    n slots, so a step costs its batch's rows and longest table, not the capacity. Per-block state
    is shared with `pool`; `put_rows` writes the rows back."""
    live = slots >= 0
    safe = jnp.where(live, slots, 0)
    tables = jnp.where(live[:, None], pool.block_tables[safe, :width], NULL_BLOCK)
    return dataclasses.replace(pool, block_tables=tables, seq_lens=jnp.where(live, pool.seq_lens[safe], 0))


def put_rows(pool: BlockPool, view: BlockPool, slots) -> BlockPool:
    """`view` (from `rows(pool, slots, width)`) merged back into `pool`. A slot's entries past
    `width` must be unmapped (NULL_BLOCK) in `pool`, which holds when `width` covers its blocks."""
    target = jnp.where(slots >= 0, slots, pool.max_seqs)  # padding rows: dropped
    width = view.max_blocks_per_seq
    tables = pool.block_tables.at[target, :width].set(view.block_tables, mode="drop")
    return dataclasses.replace(view, block_tables=tables, seq_lens=pool.seq_lens.at[target].set(view.seq_lens, mode="drop"))


def uncache_all(pool: BlockPool) -> BlockPool:
    """No block holds a prefix-cache entry any more (vLLM's reset_prefix_cache); the free queue keeps
    its order."""
    return dataclasses.replace(pool, cached=jnp.zeros_like(pool.cached))


def _cdiv(n, d):
    return (n + d - 1) // d


def num_free(pool: BlockPool):
    return pool.num_free_blocks


def usage(pool: BlockPool):
    """Fraction of usable blocks held by sequences; cached-but-free blocks count as free (vLLM)."""
    return 1.0 - pool.num_free_blocks / (pool.num_blocks - 1)


def free_order(pool: BlockPool) -> np.ndarray:
    """Host-side: the free blocks in the order `allocate` hands them out (vLLM's free queue)."""
    queue = np.asarray(pool.queue)
    return queue[(int(pool.head) + np.arange(int(pool.num_free_blocks))) % pool.num_blocks]


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
    return _allocate(pool, jnp.asarray(new_lens, jnp.int32), k)


@functools.partial(jax.jit, static_argnums=2)
def _allocate(pool: BlockPool, new_lens, k: int):
    new_lens = jnp.maximum(new_lens, pool.seq_lens)
    old_nb = _cdiv(pool.seq_lens, pool.block_size)  # i32[max_seqs]
    new_nb = _cdiv(new_lens, pool.block_size)
    need = new_nb - old_nb
    total = jnp.sum(need)
    ok = (total <= pool.num_free_blocks) & (total <= k) & jnp.all(new_nb <= pool.max_blocks_per_seq)

    candidates = pool.queue[(pool.head + jnp.arange(k)) % pool.num_blocks]  # i32[k], hand-out order
    first_rank = jnp.cumsum(need) - need  # i32[max_seqs]
    pos = jnp.arange(pool.max_blocks_per_seq)[None, :]
    fresh = ok & (pos >= old_nb[:, None]) & (pos < new_nb[:, None])  # bool[max_seqs, max_blocks_per_seq]
    rank = jnp.clip(first_rank[:, None] + pos - old_nb[:, None], 0, k - 1)
    taken = jnp.where(ok & (jnp.arange(k) < total), candidates, pool.num_blocks)  # else dropped
    taken_n = jnp.where(ok, total, 0)
    return dataclasses.replace(
        pool,
        block_tables=jnp.where(fresh, candidates[rank], pool.block_tables),
        seq_lens=jnp.where(ok, new_lens, pool.seq_lens),
        ref_cnt=pool.ref_cnt.at[taken].set(1, mode="drop"),
        cached=pool.cached.at[taken].set(False, mode="drop"),
        version=pool.version.at[taken].add(1, mode="drop"),
        head=(pool.head + taken_n) % pool.num_blocks,
        num_free_blocks=pool.num_free_blocks - taken_n,
    ), ok


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
    return _free(pool, jnp.asarray(seq_mask, bool))


@jax.jit
def _free(pool: BlockPool, seq_mask):
    pool = _release(pool, jnp.where(seq_mask, _cdiv(pool.seq_lens, pool.block_size), 0))
    return dataclasses.replace(pool, seq_lens=jnp.where(seq_mask, 0, pool.seq_lens))


def remove_skipped(pool: BlockPool, num_skipped) -> BlockPool:
    """Sliding window (vLLM's `remove_skipped_blocks`): entries [0, num_skipped) of each slot
    (i32[max_seqs]), which no query of that sequence will read again, become the null block and
    release their blocks as `free` does; lengths stay, so positions keep their table entries.
    Entries already skipped (null) are left alone."""
    skipped = _concrete(num_skipped)
    if skipped is not None:
        _check_shape("num_skipped", skipped, (pool.max_seqs,))
        _check_range("num_skipped", skipped, 0, pool.max_blocks_per_seq)
    return _release(pool, jnp.asarray(num_skipped, jnp.int32))


@jax.jit
def _release(pool: BlockPool, upto):
    """Release entries [0, upto) of every slot (i32[max_seqs]) and unmap them."""
    pos = jnp.arange(pool.max_blocks_per_seq)[None, :]
    leaving = pos < upto[:, None]  # bool[max_seqs, max_blocks_per_seq]
    released = leaving & (pool.block_tables != NULL_BLOCK)
    # Processing order: slot by slot, within a slot tail first.
    order = jnp.arange(released.size).reshape(released.shape[0], -1)[:, ::-1]
    blocks = jnp.where(released, pool.block_tables, pool.num_blocks)  # out of range: dropped
    ref_cnt = pool.ref_cnt.at[blocks].add(-1, mode="drop")
    # A block shared by two released slots returns to the queue at its last release.
    last = jnp.full_like(pool.ref_cnt, -1).at[blocks].max(order, mode="drop")
    safe = jnp.clip(blocks, 0, pool.num_blocks - 1)
    returns = released & (ref_cnt[safe] == 0) & (last[safe] == order)

    def ranks(mask):  # rank of each returning entry among `mask`, in processing order
        flat = mask[:, ::-1].reshape(-1)
        return (jnp.cumsum(flat) - 1).reshape(mask.shape)[:, ::-1], jnp.sum(flat, dtype=jnp.int32)

    hashed = pool.cached[safe]
    rank_u, num_u = ranks(returns & ~hashed)
    rank_h, num_h = ranks(returns & hashed)
    # Prepended one by one, the last returned block ends up at the head.
    where_u = pool.head - 1 - rank_u
    where_h = pool.head + pool.num_free_blocks + rank_h
    dest = jnp.where(returns, jnp.where(hashed, where_h, where_u) % pool.num_blocks, pool.num_blocks)
    return dataclasses.replace(
        pool,
        block_tables=jnp.where(leaving, NULL_BLOCK, pool.block_tables),
        ref_cnt=ref_cnt,
        queue=pool.queue.at[dest].set(pool.block_tables, mode="drop"),
        head=(pool.head - num_u) % pool.num_blocks,
        num_free_blocks=pool.num_free_blocks + num_u + num_h,
    )


def _remove_from_queue(pool: BlockPool, remove) -> BlockPool:
    """Take the blocks in `remove` (bool[num_blocks]) out of the free queue, keeping the order of the
    rest: one compaction pass, run only when a prefix hit revives a free block."""
    n = pool.num_blocks
    ring = pool.queue[(pool.head + jnp.arange(n)) % n]  # i32[num_blocks], head first
    keep = (jnp.arange(n) < pool.num_free_blocks) & ~remove[ring]
    dest = jnp.where(keep, jnp.cumsum(keep) - 1, n)
    return dataclasses.replace(pool, queue=jnp.zeros_like(ring).at[dest].set(ring, mode="drop"),
                               head=jnp.zeros((), jnp.int32),
                               num_free_blocks=jnp.sum(keep, dtype=jnp.int32))


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
    batched = jnp.ndim(seq) == 1
    ids, count, slots = _concrete(block_ids), _concrete(n), _concrete(seq)
    if slots is not None:
        for slot in np.atleast_1d(slots):
            if not (batched and slot == -1):
                _check_index("seq", slot, pool.max_seqs)
    if ids is not None and count is not None:
        for row, c in zip(np.atleast_2d(ids), np.atleast_1d(count)):
            _check_range("n", c, 0, min(row.shape[0], pool.max_blocks_per_seq))
            _check_range("block_ids", row[: int(c)], 1, pool.num_blocks - 1)
    block_ids = jnp.atleast_2d(jnp.asarray(block_ids, jnp.int32))
    versions = jnp.full_like(block_ids, -1) if versions is None else jnp.atleast_2d(jnp.asarray(versions, jnp.int32))
    pool, ok = _share(pool, jnp.atleast_1d(jnp.asarray(seq, jnp.int32)), block_ids,
                      jnp.atleast_1d(jnp.asarray(n, jnp.int32)), versions)
    return pool, (ok if batched else ok[0])


@jax.jit
def _share(pool: BlockPool, seqs, block_ids, n, versions):
    m, k = block_ids.shape
    mb = pool.max_blocks_per_seq
    live = (jnp.arange(k)[None, :] < n[:, None]) & (seqs >= 0)[:, None]  # bool[m, k]
    safe = jnp.clip(block_ids, 0, pool.num_blocks - 1)
    usable = ((block_ids > NULL_BLOCK) & (block_ids < pool.num_blocks)
              & ((pool.ref_cnt[safe] > 0) | pool.cached[safe])
              & ((versions < 0) | (versions == pool.version[safe])))
    # A block mapped twice into one row: sort each row's live ids, compare neighbours (O(k log k)).
    ordered = jnp.sort(jnp.where(live, block_ids, pool.num_blocks + jnp.arange(k)), axis=1)
    repeated = jnp.any(ordered[:, 1:] == ordered[:, :-1], axis=1)
    slot = jnp.clip(seqs, 0, pool.max_seqs - 1)
    ok = (seqs < 0) | ((pool.seq_lens[slot] == 0) & (n >= 0) & (n <= min(k, mb))
                       & jnp.all(usable | ~live, axis=1) & ~repeated)
    apply = ok & (seqs >= 0)
    rows = jnp.zeros((m, mb), jnp.int32).at[:, :k].set(jnp.where(live, block_ids, NULL_BLOCK)[:, :mb])
    target = jnp.where(apply, slot, pool.max_seqs)  # out of range: dropped
    hits = jnp.where(apply[:, None] & live, block_ids, pool.num_blocks)
    revived = jnp.zeros((pool.num_blocks,), bool).at[hits].set(pool.ref_cnt[safe] == 0, mode="drop")
    pool = dataclasses.replace(
        pool,
        block_tables=pool.block_tables.at[target].set(rows, mode="drop"),
        seq_lens=pool.seq_lens.at[target].set(n * pool.block_size, mode="drop"),
        ref_cnt=pool.ref_cnt.at[hits].add(1, mode="drop"),
    )
    pool = jax.lax.cond(jnp.any(revived), _remove_from_queue, lambda p, r: p, pool, revived)
    return pool, ok


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
    return _fork(pool, jnp.asarray(parent, jnp.int32), jnp.asarray(child, jnp.int32))


@jax.jit
def _fork(pool: BlockPool, parent, child):
    length = pool.seq_lens[parent]
    num_full = length // pool.block_size
    has_tail = length % pool.block_size != 0
    ok = ((pool.seq_lens[child] == 0) & (parent != child)
          & (~has_tail | (pool.num_free_blocks > 0)))
    row = pool.block_tables[parent]
    shared = jnp.where(ok & (jnp.arange(pool.max_blocks_per_seq) < num_full), row, NULL_BLOCK)
    pool = dataclasses.replace(
        pool,
        block_tables=pool.block_tables.at[child].set(jnp.where(ok, shared, pool.block_tables[child])),
        seq_lens=pool.seq_lens.at[child].set(jnp.where(ok, num_full * pool.block_size, pool.seq_lens[child])),
        ref_cnt=pool.ref_cnt.at[jnp.where(shared > 0, shared, pool.num_blocks)].add(1, mode="drop"),
    )
    pool, _ = _allocate(pool, pool.seq_lens.at[child].set(jnp.where(ok, length, pool.seq_lens[child])), 1)
    copy = ok & has_tail
    copy_src = jnp.where(copy, row[jnp.minimum(num_full, pool.max_blocks_per_seq - 1)], -1)
    copy_dst = jnp.where(copy, pool.block_tables[child, jnp.minimum(num_full, pool.max_blocks_per_seq - 1)], -1)
    return pool, ok, copy_src, copy_dst


def mark_cached(pool: BlockPool, block_ids, n) -> BlockPool:
    """The first `n` of `block_ids` (i32[k]) now hold a prefix-cache entry."""
    ids, count = _concrete(block_ids), _concrete(n)
    if ids is not None and count is not None:
        _check_range("n", count, 0, ids.shape[0])
        _check_range("block_ids", ids[: int(count)], 1, pool.num_blocks - 1)
    return _mark_cached(pool, jnp.asarray(block_ids, jnp.int32), jnp.asarray(n, jnp.int32))


@jax.jit
def _mark_cached(pool: BlockPool, block_ids, n):
    ids = jnp.where((jnp.arange(block_ids.shape[0]) < n) & (block_ids > NULL_BLOCK), block_ids,
                    pool.num_blocks)
    return dataclasses.replace(pool, cached=pool.cached.at[ids].set(True, mode="drop"))


def slot_mapping(pool: BlockPool, seq_ids, positions):
    """KV slot (block_id * block_size + offset) of each token -> i32[...]; -1 where the sequence id
    or the position is negative (padding), or the position is not mapped or was skipped."""
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    seq = jnp.clip(seq_ids, 0, pool.max_seqs - 1)
    idx = jnp.clip(positions // pool.block_size, 0, pool.max_blocks_per_seq - 1)
    slot = pool.block_tables[seq, idx] * pool.block_size + positions % pool.block_size
    valid = (seq_ids >= 0) & (positions >= 0) & (positions < pool.seq_lens[seq])
    return jnp.where(valid & (pool.block_tables[seq, idx] != NULL_BLOCK), slot, -1)


# ---------------------------------------------------------------------------------------------
# host-side checks


def check_invariants(pool: BlockPool) -> None:
    """Raise AssertionError naming the first broken invariant (host-side, for tests and debugging)."""
    tables, lens, ref = (np.asarray(a) for a in (pool.block_tables, pool.seq_lens, pool.ref_cnt))
    nb = -(-lens // pool.block_size)
    assert np.all((lens >= 0) & (nb <= pool.max_blocks_per_seq)), f"seq_lens out of range: {lens}"
    mapped = np.arange(pool.max_blocks_per_seq)[None, :] < nb[:, None]
    skipped = mapped & (tables == NULL_BLOCK)  # sliding window: out-of-window entries, leading only
    assert not np.any(skipped[:, 1:] & ~skipped[:, :-1]), "a null entry follows a mapped block"
    held = mapped & ~skipped
    assert np.all(tables[held] < pool.num_blocks), "a mapped table entry is out of range"
    assert np.all(tables[~mapped] == NULL_BLOCK), "an unmapped table entry is not the null block"
    for s in np.flatnonzero(nb):
        row = tables[s, : nb[s]][held[s, : nb[s]]]
        assert len(set(row.tolist())) == len(row), f"slot {s} maps a block twice: {row}"
    counts = np.bincount(tables[held], minlength=pool.num_blocks)
    assert ref[NULL_BLOCK] == 0, f"the null block has ref count {ref[NULL_BLOCK]}"
    bad = np.flatnonzero(counts != ref)
    assert bad.size == 0, (f"ref counts differ from table references at blocks {bad[:8]}: "
                           f"ref_cnt {ref[bad[:8]]}, references {counts[bad[:8]]}")
    queued = free_order(pool)
    free_blocks = np.flatnonzero(ref == 0)[1:]
    assert sorted(queued.tolist()) == free_blocks.tolist(), \
        f"the free queue {queued.tolist()} is not the set of blocks with ref count 0 {free_blocks.tolist()}"
    used = int(np.sum(ref > 0))
    assert len(queued) + used == pool.num_blocks - 1, f"free {len(queued)} + used {used} != {pool.num_blocks - 1}"


def _concrete(x):
    """x as a numpy array, or None while tracing (jitted callers get no host-side validation)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _check_shape(name, x, shape):
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")


def _check_range(name, x, low, high):
    if x is None:
        return
    x = np.asarray(x)
    bad = x[(x < low) | (x > high)]
    if bad.size:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {bad.tolist()[:8]}")


def _check_index(name, x, size):
    if x is not None and (np.ndim(x) != 0 or not 0 <= int(x) < size):
        raise ValueError(f"{name} must be a slot index in [0, {size}), got {np.asarray(x).tolist()}")
