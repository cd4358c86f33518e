"""Paged decode attention: one query token per sequence, reading K/V through block tables.

Kernel (Pallas, lowered through Triton): grid (num_seqs, num_kv_heads, num_splits). A program
folds the G query heads of its KV head into the rows of its tiles, padded in registers to 16 rows
(the smallest tl.dot), so each K/V tile is loaded once for the whole group. Split-k (FlashDecoding;
vLLM's paged_attention_v2): when num_seqs * num_kv_heads programs cannot fill the GPU, each
sequence's own tiles are shared out over num_splits programs, whose f32 partials (m, l, acc) a
second kernel merges in f32."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import checks, targets
from pallas_kernels.online_softmax import (MASK_VALUE, attend_tiles, normalize, pow2_at_least,
                                           tile_ranges)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.triton_call import plgpu, triton_call

# Decode is a stream of K/V reads: enough programs to keep several per SM of an H100/H200 (132
# SMs) reading. Untuned (no GPU was at hand); override with num_splits.
TARGET_PROGRAMS = 1024
MIN_TILES_PER_SPLIT = 4  # below this a split's fixed cost outweighs its share of the reads

# arch -> (bytes per KV element, head_dim padded to a power of two >= 64) -> (block_n keys per
# tile, num_warps, num_stages). Every row compiles without spills for each group size and block
# size (tests/pallas_kernels/test_cubin.py; the costs: scripts/check_gpu_kernels.py). f32 dots at
# HIGHEST precision run on the FMA units, each thread holding slices of whole operand tiles, so
# f32 gets 8 warps and, at hd >= 128, fewer keys per tile (64 keys at 4 warps spilled 189 stores
# at hd128 on sm_90); so does 16-bit hd256 (32 keys at 4 warps spilled with a soft cap on sm_80).
# Untuned for speed (no GPU was at hand): 2-stage cp.async pipelines of tiles that fit with room.
DECODE_TILES = {
    "sm_90": {(2, 64): (64, 4, 2), (2, 128): (64, 4, 2), (2, 256): (16, 8, 2),
              (4, 64): (64, 8, 2), (4, 128): (32, 8, 2), (4, 256): (16, 8, 2)},
}
# They fit the A100 too (<= 50 KB of 163 KB shared), but for 16-bit hd96 (Phi-3): at hd128's row
# it spilled one store (128 registers, 8 bytes of stack) at block_size 32; half the keys a step
# need 72-96 registers and spill none (scripts/check_gpu_kernels.py --head-dims 96 --archs sm_80).
DECODE_TILES["sm_80"] = {**DECODE_TILES["sm_90"], (2, 96): (32, 4, 2)}
# int8/fp8 pages: the cast keys and the scale vectors take registers. At the rows above f32 hd128
# spilled 94 stores (sm_90) and 16-bit hd128 one store (sm_90, 4 warps)
# (scripts/check_gpu_kernels.py --quantized).
QUANTIZED_DECODE_TILES = {(2, 128): (64, 8, 2), (4, 128): (16, 8, 2)}


def decode_tiles(dtype, head_dim, arch=None, quantized=False):
    """-> dict(block_n, num_warps, num_stages): DECODE_TILES' row for queries of `dtype` and
    `head_dim` on `arch` (default: the GPU being built for); QUANTIZED_DECODE_TILES' first, for
    int8/fp8 pages."""
    rows = targets.nearest(DECODE_TILES, arch or targets.gpu_arch())
    key = jnp.dtype(dtype).itemsize, pow2_at_least(head_dim, 64)
    if quantized:
        rows = {**rows, **QUANTIZED_DECODE_TILES}
    elif (key[0], head_dim) in rows:  # a row for this head_dim itself, ahead of its power of two's
        key = key[0], head_dim
    block_n, num_warps, num_stages = rows[key]
    return dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def _group_rows(seq, head, group, block_m, num_kv_heads, num_rows, head_dim):
    """Rows of q [num_seqs * num_heads, head_dim] this program owns: its KV head's query heads.
    -> rows i32[block_m], live bool[block_m], dims i32[1, head_dim_p] and the load/store mask
    bool[block_m, head_dim_p]. Dead rows point past the end, so a stray write could only be
    dropped."""
    r = jnp.arange(block_m)
    live = r < group
    rows = jnp.where(live, (seq * num_kv_heads + head) * group + r, num_rows)
    dims = jnp.arange(pow2_at_least(head_dim, 16))[None, :]
    return rows, live, dims, live[:, None] & (dims < head_dim)


def _decode_kernel(tables_ref, lens_ref, q_ref, k_ref, v_ref, *out_refs, group, block_m, block_n,
                   head_dim, num_kv_heads, num_splits, sm_scale, soft_cap, sliding_window,
                   quantized=False):
    # tables_ref: i32[num_seqs, max_blocks_per_seq]; lens_ref: i32[num_seqs]
    # q_ref: [num_seqs * num_heads, head_dim]
    # k_ref, v_ref: [num_blocks, block_size, head_dim] (this program's KV head)
    # quantized: out_refs starts with ks_ref, vs_ref f32[num_blocks, block_size] (its scales)
    # out_refs: o_ref [num_seqs * num_heads, head_dim] when num_splits == 1 (an aliased `out`
    #   input comes first, untouched), else acc_ref f32[num_splits, num_seqs * num_heads, head_dim],
    #   m_ref f32[num_splits, num_seqs * num_heads], l_ref f32[num_splits, num_seqs * num_heads]
    scales = dict(k_scale_ref=out_refs[0], v_scale_ref=out_refs[1]) if quantized else {}
    out_refs = out_refs[2:] if quantized else out_refs
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, live, dims, mask = _group_rows(seq, head, group, block_m, num_kv_heads, q_ref.shape[0],
                                         head_dim)
    q = plgpu.load(q_ref.at[rows[:, None], dims], mask=mask, other=0)
    # Clamped to what the block table can address, so a bad seq_len cannot read past its row.
    length = jnp.clip(lens_ref[seq], 0, tables_ref.shape[1] * k_ref.shape[1])
    lo = jnp.zeros_like(length)
    if sliding_window is not None:
        lo = jnp.maximum(length - sliding_window, 0)
    ranges = tile_ranges(lo, lo, length, length, block_n, split, num_splits)
    m, l, acc = attend_tiles(q, k_ref, v_ref, tables_ref, seq, lo, length, lo, length, ranges,
                             block_n=block_n, head_dim=head_dim, sm_scale=sm_scale,
                             soft_cap=soft_cap, **scales)
    if num_splits == 1:
        o_ref = out_refs[-1]
        plgpu.store(o_ref.at[rows[:, None], dims], normalize(acc, l).astype(o_ref.dtype), mask=mask)
    else:
        acc_ref, m_ref, l_ref = out_refs
        plgpu.store(acc_ref.at[split, rows[:, None], dims], acc, mask=mask)
        plgpu.store(m_ref.at[split, rows], m, mask=live)
        plgpu.store(l_ref.at[split, rows], l, mask=live)


def _combine_kernel(acc_ref, m_ref, l_ref, *out_refs, group, block_m, head_dim, num_kv_heads,
                    num_splits):
    # acc_ref: f32[num_splits, num_seqs * num_heads, head_dim]
    # m_ref, l_ref: f32[num_splits, num_seqs * num_heads]
    # out_refs: o_ref [num_seqs * num_heads, head_dim] (an aliased `out` input comes first)
    o_ref = out_refs[-1]
    rows, live, dims, mask = _group_rows(pl.program_id(0), pl.program_id(1), group, block_m,
                                         num_kv_heads, o_ref.shape[0], head_dim)

    def merge(s, carry):  # the online-softmax rescale, one split at a time, all in f32
        m, l, acc = carry
        m_s = plgpu.load(m_ref.at[s, rows], mask=live, other=MASK_VALUE)
        l_s = plgpu.load(l_ref.at[s, rows], mask=live, other=0.0)
        acc_s = plgpu.load(acc_ref.at[s, rows[:, None], dims], mask=mask, other=0.0)
        m_new = jnp.maximum(m, m_s)
        alpha, beta = jnp.exp2(m - m_new), jnp.exp2(m_s - m_new)  # m is in base 2
        return m_new, l * alpha + l_s * beta, acc * alpha[:, None] + acc_s * beta[:, None]

    carry = (jnp.full((block_m,), MASK_VALUE, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.zeros((block_m, dims.shape[1]), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_splits, merge, carry)
    plgpu.store(o_ref.at[rows[:, None], dims], normalize(acc, l).astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "sliding_window", "interpret", "block_n", "num_splits", "num_warps",
    "num_stages"))
def _paged_attention(q, k_pages, v_pages, block_tables, seq_lens, out, k_scales, v_scales, *,
                     sm_scale, soft_cap, sliding_window, interpret, block_n, num_splits, num_warps,
                     num_stages):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    block_m = pow2_at_least(group, 16)
    num_rows = num_seqs * num_heads
    q_rows = q.reshape(num_rows, head_dim)  # free: rows are (seq, kv head, group member)
    out_rows = None if out is None else out.reshape(num_rows, head_dim)
    params = dict(group=group, block_m=block_m, head_dim=head_dim, num_kv_heads=num_kv_heads,
                  num_splits=num_splits)
    launch = dict(interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    kv_spec = pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda s, h, p: (h, 0, 0, 0))
    in_specs = [pl.no_block_spec] * 3 + [kv_spec, kv_spec]
    inputs = (block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), q_rows, k_pages, v_pages)
    quantized = k_scales is not None
    if quantized:  # only then: the unquantized kernel's code is unchanged
        scale_spec = pl.BlockSpec((None, num_blocks, block_size), lambda s, h, p: (h, 0, 0))
        in_specs, inputs = in_specs + [scale_spec, scale_spec], (*inputs, k_scales, v_scales)
    kernel = functools.partial(_decode_kernel, block_n=block_n, sm_scale=sm_scale,
                               soft_cap=soft_cap, sliding_window=sliding_window,
                               quantized=quantized, **params)
    grid = (num_seqs, num_kv_heads, num_splits)
    out_shape = jax.ShapeDtypeStruct((num_rows, head_dim), q.dtype)
    if num_splits == 1:
        o = triton_call(kernel, inputs, out_shape, grid=grid, name="paged_attention_decode",
                        in_specs=in_specs, out=out_rows, **launch)
        return o.reshape(q.shape)
    partials = triton_call(kernel, inputs, [
        jax.ShapeDtypeStruct((num_splits, num_rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_rows), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_rows), jnp.float32),
    ], grid=grid, name="paged_attention_decode_split", in_specs=in_specs, **launch)
    o = triton_call(functools.partial(_combine_kernel, **params), tuple(partials), out_shape,
                    grid=(num_seqs, num_kv_heads), name="paged_attention_combine", out=out_rows,
                    **launch)
    return o.reshape(q.shape)


def _default_splits(num_seqs, num_kv_heads, max_len, block_n, sliding_window):
    """Enough programs for about TARGET_PROGRAMS, but at least MIN_TILES_PER_SPLIT tiles each."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= TARGET_PROGRAMS // 2:
        return 1
    tiles = pl.cdiv(max_len, block_n)
    if sliding_window is not None:
        tiles = min(tiles, pl.cdiv(sliding_window, block_n) + 1)
    return max(1, min(pl.cdiv(TARGET_PROGRAMS, programs), tiles // MIN_TILES_PER_SPLIT, 16))


def paged_attention(
    q,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]; 0 marks a padding row, whose output is zeros
    *,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
    interpret=False,
    out=None,  # [num_seqs, num_heads, head_dim]: buffer written in place (aliased), like vLLM's
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
    **tuning,  # block_n (keys per tile), num_splits, num_warps, num_stages
):
    """Decode attention of each sequence's newest token over its cached keys `[0, seq_len)`, or its
    last `sliding_window` of them. Tuning defaults: DECODE_TILES, and num_splits from the shapes.
    Quantized pages (quantization.py) are dequantized in registers with their scales."""
    _, num_kv_heads, head_dim = checks.check_attention(q, k_pages, v_pages, block_tables,
                                                       seq_lens, out, k_scales, v_scales,
                                                       interpret=bool(interpret))
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, block_tables {block_tables.shape[0]}")
    checks.check_options(sm_scale, soft_cap, sliding_window)
    num_seqs, max_blocks = block_tables.shape
    defaults = decode_tiles(q.dtype, head_dim, quantized=k_scales is not None)
    block_n = tuning.get("block_n", defaults["block_n"])
    defaults["num_splits"] = _default_splits(num_seqs, num_kv_heads, max_blocks * k_pages.shape[2],
                                             block_n, sliding_window)
    tuning = checks.check_tuning(tuning, defaults, pow2=("block_n", "num_warps"))
    if tuning["block_n"] < 16:
        raise ValueError(f"block_n must be >= 16 (the smallest tl.dot), got {tuning['block_n']}")
    if num_seqs == 0:
        return jnp.zeros_like(q)
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    return _paged_attention(q, k_pages, v_pages, block_tables, seq_lens, out, k_scales, v_scales,
                            sm_scale=float(sm_scale),
                            soft_cap=None if soft_cap is None else float(soft_cap),
                            sliding_window=None if sliding_window is None else int(sliding_window),
                            interpret=bool(interpret), **tuning)


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
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
):
    """Decode is the ragged case with one query token per sequence."""
    num_seqs = q.shape[0]
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, block_tables, seq_lens, jnp.arange(num_seqs + 1, dtype=jnp.int32),
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
        v_scales=v_scales)
