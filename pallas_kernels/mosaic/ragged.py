"""Ragged paged attention on Pallas Mosaic GPU: any number of query tokens per sequence, causal
(prefill, chunked prefill after a prefix hit, and decode rows in one batch), through kernel.py.

The tile table is the Triton kernel's (ragged_paged_attention._tile_table): a static
`num_tokens // block_q + num_seqs + 1` tiles of block_q = 64 // G consecutive tokens of one
sequence, so a tile's tokens times the KV head's G query heads fill the kernel's 64 rows. XLA
gathers each tile's rows of q before the kernel and scatters the output rows back to tokens after
it; padding tokens (past query_start_loc[-1]) belong to no tile and give zeros."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels.mosaic import kernel
from pallas_kernels.mosaic.mma import engine
from pallas_kernels.mosaic.support import check_supported
from pallas_kernels.ragged_paged_attention import _tile_table


def _tiles(query_start_loc, seq_lens, num_tokens, block_q, num_tiles):
    """-> (tile_seq, tile_start, tile_pos, tile_tokens), each i32[num_tiles]: the tile's sequence
    (its block-table row), first token, that token's position in the sequence, live tokens."""
    num_seqs = seq_lens.shape[0]
    qsl, tile_seq, tile_start = _tile_table(query_start_loc, num_tokens, block_q, num_tiles)
    seq = jnp.minimum(tile_seq, num_seqs - 1)
    q_start, q_end = qsl[seq], qsl[seq + 1]
    tokens = jnp.where(tile_seq < num_seqs, jnp.clip(q_end - tile_start, 0, block_q), 0)
    pos = seq_lens.astype(jnp.int32)[seq] - (q_end - q_start) + (tile_start - q_start)
    return seq, tile_start, pos, tokens.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "interpret", "arch"))
def _ragged_paged_attention_mosaic(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                                   k_scales, v_scales, *, sm_scale, soft_cap, sliding_window,
                                   interpret, arch):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    rows = engine(arch).rows
    block_q = rows // group
    num_tiles = num_tokens // block_q + block_tables.shape[0] + 1
    seq, start, pos, tokens = _tiles(query_start_loc, seq_lens, num_tokens, block_q, num_tiles)

    r = jnp.arange(rows)  # row r: token r // group, head r % group of the KV head
    token = jnp.clip(start[:, None] + r // group, 0, num_tokens - 1)  # i32[num_tiles, rows]
    head = jnp.arange(num_kv_heads)[:, None] * group + r % group  # i32[num_kv_heads, rows]
    q_rows = q[token[:, None, :], head[None, :, :]]  # [num_tiles, num_kv_heads, rows, head_dim]
    out = kernel.attention(q_rows, k_pages, v_pages, block_tables, seq, pos, tokens, k_scales,
                           v_scales, group=group,
                           sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                           interpret=interpret, arch=arch)

    # Each token's tile and row within it; tokens no tile owns (padding) stay uncovered.
    j = jnp.arange(block_q)
    dest = jnp.where(j < tokens[:, None], start[:, None] + j, num_tokens)  # i32[num_tiles, block_q]
    tile_of = jnp.zeros(num_tokens, jnp.int32).at[dest].set(
        jnp.broadcast_to(jnp.arange(num_tiles, dtype=jnp.int32)[:, None], dest.shape), mode="drop")
    row_of = jnp.zeros(num_tokens, jnp.int32).at[dest].set(
        jnp.broadcast_to(j.astype(jnp.int32), dest.shape), mode="drop")
    covered = jnp.zeros(num_tokens, bool).at[dest].set(True, mode="drop")
    h = jnp.arange(num_heads)
    out = out[tile_of[:, None], (h // group)[None, :], row_of[:, None] * group + h % group]
    return jnp.where(covered[:, None, None], out, 0).astype(q.dtype)


def ragged_paged_attention_mosaic(
    q,  # [num_tokens, num_heads, head_dim]; bf16, f16 or f32
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]: q's dtype, or int8/fp8
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]; 0 marks a padding sequence
    query_start_loc,  # i32[num_seqs + 1]; sequence s owns q[qsl[s]:qsl[s+1]]
    *,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
    interpret=False,  # True: the Mosaic GPU interpreter, on the CPU
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
    arch=None,  # "sm_90" (Hopper) or "sm_100" (Blackwell); default: the GPU's, else "sm_90"
):
    """ragged_paged_attention's contract on Mosaic GPU: sequence s's tokens are the last
    qsl[s+1] - qsl[s] of its seq_lens[s] tokens and attend causally (and within
    `sliding_window`); tokens past qsl[num_seqs] give zeros. Takes what `support.supports`
    accepts, else raises ValueError saying why."""
    num_heads, num_kv_heads, head_dim = checks.check_attention(
        q, k_pages, v_pages, block_tables, seq_lens, k_scales=k_scales, v_scales=v_scales,
        interpret=bool(interpret))
    num_seqs = block_tables.shape[0]
    checks.check_int("query_start_loc", query_start_loc, (num_seqs + 1,))
    checks.check_options(sm_scale, soft_cap, sliding_window)
    arch = check_supported("ragged_paged_attention_mosaic", q, k_pages, arch)
    if num_heads // num_kv_heads > engine(arch).rows:
        raise ValueError(f"ragged_paged_attention_mosaic: {num_heads // num_kv_heads} query heads "
                         f"per KV head do not fit a {engine(arch).rows}-row tile")
    if q.shape[0] == 0 or num_seqs == 0:  # nothing to attend: every token is padding
        return jnp.zeros_like(q)
    return _ragged_paged_attention_mosaic(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, k_scales, v_scales,
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret), arch=arch)
