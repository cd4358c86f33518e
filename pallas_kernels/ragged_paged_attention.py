"""Ragged paged attention: any number of query tokens per sequence, causal (prefill, chunked prefill
and decode rows in one batch), reading K/V through block tables."""
from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _token_spans(block_tables, seq_lens, query_start_loc, num_tokens, sliding_window):
    """For every query token: its sequence, and the key positions [lo, hi) it may attend to."""
    num_seqs = block_tables.shape[0]
    tok = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start_loc[1:], tok, side="right"), 0, num_seqs - 1)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = seq_lens[seq] - q_len + (tok - query_start_loc[seq])  # the token's own position
    live = (tok < query_start_loc[num_seqs]) & (pos >= 0)
    hi = jnp.where(live, pos + 1, 0)
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(hi - sliding_window, 0)
    return seq, lo, hi


def ragged_paged_attention_reference(
    q,  # [num_tokens, num_heads, head_dim]
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    *,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
    blocks_per_chunk=8,
):
    """Plain jnp: for each token, a loop over chunks of its sequence's blocks with an f32 online
    softmax. Chunks no token needs are not visited, so it is also the fast path on CPU."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    seq, lo, hi = _token_spans(block_tables, seq_lens, query_start_loc, num_tokens, sliding_window)

    max_blocks = block_tables.shape[1]
    chunk = min(blocks_per_chunk, max_blocks)
    pad = -max_blocks % chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))[seq]  # i32[num_tokens, padded_blocks]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    span = chunk * block_size
    first = jnp.min(jnp.where(hi > lo, lo, 2**30)) // span
    last = (jnp.max(hi) + span - 1) // span

    def body(c, carry):
        m, l, acc = carry  # f32[T, KVH, G], f32[T, KVH, G], f32[T, KVH, G, D]
        blocks = jax.lax.dynamic_slice_in_dim(tables, c * chunk, chunk, axis=1)  # i32[T, chunk]
        k = k_pages[:, blocks].reshape(num_kv_heads, num_tokens, span, head_dim).astype(jnp.float32)
        v = v_pages[:, blocks].reshape(num_kv_heads, num_tokens, span, head_dim).astype(jnp.float32)
        s = jnp.einsum("tkgd,ktld->tkgl", qg, k) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = c * span + jnp.arange(span)
        visible = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] < hi[:, None])  # bool[T, span]
        s = jnp.where(visible[:, None, None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgl,ktld->tkgd", p, v)
        return m_new, l, acc

    init = (jnp.full((num_tokens, num_kv_heads, group), MASK_VALUE, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, jnp.maximum(last, first), body, init)
    out = jnp.where((hi > lo)[:, None, None, None], acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
