"""Paged decode attention on Pallas Mosaic GPU: one query token per sequence (kernel.py). A program
per (sequence, KV head): its G query heads are padded to the kernel's 64 rows in XLA (decode reads
keys, not queries: the padding costs 64 / G times a tiny q)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels.mosaic import kernel
from pallas_kernels.mosaic.support import check_supported


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "interpret"))
def _paged_attention_mosaic(q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales, *,
                            sm_scale, soft_cap, sliding_window, interpret):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    q_rows = jnp.pad(q.reshape(num_seqs, num_kv_heads, group, head_dim),
                     ((0, 0), (0, 0), (0, kernel.ROWS - group), (0, 0)))
    lens = seq_lens.astype(jnp.int32)
    out = kernel.attention(
        q_rows, k_pages, v_pages, block_tables, jnp.arange(num_seqs, dtype=jnp.int32), lens - 1,
        (lens > 0).astype(jnp.int32), k_scales, v_scales, group=group, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret)
    return out[:, :, :group].reshape(q.shape)


def paged_attention_mosaic(
    q,  # [num_seqs, num_heads, head_dim], one query token per sequence; bf16 or f16
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]: q's dtype, or int8/fp8
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]; 0 marks a padding row, whose output is zeros
    *,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
    interpret=False,  # True: the Mosaic GPU interpreter, on the CPU
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
):
    """paged_attention's contract (decode over keys [0, seq_len), or the last `sliding_window` of
    them) on Mosaic GPU. Takes what `support.supports` accepts (bf16/f16, head_dim 64 or 128,
    power-of-two block_size >= 8; pages of q's dtype, or int8/fp8 ones with their scales, which
    are cast to q's dtype in shared memory and scaled as quantization.py says), else raises
    ValueError saying why."""
    _, _, head_dim = checks.check_attention(q, k_pages, v_pages, block_tables, seq_lens,
                                            k_scales=k_scales, v_scales=v_scales,
                                            interpret=bool(interpret))
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, block_tables {block_tables.shape[0]}")
    checks.check_options(sm_scale, soft_cap, sliding_window)
    check_supported("paged_attention_mosaic", q, k_pages)
    if q.shape[0] == 0:
        return jnp.zeros_like(q)
    return _paged_attention_mosaic(
        q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales,
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret))
