"""The Mosaic GPU kernel's shared memory (kernel.py): what `attention` allocates, and its bytes for
compile_check's table."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic.mma import engine

KEYS = 64  # key positions per step: the N of q.k^T and the K of p.v
# Page tiles pass through registers (casts, masks, f32's halves) 64 columns at a time (a whole
# [64, 128] f32 step beside the accumulator spilled 16 bytes: H100, f32 split-k with a soft cap),
# or for 8-bit pages one swizzled tile's 128 (a slice must be whole tiles).
CHUNK = 64


def register_cols(dtype) -> int:
    return max(CHUNK, 128 // jnp.dtype(dtype).itemsize)


def _tiles(dtype, cols):
    """Swizzled tiles of 8 rows x one swizzle span (128 bytes, or the whole row when shorter): the
    layout WGMMA and the TMA read without bank conflicts."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, cols * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _smem(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=_tiles(dtype, shape[-1]))


def scratch(dtype, kv_dtype, head_dim: int, block_size: int, splits: int, arch="sm_90") -> dict:
    """-> the kernel's scratch for queries of `dtype` and pages of `kv_dtype` on `arch` (ROWS: its
    MMA's rows, mma.py): q_smem [parts, ROWS, head_dim] and p_smem [parts, ROWS, KEYS] in the
    dtype the MMA reads (parts:
    2 for f32's f16 halves, else 1); k_smem [2, KEYS, head_dim] and v_smem [2, KEYS, cols] (two
    slots, the pages' dtype; cols: the program's output columns); barriers: q's (an arrival per
    part), one per slot (an arrival per TMA copy); split-k: lse_smem f32[ROWS]; f32: halves
    f16[2, KEYS, head_dim] (a step's K, then its V, as hi and lo); int8/fp8 pages: quantized =
    dict(k16=[KEYS, head_dim], v16=[KEYS, cols] in q's dtype, ks=, vs= f32[2, KEYS]); Blackwell:
    mma = its tensor memory and barriers (mma.Tcgen05.scratch), and at head_dim 256 the output's
    staging buffer o_smem [ROWS, cols] in q's dtype."""
    mma = engine(arch)
    rows = mma.rows
    dtype, kv_dtype = jnp.dtype(dtype), jnp.dtype(kv_dtype)
    f32 = dtype == jnp.float32
    op_dtype, parts = (jnp.dtype(jnp.float16), 2) if f32 else (dtype, 1)
    cols = min(head_dim, mma.pv_cols)
    quantized = kv_dtype.itemsize == 1
    copies = KEYS // min(block_size, KEYS)
    smem = dict(
        q_smem=_smem((parts, rows, head_dim), op_dtype),
        k_smem=_smem((2, KEYS, head_dim), kv_dtype),
        v_smem=_smem((2, KEYS, cols), kv_dtype),
        p_smem=_smem((parts, rows, KEYS), op_dtype),
        q_barrier=plgpu.Barrier(num_arrivals=parts, num_barriers=1),
        kv_barriers=plgpu.Barrier(num_arrivals=(4 if quantized else 2) * copies, num_barriers=2))
    if splits > 1:
        smem["lse_smem"] = plgpu.SMEM((rows,), jnp.float32)
    if f32:
        smem["halves"] = _smem((2, KEYS, head_dim), op_dtype)
    if mma.scratch(cols, KEYS):
        smem["mma"] = mma.scratch(cols, KEYS)
        if cols < head_dim:  # a column half's output: no 64-row buffer can stage 128 rows
            smem["o_smem"] = _smem((rows, cols), dtype)
    if quantized:
        smem["quantized"] = dict(k16=_smem((KEYS, head_dim), dtype), v16=_smem((KEYS, cols), dtype),
                                 ks=plgpu.SMEM((2, KEYS), jnp.float32),
                                 vs=plgpu.SMEM((2, KEYS), jnp.float32))
    return smem


def nbytes(smem) -> int:
    """Bytes of shared memory `scratch`'s buffers take (8 per barrier; tensor memory is not
    shared memory), before any alignment."""
    total = 0
    for item in smem.values():
        if isinstance(item, dict):
            total += nbytes(item)
        elif getattr(item, "memory_space", None) == plgpu.TMEM:
            continue
        elif isinstance(item, plgpu.Barrier):
            total += 8 * math.prod(item.num_barriers if isinstance(item.num_barriers, tuple)
                                   else (item.num_barriers,))
        else:
            total += math.prod(item.shape) * jnp.dtype(item.dtype).itemsize
    return total
