"""The block pool's state (`BlockPool`, `init`, row views) and its free queue's two bulk moves:
releasing table entries to the queue and taking revived blocks out of it. `paged_jax.core.block_pool`
builds every public operation on these; its docstring gives the queue's order (vLLM's)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.core.arrays import at, on_host, xp

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


def cdiv(n, d):
    return (n + d - 1) // d


def num_free(pool: BlockPool):
    return pool.num_free_blocks


def usage(pool: BlockPool):
    """Fraction of usable blocks held by sequences; cached-but-free blocks count as free (vLLM)."""
    return 1.0 - pool.num_free_blocks / (pool.num_blocks - 1)


def dispatch(impl, *static_argnums):
    """`impl` as it is on a host pool, jitted on a device pool."""
    jitted = jax.jit(impl, static_argnums=static_argnums)

    def call(pool, *args):
        return impl(pool, *args) if on_host(pool.ref_cnt) else jitted(pool, *args)
    return call


def as_i32(pool, x):
    return xp(pool.ref_cnt).asarray(x, np.int32)


def release_entries(pool: BlockPool, upto):
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


def remove_from_queue(pool: BlockPool, remove) -> BlockPool:
    """Take the blocks in `remove` (bool[num_blocks]) out of the free queue, keeping the order of the
    rest: one compaction pass, run only when a prefix hit revives a free block."""
    a, n = xp(pool.ref_cnt), pool.num_blocks
    ring = pool.queue[(pool.head + a.arange(n)) % n]  # i32[num_blocks], head first
    keep = (a.arange(n) < pool.num_free_blocks) & ~remove[ring]
    dest = a.where(keep, a.cumsum(keep) - 1, n)
    return dataclasses.replace(pool, queue=at(a.zeros_like(ring), dest).set(ring),
                               head=a.zeros((), np.int32),
                               num_free_blocks=a.asarray(a.sum(keep), np.int32))
