"""Ragged paged attention: any number of query tokens per sequence, causal (prefill, chunked prefill
and decode rows in one batch), reading K/V through block tables.

Kernel (Pallas, lowered through Triton): the wrapper builds, in XLA, a tile table of static size
`num_tokens // block_q + num_seqs + 1` (an upper bound on the sum over sequences of
cdiv(q_len, block_q), plus the padding tokens past query_start_loc[-1] as one more sequence)
mapping each program to (sequence, first query token). Grid (num_tiles, num_kv_heads): a program
folds its tile's block_q tokens x G query heads into block_m rows (vLLM's unified Triton attention
does the same), so a K/V tile is loaded once for all of them, and visits the KV tiles from its
first token's window start to its last token's causal end. The padding tokens' tiles write zeros,
tiles past the last real one write nothing: every output element is written exactly once.
Tile sizes: RAGGED_TILES, per arch, dtype and head_dim; pass block_m, block_n, num_warps and
num_stages to override."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import checks, targets
from pallas_kernels.online_softmax import (MASK_VALUE, attend_tiles, normalize, pow2_at_least,
                                           tile_ranges)
from pallas_kernels.quantization import dequantize
from pallas_kernels.triton_call import plgpu, triton_call

# arch -> (bytes per KV element, head_dim padded to a power of two >= 64) -> (block_m query rows,
# block_n keys per tile, num_warps, num_stages). Every row compiles without spills for each group
# size and block size (tests/pallas_kernels/test_cubin.py; the costs:
# scripts/check_gpu_kernels.py). f32 dots at HIGHEST precision run on the FMA units with slices of
# whole operand tiles in each thread's registers, so f32 tiles are smaller and get 8 warps (64 x 64
# at 4 warps spilled 751 stores at hd64 and 7.6 KB of stack at hd128); 16-bit hd128 gets 8 warps
# too (at 4 it took 240 registers on sm_90 and spilled on sm_80), and 16-bit hd256 16 rows (32
# took 248 with a soft cap). The A100's ptxas needs more registers for the same 16-bit tiles: there
# hd64 gets 8 warps (sm_90's row took all 255). Untuned for speed (no GPU was at hand): the
# largest tiles that fit with room.
RAGGED_TILES = {
    "sm_90": {(2, 64): (64, 64, 4, 2), (2, 128): (64, 64, 8, 2), (2, 256): (16, 32, 4, 2),
              (4, 64): (64, 32, 8, 2), (4, 128): (32, 16, 8, 2), (4, 256): (16, 32, 8, 2)},
}
RAGGED_TILES["sm_80"] = {**RAGGED_TILES["sm_90"], (2, 64): (64, 64, 8, 2)}
# int8/fp8 pages: the cast keys and the scale vectors take registers; f32 hd128 at its row above
# spilled 135 stores on sm_90 (scripts/check_gpu_kernels.py).
QUANTIZED_RAGGED_TILES = {(4, 128): (16, 16, 8, 2)}


def ragged_tiles(dtype, head_dim, arch=None, quantized=False):
    """-> dict(block_m, block_n, num_warps, num_stages): RAGGED_TILES' row for queries of `dtype`
    and `head_dim` on `arch` (default: the GPU being built for); QUANTIZED_RAGGED_TILES' first, for
    int8/fp8 pages."""
    rows = targets.nearest(RAGGED_TILES, arch or targets.gpu_arch())
    if quantized:
        rows = {**rows, **QUANTIZED_RAGGED_TILES}
    block_m, block_n, num_warps, num_stages = rows[jnp.dtype(dtype).itemsize,
                                                   pow2_at_least(head_dim, 64)]
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def _ragged_kernel(tile_seq_ref, tile_start_ref, qsl_ref, lens_ref, tables_ref, q_ref, k_ref, v_ref,
                   *out_refs, group, block_m, block_n, head_dim, num_heads, sm_scale, soft_cap,
                   sliding_window, quantized=False):
    # tile_seq_ref: i32[num_tiles], the tile's sequence (num_seqs: the padding tokens)
    # tile_start_ref: i32[num_tiles], the tile's first query token
    # qsl_ref: i32[num_seqs + 1], non-decreasing within [0, num_tokens]
    # lens_ref: i32[num_seqs]; tables_ref: i32[num_seqs, max_blocks_per_seq]
    # q_ref: [num_tokens * num_heads, head_dim]
    # k_ref, v_ref: [num_blocks, block_size, head_dim] (this program's KV head)
    # out_refs: o_ref [num_tokens * num_heads, head_dim] (an aliased `out` input comes first);
    #   quantized: after ks_ref, vs_ref f32[num_blocks, block_size] (this KV head's scales)
    scales = dict(k_scale_ref=out_refs[0], v_scale_ref=out_refs[1]) if quantized else {}
    o_ref = out_refs[-1]
    tile, head = pl.program_id(0), pl.program_id(1)
    num_seqs = lens_ref.shape[0]
    num_rows = q_ref.shape[0]
    num_tokens = num_rows // num_heads
    seq, start = tile_seq_ref[tile], tile_start_ref[tile]
    real = seq < num_seqs
    q_start = qsl_ref[seq]
    q_end = jnp.where(real, qsl_ref[jnp.minimum(seq + 1, num_seqs)], num_tokens)
    max_len = tables_ref.shape[1] * k_ref.shape[1]
    length = jnp.where(real, jnp.clip(lens_ref[jnp.minimum(seq, num_seqs - 1)], 0, max_len), 0)
    n_tok = jnp.clip(q_end - start, 0, block_m // group)

    r = jnp.arange(block_m)
    i = r // group  # token within the tile; r % group: query head within the KV head's group
    live = i < n_tok
    rows = jnp.where(live, (start + i) * num_heads + head * group + r % group, num_rows)
    dims = jnp.arange(pow2_at_least(head_dim, 16))[None, :]
    mask = live[:, None] & (dims < head_dim)
    q = plgpu.load(q_ref.at[rows[:, None], dims], mask=mask, other=0)

    # Token j of a sequence with q_len tokens sits at position length - q_len + j and sees keys
    # [pos + 1 - sliding_window, pos]; a token whose position is negative sees nothing.
    first = length - (q_end - q_start) + (start - q_start)  # position of the tile's first token
    pos = first + i
    hi = jnp.where(live & (pos >= 0), pos + 1, 0)
    hi_min = jnp.maximum(first + 1, 0)
    hi_max = jnp.where(n_tok > 0, jnp.maximum(first + n_tok, 0), 0)
    if sliding_window is None:
        lo = lo_min = lo_max = jnp.zeros_like(hi_max)
    else:
        lo = jnp.maximum(hi - sliding_window, 0)[:, None]
        lo_min = jnp.maximum(hi_min - sliding_window, 0)
        lo_max = jnp.maximum(hi_max - sliding_window, 0)
    ranges = tile_ranges(lo_min, lo_max, hi_min, hi_max, block_n)
    _, l, acc = attend_tiles(q, k_ref, v_ref, tables_ref, jnp.minimum(seq, num_seqs - 1), lo,
                             hi[:, None], lo_min, hi_max, ranges, block_n=block_n,
                             head_dim=head_dim, sm_scale=sm_scale, soft_cap=soft_cap, **scales)
    plgpu.store(o_ref.at[rows[:, None], dims], normalize(acc, l).astype(o_ref.dtype), mask=mask)


def _tile_table(query_start_loc, num_tokens, block_q, num_tiles):
    """-> (qsl i32[num_seqs + 1], tile_seq i32[num_tiles], tile_start i32[num_tiles]).

    query_start_loc is clipped to [0, num_tokens] and made non-decreasing, so a malformed one
    cannot send a program outside q; tiles past the last real one get no tokens."""
    num_seqs = query_start_loc.shape[0] - 1
    qsl = jax.lax.cummax(jnp.clip(query_start_loc.astype(jnp.int32), 0, num_tokens))
    ends = jnp.append(qsl[1:], num_tokens)  # i32[num_seqs + 1]; the last: padding tokens
    tiles = (ends - qsl + block_q - 1) // block_q
    cum = jnp.cumsum(tiles)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cum, tile, side="right"), num_seqs).astype(jnp.int32)
    start = qsl[seq] + (tile - (cum[seq] - tiles[seq])) * block_q
    return qsl, seq, jnp.where(tile < cum[-1], start, num_tokens).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "sliding_window", "interpret", "block_m", "block_n", "num_warps",
    "num_stages"))
def _ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, out,
                            k_scales, v_scales, *, sm_scale, soft_cap, sliding_window, interpret,
                            block_m, block_n, num_warps, num_stages):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_seqs + 1
    qsl, tile_seq, tile_start = _tile_table(query_start_loc, num_tokens, block_q, num_tiles)
    num_rows = num_tokens * num_heads
    kv_spec = pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda t, h: (h, 0, 0, 0))
    inputs = [tile_seq, tile_start, qsl, seq_lens.astype(jnp.int32),
              block_tables.astype(jnp.int32), q.reshape(num_rows, head_dim), k_pages, v_pages]
    in_specs = [pl.no_block_spec] * 6 + [kv_spec, kv_spec]
    quantized = k_scales is not None
    if quantized:  # only then: the unquantized kernel's code is unchanged
        scale_spec = pl.BlockSpec((None, num_blocks, block_size), lambda t, h: (h, 0, 0))
        inputs, in_specs = inputs + [k_scales, v_scales], in_specs + [scale_spec, scale_spec]
    kernel = functools.partial(
        _ragged_kernel, group=group, block_m=block_m, block_n=block_n, head_dim=head_dim,
        num_heads=num_heads, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        quantized=quantized)
    o = triton_call(
        kernel, inputs, jax.ShapeDtypeStruct((num_rows, head_dim), q.dtype),
        grid=(num_tiles, num_kv_heads), name="ragged_paged_attention", in_specs=in_specs,
        out=None if out is None else out.reshape(num_rows, head_dim), interpret=interpret,
        num_warps=num_warps, num_stages=num_stages)
    return o.reshape(q.shape)


def ragged_paged_attention(
    q,  # [num_tokens, num_heads, head_dim]
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]; 0 marks a padding sequence
    query_start_loc,  # i32[num_seqs + 1]; sequence s owns q[qsl[s]:qsl[s+1]]
    *,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
    interpret=False,
    out=None,  # [num_tokens, num_heads, head_dim]: buffer written in place (aliased), like vLLM's
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
    **tuning,  # block_m (query rows per tile: tokens x group heads), block_n, num_warps, num_stages
):
    """Sequence s's tokens are the last qsl[s+1] - qsl[s] of its seq_lens[s] tokens and attend
    causally (and within `sliding_window`); tokens past qsl[num_seqs] give zeros. Quantized pages
    (quantization.py) are dequantized in registers with their scales."""
    num_heads, num_kv_heads, head_dim = checks.check_attention(
        q, k_pages, v_pages, block_tables, seq_lens, out, k_scales, v_scales,
        interpret=bool(interpret))
    num_seqs = block_tables.shape[0]
    checks.check_int("query_start_loc", query_start_loc, (num_seqs + 1,))
    checks.check_options(sm_scale, soft_cap, sliding_window)
    group = num_heads // num_kv_heads
    tuning = checks.check_tuning(tuning, ragged_tiles(q.dtype, head_dim,
                                                      quantized=k_scales is not None),
                                 pow2=("block_m", "block_n", "num_warps"))
    if tuning["block_n"] < 16:
        raise ValueError(f"block_n must be >= 16 (the smallest tl.dot), got {tuning['block_n']}")
    # A tile holds at least one token's whole group, and 16 rows (the smallest tl.dot).
    tuning["block_m"] = max(tuning["block_m"], pow2_at_least(group, 16))
    if q.shape[0] == 0 or num_seqs == 0:  # nothing to attend: every token is padding
        return jnp.zeros_like(q)
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    return _ragged_paged_attention(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, out, k_scales, v_scales,
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret), **tuning)


def token_spans(block_tables, seq_lens, query_start_loc, num_tokens, sliding_window):
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
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
):
    """Plain jnp: for each token, a loop over chunks of its sequence's blocks with an f32 online
    softmax. Chunks no token needs are not visited, so it is also the fast path on CPU. Quantized
    pages are dequantized chunk by chunk before the dot products."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    seq, lo, hi = token_spans(block_tables, seq_lens, query_start_loc, num_tokens, sliding_window)

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
        k, v = (pages[:, blocks].reshape(num_kv_heads, num_tokens, span, head_dim)
                for pages in (k_pages, v_pages))
        if k_scales is None:
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        else:
            k, v = (dequantize(x, scales[:, blocks].reshape(num_kv_heads, num_tokens, span))
                    for x, scales in ((k, k_scales), (v, v_scales)))
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
