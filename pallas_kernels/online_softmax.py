"""The inner loop both attention kernels share: an online softmax (FlashAttention-2, Dao 2023) over
tiles of `block_n` key positions of one sequence, gathered token by token through its block table,
so a tile spans several blocks when they are small (block_size 8: 8 blocks per 64-key tile) or part
of one when they are large, and any max_blocks_per_seq works without padding anything.

A program owns `block_m` query rows of one KV head (for GQA, the group's query heads folded into
rows, as vLLM's unified Triton attention does), so every K/V tile is loaded once for the whole
group. Row `r` sees key positions `[lo[r], hi[r])`. The tiles a program visits are split into
three ranges by `tile_ranges`: a masked head (tiles cut by the sliding-window start), an unmasked
middle (every row sees every key), a masked tail (tiles cut by the sequence end or the causal
diagonal). Masked tiles mask their loads as well as their logits, so no byte outside a row's span
is read; tiles outside every row's span are never visited."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton_call import plgpu

# Finite, so a row that has seen only masked keys rescales by exp2(MASK - MASK) = 1, not by
# exp2(-inf - -inf) = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Logits are kept in base 2 (exp2 is the GPU's native exponential), as FlashAttention-2 does.
LOG2E = 1.4426950408889634


def pow2_at_least(n: int, floor: int = 1) -> int:
    """Triton tiles are powers of two."""
    return max(floor, 1 << max(0, n - 1).bit_length())


def zero(dtype):
    """The `other` of a masked load from a ref of `dtype`: jax's Triton lowering casts an int
    literal to the ref's dtype, which it cannot do for fp8 (a float literal it can)."""
    return 0.0 if jnp.dtype(dtype) == jnp.float8_e4m3fn else 0


def dot(a, b, *, trans_b=False):
    """f32 accumulation; HIGHEST keeps f32 inputs off TF32 (1e-5 accuracy), and is the plain
    tensor-core path for bf16/f16."""
    return plgpu.dot(a, b, trans_b=trans_b, precision=jax.lax.Precision.HIGHEST)


def tile_ranges(lo_min, lo_max, hi_min, hi_max, block_n, split=0, num_splits=1):
    """Tile indices (a, b, c, d): [a, b) masked, [b, c) unmasked, [c, d) masked.

    lo_min/lo_max: smallest/largest window start of the program's rows; hi_min/hi_max: smallest/
    largest end. A tile is unmasked when it lies inside every row's span. With split-k, split
    `split` of `num_splits` takes an equal share of this sequence's own tiles (not of
    max_blocks_per_seq), so short sequences are not left to a few busy programs."""
    first = lo_min // block_n
    end = jnp.maximum(pl.cdiv(hi_max, block_n), first)
    if num_splits > 1:
        per = pl.cdiv(end - first, num_splits)
        first = jnp.minimum(first + split * per, end)
        end = jnp.minimum(first + per, end)
    full_first = jnp.clip(pl.cdiv(lo_max, block_n), first, end)
    full_end = jnp.clip(hi_min // block_n, full_first, end)
    return first, full_first, full_end, end


def attend_tiles(
    q,  # [block_m, head_dim_p] in the KV dtype
    k_ref,  # [num_blocks, block_size, head_dim]: one KV head's pages
    v_ref,  # [num_blocks, block_size, head_dim]
    tables_ref,  # i32[num_seqs, max_blocks_per_seq]
    seq,  # i32[]: the block-table row
    lo,  # i32[] or i32[block_m, 1]: first visible key position per row
    hi,  # i32[] or i32[block_m, 1]: one past the last visible key position per row
    lo_min,  # i32[]: min(lo) over live rows
    hi_max,  # i32[]: max(hi) over live rows
    ranges,  # (a, b, c, d) from tile_ranges
    *,
    block_n: int,
    head_dim: int,
    sm_scale: float,
    soft_cap: float | None,
    k_scale_ref=None,  # f32[num_blocks, block_size]: quantized pages' per-token scales, or None
    v_scale_ref=None,  # f32[num_blocks, block_size]
):
    """-> (m f32[block_m], l f32[block_m], acc f32[block_m, head_dim_p]): running max (of base-2
    logits), softmax denominator and unnormalised output. With scales (int8/fp8 pages, see
    quantization.py) the keys and values are cast to q's dtype in registers, the logits multiplied
    by the key scales and the probabilities by the value scales; without, the code is as before."""
    block_m, head_dim_p = q.shape
    num_blocks, block_size, _ = k_ref.shape
    dims = jnp.arange(head_dim_p)[None, :]
    dim_ok = None if head_dim == head_dim_p else dims < head_dim

    def load_kv(ref, blocks, offsets, need):  # -> [block_n, head_dim_p]
        mask = need[:, None] if need is not None else None
        if dim_ok is not None:
            mask = dim_ok if mask is None else mask & dim_ok
        idx = ref.at[blocks[:, None], offsets[:, None], dims]
        if mask is None:
            return idx[...]
        return plgpu.load(idx, mask=mask, other=zero(ref.dtype))

    def load_scale(ref, blocks, offsets, need):  # -> f32[block_n]
        idx = ref.at[blocks, offsets]
        return idx[...] if need is None else plgpu.load(idx, mask=need, other=0.0)

    def step(t, carry, masked):
        m, l, acc = carry  # f32[block_m], f32[block_m], f32[block_m, head_dim_p]
        pos = t * block_n + jnp.arange(block_n)  # i32[block_n] key positions of this tile
        need = ((pos >= lo_min) & (pos < hi_max)) if masked else None
        # Positions are >= 0: C division (no floor-division sign fix-ups in the loop).
        slot = jax.lax.div(pos, block_size)
        if masked:
            blocks = plgpu.load(tables_ref.at[seq, slot], mask=need, other=0)
        else:
            blocks = tables_ref[seq, slot]
        # A corrupt block table must not read outside the pages (XLA's gather clamps likewise).
        blocks = jnp.clip(blocks, 0, num_blocks - 1)
        offsets = jax.lax.rem(pos, block_size)
        k = load_kv(k_ref, blocks, offsets, need)
        if k_scale_ref is not None:
            k = k.astype(q.dtype)
        s = dot(q, k, trans_b=True)  # f32[block_m, block_n]
        if k_scale_ref is not None:
            s = s * load_scale(k_scale_ref, blocks, offsets, need)[None, :]
        if soft_cap is None:
            s = s * (sm_scale * LOG2E)
        else:
            s = jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * LOG2E)
        if masked:
            visible = (pos[None, :] >= lo) & (pos[None, :] < hi)
            s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(visible, p, 0.0)  # a row with no visible key yet keeps l = 0
        v = load_kv(v_ref, blocks, offsets, need)
        if v_scale_ref is None:
            acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        else:
            pv = p * load_scale(v_scale_ref, blocks, offsets, need)[None, :]
            acc = acc * alpha[:, None] + dot(pv.astype(q.dtype), v.astype(q.dtype))
        return m_new, l * alpha + p.sum(axis=1), acc

    def masked_step(t, carry):
        return step(t, carry, True)

    def full_step(t, carry):
        return step(t, carry, False)

    a, b, c, d = ranges
    carry = (jnp.full((block_m,), MASK_VALUE, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.zeros((block_m, head_dim_p), jnp.float32))
    carry = jax.lax.fori_loop(a, b, masked_step, carry)
    carry = jax.lax.fori_loop(b, c, full_step, carry)
    return jax.lax.fori_loop(c, d, masked_step, carry)


def normalize(acc, l):  # f32[block_m, head_dim_p], f32[block_m] -> f32[block_m, head_dim_p]
    """Rows that saw no key (padding rows, seq_len 0) give zeros."""
    return jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
