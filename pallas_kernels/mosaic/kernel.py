"""The Mosaic GPU paged-attention kernel (Hopper sm_90a, Blackwell sm_100a) both wrappers launch:
decode (decode.py) and ragged prefill + decode (ragged.py).

A program (one warpgroup, 128 threads) owns ROWS query rows of one KV head, the rows of one MMA
tile (mma.py: 64 for Hopper's WGMMA, 128 for Blackwell's tcgen05): `num_tokens` consecutive tokens
of one sequence times the KV head's G query heads (row r: token r // G, head r % G; decode has one
token, so G rows and the rest padding). The wrappers gather those rows in XLA into q_rows
[num_tiles, num_kv_heads, ROWS, head_dim] and scatter the output back. Grid (num_tiles,
num_kv_heads, halves): halves is 2 at head_dim 256 (mma.Wgmma.pv_cols), else 1. The program walks
its keys in steps of KEYS = 64 positions: for each step it reads the block-table entries itself
and issues one TMA copy per page (or per 64-row slice of a larger page) of K and V into shared
memory, double-buffered: step t + 1's copies fly while step t computes. q.k^T and p.v run on the
tensor cores with both operands in shared memory (p is written there: the Mosaic GPU interpreter
cannot take a register operand), and an online softmax
in base 2 (FlashAttention-2) runs in registers. Row r sees keys [lo_r, hi_r): causal, within the
window. Steps cut by the union of the rows' spans zero the V rows outside it in shared memory
first: those slots may hold anything, NaN included, and 0 * NaN would poison p.v. A row that sees
no key (padding, seq_len 0) writes zeros.

f32 (q, pages and output): WGMMA has no f32 inputs (its tf32 keeps 10 of f32's 23 mantissa bits),
so each f32 operand goes in as two f16 halves, x = hi + lo with hi = f16(x), lo = f16(x - hi): 22
bits, and a.b = hi.hi + hi.lo + lo.hi (lo.lo lies below 2^-22 of it), three WGMMAs into one f32
accumulator. q is split in XLA, K and V in shared memory a step at a time (one pair of f16
buffers, K's halves then V's), p in registers after scaling by P_SCALE (so that lo of a small
probability keeps its bits: f16's normal range starts at 2^-14). f16 bounds the range: q, K and V
must lie within +-65504, as in an f16 model."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic.mma import engine
from pallas_kernels.mosaic.scratch import KEYS, register_cols, scratch

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: see online_softmax.MASK_VALUE
LOG2E = math.log2(math.e)
P_SCALE = 2.0**10  # f32: p in [0, 1] is split as p * P_SCALE (a power of two: exact both ways)


def split_f16(x):
    """f32 x -> (hi, lo), f16 halves with hi + lo == x to 22 bits (within f16's range)."""
    hi = x.astype(jnp.float16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.float16)


def _kernel(tile_seq_ref, tile_pos_ref, tile_tokens_ref, tables_ref, q_ref, k_ref, v_ref, *refs,
            q_smem, k_smem, v_smem, p_smem, q_barrier, kv_barriers, group, sm_scale, soft_cap,
            sliding_window, splits, engine, mma=None, quantized=None, halves=None, lse_smem=None,
            o_smem=None):
    # tile_seq_ref: i32[num_tiles], the block-table row; tile_pos_ref: i32[num_tiles], the position
    # of the tile's first token in its sequence; tile_tokens_ref: i32[num_tiles], its live tokens
    # (0..ROWS // group) (GMEM)
    # tables_ref: i32[num_seqs, max_blocks_per_seq] (GMEM)
    # q_ref: [num_tiles, num_kv_heads, parts, ROWS, head_dim], o_ref: [num_tiles, num_kv_heads,
    # ROWS, head_dim] (GMEM)
    # k_ref, v_ref: [num_kv_heads, num_blocks, block_size, head_dim] (GMEM)
    # refs: (k_scale_ref, v_scale_ref f32[num_kv_heads, num_blocks, block_size] with int8/fp8
    # pages,) o_ref (, lse_ref f32[num_tiles * splits, num_kv_heads, ROWS] when splits > 1: o_ref
    # then holds each split's output normalized by its own sum, lse_smem [ROWS] stages the log2 sum)
    # q_smem: [parts, ROWS, head_dim]; k_smem: [2, KEYS, head_dim], v_smem: [2, KEYS, cols] (two
    # slots, the pages' dtype; cols: this program's output columns); p_smem: [parts, ROWS, KEYS];
    # parts: 2 with f32 (the f16 halves hi, lo), else 1; kv_barriers: one per slot, an arrival per
    # copy. quantized: dict(k16=[KEYS, head_dim], v16=[KEYS, cols] in q's dtype (the cast pages
    # WGMMA reads), ks=, vs= f32[2, KEYS] (the step's scales)). halves: f16[2, KEYS, head_dim]
    # with f32 pages, the step's K and then V as hi, lo (f32 has head_dim == cols). engine: the
    # mma.py class, ROWS its rows; mma: its scratch (Blackwell's tensor memory and barriers);
    # o_smem: [ROWS, cols] in q's dtype, Blackwell's output staging at head_dim 256
    if splits > 1:
        *refs, o_ref, lse_ref = refs
    else:
        *refs, o_ref = refs
    # The "tile" axis is (tile, split) pairs: a split takes a contiguous share of the tile's steps.
    index, head = lax.axis_index("tile"), lax.axis_index("head")
    tile, split = (index, 0) if splits == 1 else (lax.div(index, splits), lax.rem(index, splits))
    _, num_blocks, block_size, head_dim = k_ref.shape
    cols = v_smem.shape[-1]
    out_cols = pl.ds(lax.axis_index("half") * cols, cols)  # this program's output columns
    chunk = min(block_size, KEYS)
    capacity = tables_ref.shape[1] * block_size  # the keys a block-table row can address
    seq, pos0, tokens = tile_seq_ref[tile], tile_pos_ref[tile], tile_tokens_ref[tile]
    # Keys [lo_min, hi_max): the union of the rows' spans (the first token's window start, the
    # last token's causal end), clamped so a bad seq_len cannot read past its table row.
    hi_max = jnp.clip(pos0 + tokens, 0, capacity)
    lo_min = 0 if sliding_window is None else jnp.maximum(pos0 + 1 - sliding_window, 0)
    first = lo_min // KEYS
    end = jnp.maximum(lax.div(hi_max + KEYS - 1, KEYS), first)
    if splits > 1:  # this split's share of the steps [first, end); a share may be empty
        share = lax.div(end - first + splits - 1, splits)
        first = jnp.minimum(first + split * share, end)
        end = jnp.minimum(first + share, end)

    def fetch(step, slot):  # TMA copies of step's K and V pages into `slot`
        for c in range(KEYS // chunk):
            pos = step * KEYS + c * chunk
            # A step may reach past the table's last column (masked keys) and a corrupt table
            # past the pages: both clamped, as XLA's gather clamps, so no read leaves its array.
            entry = jnp.minimum(pos // block_size, tables_ref.shape[1] - 1)
            block = jnp.clip(tables_ref[seq, entry], 0, num_blocks - 1)
            src, dst = pl.ds(pos % block_size, chunk), pl.ds(c * chunk, chunk)
            plgpu.copy_gmem_to_smem(k_ref.at[head, block, src], k_smem.at[slot, dst],
                                    kv_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[head, block, src, out_cols], v_smem.at[slot, dst],
                                    kv_barriers.at[slot])
            if quantized:
                for scale_ref, scale_smem in zip(refs[:2], (quantized["ks"], quantized["vs"])):
                    plgpu.copy_gmem_to_smem(scale_ref.at[head, block, src],
                                            scale_smem.at[slot, dst], kv_barriers.at[slot])

    for part in range(q_smem.shape[0]):  # a copy each: q_smem whole is 6 strided dims at hd 128
        plgpu.copy_gmem_to_smem(q_ref.at[tile, head, part], q_smem.at[part], q_barrier)
    pl.when(end > first)(lambda: fetch(first, 0))
    plgpu.barrier_wait(q_barrier)

    eng = engine(mma)
    rows, layout = eng.rows, eng.layout  # the [rows, ...] arrays' layout: the MMA's
    tile_layout = plgpu.Layout.WGMMA  # the [KEYS, ...] page tiles' (64 rows)
    m = plgpu.layout_cast(jnp.full((rows,), MASK_VALUE, jnp.float32), layout.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), layout.reduce(1))
    acc = eng.zeros(cols)
    # Row r's span [lo, hi): token r // group sits at position pos0 + r // group.
    token = plgpu.broadcasted_iota(jnp.int32, (rows, KEYS), 0, layout=layout) // group
    row_pos = pos0 + token
    hi = jnp.where((token < tokens) & (row_pos >= 0), jnp.minimum(row_pos + 1, capacity), 0)
    lo = 0 if sliding_window is None else jnp.maximum(hi - sliding_window, 0)

    q_parts, p_parts = ([ref.at[i] for i in range(ref.shape[0])] for ref in (q_smem, p_smem))

    def chunks(n):  # column slices of a [KEYS, n] page tile that registers take (scratch.register_cols)
        size = register_cols(k_smem.dtype)
        return [pl.ds(c, min(size, n)) for c in range(0, n, size)]

    def key_positions(t, shape, dim, layout):  # i32 iota of step t's key positions along `dim`
        return t * KEYS + plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)

    def span_values(t, v):  # v [KEYS, n] with the rows outside [lo_min, hi_max) zeroed
        pos = key_positions(t, v.shape, 0, tile_layout)
        return jnp.where((pos >= lo_min) & (pos < hi_max), v, 0.0)

    def dequantize(pages, scales):  # int8/fp8 [KEYS, n] times their f32 scales [KEYS], in q's dtype
        x = plgpu.load(pages, layout=tile_layout).astype(jnp.float32)
        scale = plgpu.load(scales, layout=tile_layout.reduce(1))
        return (x * lax.broadcast_in_dim(scale, x.shape, [0])).astype(q_smem.dtype)

    def stage_halves(pages, t=None):  # f32 pages [KEYS, head_dim] -> f16 halves in `halves`
        for span in chunks(head_dim):  # (with t: the rows outside step t's span zero)
            x = plgpu.load(pages.at[:, span], layout=tile_layout)
            for part, h in enumerate(split_f16(x if t is None else span_values(t, x))):
                halves.at[part, :, span][...] = h
        plgpu.commit_smem()

    def step(i, carry):
        acc, m, l = carry  # f32[rows, cols] (None on Blackwell: in tensor memory), f32[rows] x 2
        t, slot = first + i, lax.rem(i, 2)
        pl.when(t + 1 < end)(lambda: fetch(t + 1, 1 - slot))
        plgpu.barrier_wait(kv_barriers.at[slot])

        keys, values = [k_smem.at[slot]], [v_smem.at[slot]]
        if halves is not None:  # K's halves now; V's after q.k^T has read them
            keys = values = [halves.at[0], halves.at[1]]
            stage_halves(k_smem.at[slot])
        elif quantized:  # dequantize into k16/v16 (q's dtype), zeroing V outside the span
            k16, v16 = quantized["k16"], quantized["v16"]
            keys, values = [k16], [v16]
            for span in chunks(head_dim):
                k16.at[:, span][...] = dequantize(k_smem.at[slot, :, span], quantized["ks"].at[slot])
            for span in chunks(cols):
                v16.at[:, span][...] = span_values(t, dequantize(v_smem.at[slot, :, span],
                                                                 quantized["vs"].at[slot]))
            plgpu.commit_smem()
        else:
            @pl.when((t * KEYS < lo_min) | ((t + 1) * KEYS > hi_max))
            def _():
                for span in chunks(cols):
                    v = v_smem.at[slot, :, span]
                    v[...] = span_values(t, plgpu.load(v, layout=tile_layout))
                plgpu.commit_smem()

        s = eng.logits(q_parts, keys, (rows, KEYS))
        pos = key_positions(t, (rows, KEYS), 1, layout)
        if soft_cap is None:
            s = s * (sm_scale * LOG2E)
        else:
            s = jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * LOG2E)
        visible = (pos >= lo) & (pos < hi)
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(visible, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l = l * alpha + p.sum(axis=1)
        if halves is not None:
            for ref, h in zip(p_parts, split_f16(p * P_SCALE)):
                ref[...] = h
            stage_halves(v_smem.at[slot], t)
        else:
            p_parts[0][...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
        return eng.accumulate(acc, alpha, p_parts, values), m_new, l

    acc, m, l = lax.fori_loop(0, end - first, step, (acc, m, l))
    # The output's staging buffer, free once the loop is done: with f32, a K slot (f32, KEYS ==
    # rows); else q_smem when it is all the columns, else (a TMA copy reads contiguous shared
    # memory: half of q_smem's columns is not) Blackwell's o_smem, or a 64-row V slot in q's
    # dtype: v_smem's, or with int8/fp8 pages the cast values'.
    stage = (k_smem.at[0] if halves is not None else q_smem.at[0] if cols == head_dim
             else o_smem if o_smem is not None else quantized["v16"] if quantized else v_smem.at[0])
    for c, acc_c in eng.result(acc):  # with f32, p.v summed p * P_SCALE
        l_b = lax.broadcast_in_dim(l if halves is None else l * P_SCALE, acc_c.shape, [0])
        out = jnp.where(l_b > 0, acc_c / jnp.where(l_b > 0, l_b, 1.0), 0.0)  # no key seen: 0
        stage.at[:, pl.ds(c, acc_c.shape[1])][...] = out.astype(stage.dtype)
    if splits > 1:  # log2 of the split's softmax sum, in the loop's base-2 units; MASK_VALUE: no key
        lse_smem[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)) * LOG2E, MASK_VALUE)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, o_ref.at[index, head, :, out_cols])
    if splits > 1:
        pl.when(lax.axis_index("half") == 0)(
            lambda: plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[index, head]))
    plgpu.wait_smem_to_gmem(0)


def attention(
    q_rows,  # [num_tiles, num_kv_heads, ROWS, head_dim]; row r: token r // group, head r % group
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]: q's dtype, or int8/fp8
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    tile_seq,  # i32[num_tiles]: each tile's block-table row
    tile_pos,  # i32[num_tiles]: the position of its first token in the sequence
    tile_tokens,  # i32[num_tiles]: its live tokens, 0..ROWS // group
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
    *,
    group: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    interpret: bool,
    splits: int = 1,
    arch: str = "sm_90",  # "sm_100": Blackwell's tcgen05 (mma.py)
):  # -> [num_tiles, num_kv_heads, ROWS, head_dim]; splits > 1: (out, lse), see decode.combine
    """Launch the kernel: grid (num_tiles * splits, num_kv_heads, head_dim // cols). `splits` > 1
    (split-k, FlashDecoding): each tile's key steps are shared out over `splits` programs, each
    writing its output normalized by its own softmax sum and that sum's log2 (XLA merges
    them: decode.combine), so few long sequences still fill the GPU."""
    _, _, _, head_dim = q_rows.shape
    block_size = k_pages.shape[2]
    dtype, kv_dtype = q_rows.dtype, k_pages.dtype
    cols = min(head_dim, engine(arch).pv_cols)
    f32 = dtype == jnp.float32
    # q_rows -> [num_tiles, num_kv_heads, parts, ROWS, head_dim]: f32's halves, else one part
    q_rows = jnp.stack(split_f16(q_rows), axis=2) if f32 else q_rows[:, :, None]
    inputs = [tile_seq, tile_pos, tile_tokens, block_tables.astype(jnp.int32), q_rows, k_pages,
              v_pages]
    if k_scales is not None:
        inputs += [k_scales, v_scales]
    kernel = functools.partial(_kernel, group=group, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, splits=splits, engine=engine(arch))
    rows = engine(arch).rows
    num_tiles, num_kv_heads = tile_seq.shape[0], k_pages.shape[0]
    out_type = jax.ShapeDtypeStruct((num_tiles * splits, num_kv_heads, rows, head_dim), dtype)
    if splits > 1:
        out_type = (out_type, jax.ShapeDtypeStruct((num_tiles * splits, num_kv_heads, rows), jnp.float32))
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch(dtype, kv_dtype, head_dim, block_size, splits, arch),
        grid=(num_tiles * splits, num_kv_heads, head_dim // cols),
        grid_names=("tile", "head", "half"),
        kernel_name="paged_attention_mosaic",
        # approximate exp2 and tanh: 2^-11 relative error for tanh, below 16-bit inputs' but not f32's
        compiler_params=plgpu.CompilerParams(approx_math=not f32),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*inputs)

