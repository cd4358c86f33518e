"""Paged decode attention on Pallas Mosaic GPU (Hopper, sm_90a): one query token per sequence.

One program (one warpgroup, 128 threads) per (sequence, KV head), grid (num_seqs, num_kv_heads).
A WGMMA tile has 64 rows, so the KV head's G query heads are padded to 64 rows in XLA before the
kernel (decode reads keys, not queries: the padding costs 64 / G times a tiny q). The program
walks its sequence's keys in steps of KEYS = 64 positions: for each step it reads the block-table
entries itself and issues one TMA copy per page (or per 64-row slice of a larger page) of K and V
into shared memory, double-buffered: step t + 1's copies fly while step t computes. q.k^T and p.v
run on WGMMA with both operands in shared memory (p is written there: the Mosaic GPU interpreter
cannot take a register operand), and an online softmax in base 2 (FlashAttention-2) runs in
registers. Steps cut by the sequence end or the window start zero the V rows outside
[lo, seq_len) in shared memory first: those slots may hold anything, NaN included, and 0 * NaN
would poison p.v. A padding row (seq_len 0) visits no step and writes zeros."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import checks
from pallas_kernels.mosaic.support import supports

ROWS = 64  # a warpgroup's WGMMA tile: the GQA group is padded to it
KEYS = 64  # key positions per step: the N of q.k^T and the K of p.v
PV_COLS = 128  # p.v in column slices of at most this many, each a fresh WGMMA accumulator
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: see online_softmax.MASK_VALUE
LOG2E = math.log2(math.e)


def _decode_kernel(tables_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem,
                   p_smem, q_barrier, kv_barriers, *, sm_scale, soft_cap, sliding_window):
    # tables_ref: i32[num_seqs, max_blocks_per_seq]; lens_ref: i32[num_seqs] (GMEM)
    # q_ref, o_ref: [num_seqs, num_kv_heads, ROWS, head_dim] (GMEM; rows past G are padding)
    # k_ref, v_ref: [num_kv_heads, num_blocks, block_size, head_dim] (GMEM)
    # q_smem: [ROWS, head_dim], also the output's staging buffer; k_smem, v_smem: [2, KEYS,
    # head_dim] (two slots); p_smem: [ROWS, KEYS]; kv_barriers: one per slot, an arrival per copy
    seq, head = lax.axis_index("seq"), lax.axis_index("head")
    _, num_blocks, block_size, head_dim = k_ref.shape
    chunk = min(block_size, KEYS)
    # Clamped to what the block table can address, so a bad seq_len cannot read past its row.
    length = jnp.clip(lens_ref[seq], 0, tables_ref.shape[1] * block_size)
    lo = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    first = lo // KEYS
    end = jnp.maximum(lax.div(length + KEYS - 1, KEYS), first)

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
            plgpu.copy_gmem_to_smem(v_ref.at[head, block, src], v_smem.at[slot, dst],
                                    kv_barriers.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_barrier)
    pl.when(end > first)(lambda: fetch(first, 0))
    plgpu.barrier_wait(q_barrier)

    cols = min(head_dim, PV_COLS)
    rows_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), rows_layout)
    l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), rows_layout)
    accs = tuple(plgpu.layout_cast(jnp.zeros((ROWS, cols), jnp.float32), plgpu.Layout.WGMMA)
                 for _ in range(head_dim // cols))

    def qk(slot, acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
        return acc_ref[...]

    def pv(slot, c, acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot, :, pl.ds(c * cols, cols)])
        return acc_ref[...]

    def step(i, carry):
        accs, m, l = carry  # f32[ROWS, cols] each, f32[ROWS], f32[ROWS]
        t, slot = first + i, lax.rem(i, 2)
        pl.when(t + 1 < end)(lambda: fetch(t + 1, 1 - slot))
        plgpu.barrier_wait(kv_barriers.at[slot])

        @pl.when((t * KEYS < lo) | ((t + 1) * KEYS > length))
        def _():
            v = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA)
            pos = t * KEYS + plgpu.broadcasted_iota(jnp.int32, v.shape, 0,
                                                    layout=plgpu.Layout.WGMMA)
            v_smem.at[slot][...] = jnp.where((pos >= lo) & (pos < length), v, 0.0)
            plgpu.commit_smem()

        s = pl.run_scoped(functools.partial(qk, slot), plgpu.ACC((ROWS, KEYS), jnp.float32))
        if soft_cap is None:
            s = s * (sm_scale * LOG2E)
        else:
            s = jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * LOG2E)
        pos = t * KEYS + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        visible = (pos >= lo) & (pos < length)
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(visible, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l = l * alpha + p.sum(axis=1)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()
        accs = tuple(
            acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            + pl.run_scoped(functools.partial(pv, slot, c), plgpu.ACC((ROWS, cols), jnp.float32))
            for c, acc in enumerate(accs))
        return accs, m_new, l

    accs, _, l = lax.fori_loop(0, end - first, step, (accs, m, l))
    for c, acc in enumerate(accs):  # rows that saw no key (seq_len 0) give zeros
        l_b = lax.broadcast_in_dim(l, acc.shape, [0])
        out = jnp.where(l_b > 0, acc / jnp.where(l_b > 0, l_b, 1.0), 0.0)
        q_smem.at[:, pl.ds(c * cols, cols)][...] = out.astype(q_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[seq, head])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "interpret"))
def _paged_attention_mosaic(q, k_pages, v_pages, block_tables, seq_lens, *, sm_scale, soft_cap,
                            sliding_window, interpret):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    q_rows = jnp.pad(q.reshape(num_seqs, num_kv_heads, group, head_dim),
                     ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    # 128-byte swizzled tiles of 8 x 64 16-bit elements: the layout WGMMA reads without conflicts.
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    copies = KEYS // min(block_size, KEYS)
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        scratch_types=[
            plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=tiles),
            plgpu.SMEM((2, KEYS, head_dim), q.dtype, transforms=tiles),
            plgpu.SMEM((2, KEYS, head_dim), q.dtype, transforms=tiles),
            plgpu.SMEM((ROWS, KEYS), q.dtype, transforms=tiles),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=2 * copies, num_barriers=2),
        ],
        grid=(num_seqs, num_kv_heads), grid_names=("seq", "head"),
        kernel_name="paged_attention_mosaic",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), q_rows, k_pages, v_pages)
    return out[:, :, :group].reshape(q.shape)


def paged_attention_mosaic(
    q,  # [num_seqs, num_heads, head_dim], one query token per sequence; bf16 or f16
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim], q's dtype
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]; 0 marks a padding row, whose output is zeros
    *,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
    interpret=False,  # True: the Mosaic GPU interpreter, on the CPU
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: int8/fp8 pages (rejected: not yet)
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
):
    """paged_attention's contract (decode over keys [0, seq_len), or the last `sliding_window` of
    them) on Mosaic GPU. Takes what `support.supports` accepts (bf16/f16, head_dim 64 or 128,
    power-of-two block_size >= 8, unquantized pages), else raises ValueError saying why."""
    _, _, head_dim = checks.check_attention(q, k_pages, v_pages, block_tables, seq_lens,
                                            k_scales=k_scales, v_scales=v_scales,
                                            interpret=bool(interpret))
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, block_tables {block_tables.shape[0]}")
    checks.check_options(sm_scale, soft_cap, sliding_window)
    reason = supports(q.dtype, head_dim, k_pages.shape[2], k_pages.dtype)
    if reason:
        raise ValueError(f"paged_attention_mosaic: {reason}")
    if q.shape[0] == 0:
        return jnp.zeros_like(q)
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    return _paged_attention_mosaic(
        q, k_pages, v_pages, block_tables, seq_lens, sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret))
