"""Which jax and which inputs the Mosaic GPU kernels take; the rest stays on Pallas Triton."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import quantization, targets


def _unavailable() -> str | None:
    """-> why this jax cannot run the kernels, or None when it can."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:
        return f"jax {jax.__version__} has no Pallas Mosaic GPU ({e})"
    missing = [name for name in ("kernel", "InterpretGPUParams", "wgmma", "ACC")
               if not hasattr(plgpu, name)]
    if missing:
        return (f"jax {jax.__version__}'s Pallas Mosaic GPU lacks {', '.join(missing)} "
                "(the kernels are written for jax >= 0.12)")
    return None


UNAVAILABLE = _unavailable()
AVAILABLE = UNAVAILABLE is None
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # WGMMA's 16-bit inputs
F32 = jnp.dtype(jnp.float32)  # as two f16 halves each (kernel.py), with f32 pages
HEAD_DIMS = (64, 128, 256)  # 256 on Hopper: two programs per (tile, KV head), see mma.Wgmma
# f32 at head_dim 256 would take 304 KB of shared memory (f32 K [2, 64, 256] and V [2, 64, 128]
# slots, the f16 halves of q [64, 256], of a step's K and of p) against an SM's 227 KB.
F32_HEAD_DIMS = (64, 128)
ARCHS = ("sm_90", "sm_100")  # Hopper's WGMMA and Blackwell's tcgen05 (mma.py)
MIN_BLOCK_SIZE = 8  # a TMA copy of a page is whole 8-row tiles of its swizzled shared-memory layout
# With int8/fp8 pages each block's f32 scales are one TMA copy into shared memory, and a TMA copy's
# shared-memory address must be 128-byte aligned: 32 scales. At block_size 16 every other copy
# landed 64 bytes off, and an H200 stopped the kernel with CUDA_ERROR_MISALIGNED_ADDRESS.
MIN_QUANTIZED_BLOCK_SIZE = 128 // 4


def supports(dtype, head_dim: int, block_size: int, kv_dtype=None, arch="sm_90") -> str | None:
    """-> None when the Mosaic GPU kernels take queries of `dtype`, `head_dim` and pages of
    `block_size` tokens (and of `kv_dtype`, default `dtype`) on `arch`, else the reason they do
    not."""
    if UNAVAILABLE:
        return UNAVAILABLE
    if arch not in ARCHS:
        return f"the kernels are built for {' and '.join(ARCHS)} (Hopper, Blackwell), not {arch}"
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    dtype = jnp.dtype(dtype)
    if dtype == F32 and arch != "sm_90":
        return (f"float32 runs on Hopper only: on {arch} its halves would not fit shared memory "
                "beside 128-row tiles")
    if dtype == F32:
        if kv_dtype != F32:
            return f"float32 queries need float32 pages (their f16 halves), got {kv_dtype}"
        if head_dim not in F32_HEAD_DIMS:
            return (f"float32 takes head_dim {F32_HEAD_DIMS[0]} or {F32_HEAD_DIMS[1]} (shared "
                    f"memory), got {head_dim}")
    elif dtype not in DTYPES:
        return f"queries must be bfloat16, float16 or float32, got {dtype}"
    elif kv_dtype not in DTYPES + tuple(quantization.QMAX):
        return f"pages must be 16-bit, int8 or float8_e4m3fn, got {kv_dtype}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS}, got {head_dim}"
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return f"block_size must be a power of two >= {MIN_BLOCK_SIZE}, got {block_size}"
    if quantization.is_quantized(kv_dtype) and block_size < MIN_QUANTIZED_BLOCK_SIZE:
        return (f"{kv_dtype} pages need block_size >= {MIN_QUANTIZED_BLOCK_SIZE} (a block's f32 "
                f"scales are one 128-byte-aligned TMA copy), got {block_size}")
    return None


def check_supported(name: str, q, k_pages, arch=None) -> str:
    """-> `arch`, by default the GPU's (the default device's, else targets.DEFAULT_GPU);
    ValueError naming `name` and the reason when the kernels do not take q [.., .., head_dim] and
    k_pages [num_kv_heads, num_blocks, block_size, head_dim] there."""
    arch = targets.gpu_arch() if arch is None else arch
    reason = supports(q.dtype, q.shape[-1], k_pages.shape[2], k_pages.dtype, arch)
    if reason:
        raise ValueError(f"{name}: {reason}")
    return arch
