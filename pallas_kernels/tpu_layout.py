"""Our contract over jax's TPU kernel, `jax.experimental.pallas.ops.tpu.ragged_paged_attention`
(RPA v2), and the cache layout it reads: one array `[num_blocks, block_size, 2 * num_kv_heads,
head_dim]` with K and V interleaved per KV head (index 2h is K of head h, 2h + 1 its V).

A cache meant for TPU is made in this layout and kept in it, so no call converts pages. jax ships
no cache-write kernel for it (its source leaves one to be written): the writes here are XLA
scatters, in place when the pages are donated. Untested on TPU hardware: on CPU the tests run
this path through that module's own jnp reference, `ref_ragged_paged_attention`, and lower the
real kernel to its Mosaic custom call for v5e and v6e under `targets.abstract_target`."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import checks, targets
from pallas_kernels.kv_cache import unique_or_dropped
from pallas_kernels.ragged_paged_attention import token_spans

# TPU target -> (num_kv_pages_per_block, num_queries_per_block) for jax's kernel, read from its
# tuned table (tuned_block_sizes.py: bf16, head_dim 128, page sizes 16..256): on v5e and v6e its
# most frequent choice at the longest context it tuned is, for every page size, 16 pages and 32
# queries (it tunes at most 16 pages per sequence: more spill its 32 scalar registers). Capped by
# the table width and the token count, as jax caps them. Passed explicitly, they also spare the
# kernel asking the local device which TPU it is, so it lowers ahead of time under
# targets.abstract_target. Another TPU (or none: the tests' jnp stand-in) gets jax's own lookup.
TPU_BLOCKS = {"v5e": (16, 32), "v6e": (16, 32)}


def tpu_block_sizes(num_tokens, max_blocks_per_seq, target=None):
    """-> the block-size keyword arguments of jax's kernel for `target` (default: the TPU being
    built for); {} when TPU_BLOCKS has no row for it."""
    row = TPU_BLOCKS.get(target or targets.tpu_target())
    if row is None:
        return {}
    pages, queries = row
    return dict(num_kv_pages_per_block=min(pages, max_blocks_per_seq),
                num_queries_per_block=min(queries, num_tokens))


# jax's kernel tiles head_dim by the TPU's 128 lanes (its softmax statistics are 128 lanes wide and
# broadcast over head_dim): a smaller head_dim (64: SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B) trips an
# assert in its lowering. The cache stores head_dim padded to a multiple of 128 with zeros, as
# tpu-inference pads it for the same kernel; zero lanes change no dot product.
LANES = 128


def padded_head_dim(head_dim):
    return -(-head_dim // LANES) * LANES


def kv_pages_shape(num_blocks, block_size, num_kv_heads, head_dim):
    return (num_blocks, block_size, 2 * num_kv_heads, padded_head_dim(head_dim))


def _pad_last(x, size):  # [..., d] -> [..., size], zeros after d
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def write_kv_tpu(
    kv_pages,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; block_id * block_size + offset, -1 = skip
):
    """-> kv_pages with token t's K and V at its slot (zeros past k's head_dim, if the pages are
    wider: padded_head_dim)."""
    num_blocks, block_size, combined, head_dim = kv_pages.shape
    num_slots = num_blocks * block_size
    k, v = _pad_last(k, head_dim), _pad_last(v, head_dim)
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, head_dim)  # K, V per head
    slots = unique_or_dropped(slot_mapping, num_slots)
    flat = kv_pages.reshape(num_slots, combined, head_dim)  # merges major dims: no copy
    flat = flat.at[slots].set(kv.astype(kv_pages.dtype), mode="drop", unique_indices=True)
    return flat.reshape(kv_pages.shape)


def copy_blocks_tpu(
    kv_pages,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    src,  # i32[n]; -1 = skip
    dst,  # i32[n]; -1 = skip
):
    num_blocks = kv_pages.shape[0]
    ok = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    dst = unique_or_dropped(jnp.where(ok, dst, -1), num_blocks)
    return kv_pages.at[dst].set(kv_pages[jnp.where(ok, src, 0)], mode="drop", unique_indices=True)


def ragged_paged_attention_tpu(
    q,  # [num_tokens, num_heads, head_dim]
    kv_pages,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim or padded_head_dim(head_dim)]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]; 0 marks a padding sequence
    query_start_loc,  # i32[num_seqs + 1]
    *,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
):
    """ragged_paged_attention's contract on jax's TPU kernel: its softmax scale defaults to 1, so
    ours is passed; its output for tokens of empty sequences and past query_start_loc[-1] is
    undefined (its reference even returns fewer rows), so those tokens are set to zeros here."""
    # Imported here: the TPU Pallas modules are only needed on TPU (and by the CPU tests).
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    checks.check_rank("q", q, 3)
    checks.check_rank("kv_pages", kv_pages, 4)
    num_tokens, num_heads, head_dim = q.shape
    width = padded_head_dim(head_dim)
    if kv_pages.shape[3] not in (head_dim, width) or kv_pages.shape[2] % 2:
        raise ValueError("kv_pages must be [num_blocks, block_size, 2 * num_kv_heads, "
                         f"{head_dim} or {width}], got {kv_pages.shape}")
    if num_heads % (kv_pages.shape[2] // 2):
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{kv_pages.shape[2] // 2}")
    checks.check_options(sm_scale, soft_cap, sliding_window)
    num_seqs = block_tables.shape[0]
    block_tables, seq_lens, query_start_loc = (
        jnp.asarray(x).astype(jnp.int32) for x in (block_tables, seq_lens, query_start_loc))
    # The engine's cache is already `width` wide (kv_pages_shape); only an unpadded one is copied.
    out = rpa.ragged_paged_attention(
        _pad_last(q, width), _pad_last(kv_pages, width), seq_lens, block_tables, query_start_loc,
        jnp.array([num_seqs], jnp.int32),
        sm_scale=head_dim**-0.5 if sm_scale is None else sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window,
        **tpu_block_sizes(num_tokens, block_tables.shape[1]))
    out = jnp.pad(out[..., :head_dim], ((0, num_tokens - out.shape[0]), (0, 0), (0, 0)))
    _, lo, hi = token_spans(block_tables, seq_lens, query_start_loc, num_tokens, sliding_window)
    return jnp.where((hi > lo)[:, None, None], out, 0).astype(q.dtype)
