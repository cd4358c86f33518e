"""Host-side views and checks of a block pool: the free queue's order, the invariants tests assert,
and the argument validation its entry points run on concrete values."""
from __future__ import annotations

import jax
import numpy as np

NULL_BLOCK = 0


def free_order(pool) -> np.ndarray:
    """The free blocks in the order `allocate` hands them out (vLLM's free queue)."""
    queue = np.asarray(pool.queue)
    return queue[(int(pool.head) + np.arange(int(pool.num_free_blocks))) % pool.num_blocks]


def check_invariants(pool) -> None:
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
