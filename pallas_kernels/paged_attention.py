"""Paged decode attention: one query token per sequence, reading K/V through block tables."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference


def paged_attention_reference(
    q,  # [num_seqs, num_heads, head_dim]
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]; 0 marks a padding row
    *,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
):
    """Decode is the ragged case with one query token per sequence."""
    num_seqs = q.shape[0]
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, block_tables, seq_lens, jnp.arange(num_seqs + 1, dtype=jnp.int32),
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
