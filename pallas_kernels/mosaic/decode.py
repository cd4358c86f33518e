"""Paged decode attention on Pallas Mosaic GPU: one query token per sequence (kernel.py). A program
per (sequence, KV head): its G query heads are padded to the kernel's 64 rows in XLA (decode reads
keys, not queries: the padding costs 64 / G times a tiny q). Split-k (FlashDecoding, as the Triton
kernel does): when the (sequence, KV head) programs cannot fill the GPU, each sequence's key steps
are shared out over num_splits programs and XLA merges their partials (combine)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels.mosaic import kernel
from pallas_kernels.mosaic.mma import engine
from pallas_kernels.mosaic.support import check_supported

# A program (one warpgroup) is resident 1-3 to an SM of an H100/H200 (132 SMs), by its head_dim's
# registers and shared memory: about two waves of them. Untuned (no GPU was at hand); override
# with num_splits.
TARGET_PROGRAMS = 512
MIN_STEPS_PER_SPLIT = 4  # 256 keys: below this a split's fixed cost (q, the partials) outweighs its reads
MAX_SPLITS = 16


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "interpret", "num_splits", "arch"))
def _paged_attention_mosaic(q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales, *,
                            sm_scale, soft_cap, sliding_window, interpret, num_splits, arch):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    q_rows = jnp.pad(q.reshape(num_seqs, num_kv_heads, group, head_dim),
                     ((0, 0), (0, 0), (0, engine(arch).rows - group), (0, 0)))
    lens = seq_lens.astype(jnp.int32)
    out = kernel.attention(
        q_rows, k_pages, v_pages, block_tables, jnp.arange(num_seqs, dtype=jnp.int32), lens - 1,
        (lens > 0).astype(jnp.int32), k_scales, v_scales, group=group, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret, splits=num_splits, arch=arch)
    if num_splits > 1:
        out = combine(*out, num_splits)
    return out[:, :, :group].reshape(q.shape)


def combine(out, lse, splits: int):
    """Merge split-k partials (XLA, f32): out [num_tiles * splits, num_kv_heads, ROWS, head_dim]
    (each split's output over its own keys), lse f32[num_tiles * splits, num_kv_heads, ROWS] (log2
    of its softmax sum; kernel.MASK_VALUE where it saw no key) -> [num_tiles, num_kv_heads, ROWS,
    head_dim] in out's dtype, zeros where no split saw a key."""
    dtype = out.dtype
    out = out.reshape((-1, splits) + out.shape[1:]).astype(jnp.float32)
    lse = lse.reshape((-1, splits) + lse.shape[1:])
    seen = lse > kernel.MASK_VALUE / 2
    top = jnp.max(jnp.where(seen, lse, kernel.MASK_VALUE), axis=1, keepdims=True)
    weight = jnp.where(seen, jnp.exp2(lse - top), 0.0)  # [num_tiles, splits, num_kv_heads, ROWS]
    total = weight.sum(axis=1)
    merged = (weight[..., None] * out).sum(axis=1) / jnp.where(total > 0, total, 1.0)[..., None]
    return merged.astype(dtype)


def default_splits(num_seqs, num_kv_heads, head_dim, max_len, sliding_window=None,
                   arch="sm_90") -> int:
    """Splits enough for about TARGET_PROGRAMS programs, each at least MIN_STEPS_PER_SPLIT key
    steps of the longest context the tables address (or the window), at most MAX_SPLITS."""
    programs = max(1, num_seqs * num_kv_heads * (head_dim // min(head_dim, engine(arch).pv_cols)))
    if programs >= TARGET_PROGRAMS // 2:
        return 1
    steps = -(-max_len // kernel.KEYS)
    if sliding_window is not None:
        steps = min(steps, -(-sliding_window // kernel.KEYS) + 1)
    return max(1, min(-(-TARGET_PROGRAMS // programs), steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))


def paged_attention_mosaic(
    q,  # [num_seqs, num_heads, head_dim], one query token per sequence; bf16, f16 or f32
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
    num_splits=None,  # split-k programs per (sequence, KV head); default: default_splits
    arch=None,  # "sm_90" (Hopper) or "sm_100" (Blackwell); default: the GPU's, else "sm_90"
):
    """paged_attention's contract (decode over keys [0, seq_len), or the last `sliding_window` of
    them) on Mosaic GPU. Takes what `support.supports` accepts (bf16/f16 at head_dim 64, 128 or
    256, f32 at 64 or 128 (as f16 halves, kernel.py), power-of-two block_size >= 8; pages of q's
    dtype, or with 16-bit q int8/fp8 ones with their scales, which are cast to q's dtype in shared
    memory and scaled as quantization.py says), else raises ValueError saying why."""
    _, _, head_dim = checks.check_attention(q, k_pages, v_pages, block_tables, seq_lens,
                                            k_scales=k_scales, v_scales=v_scales,
                                            interpret=bool(interpret))
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, block_tables {block_tables.shape[0]}")
    checks.check_options(sm_scale, soft_cap, sliding_window)
    arch = check_supported("paged_attention_mosaic", q, k_pages, arch)
    if num_splits is None:
        num_splits = default_splits(q.shape[0], k_pages.shape[0], head_dim,
                                    block_tables.shape[1] * k_pages.shape[2], sliding_window, arch)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if q.shape[0] == 0:
        return jnp.zeros_like(q)
    return _paged_attention_mosaic(
        q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales,
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret), num_splits=num_splits, arch=arch)
