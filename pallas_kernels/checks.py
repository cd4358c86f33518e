"""Argument checks shared by the kernel wrappers: a bad shape, dtype or option raises ValueError
naming the value (at trace time, so also under an outer jit), never an assert inside the kernel."""
from __future__ import annotations

import numbers

import jax.numpy as jnp

from pallas_kernels import quantization, targets

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256  # a [rows, head_dim] f32 accumulator per program must fit in registers


def check_rank(name, x, rank):
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {jnp.shape(x)}")


def check_int(name, x, shape):
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {jnp.shape(x)}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"{name} must be an integer array (i32), got {jnp.result_type(x)}")


def check_pages(k_pages, v_pages):
    """-> (num_kv_heads, num_blocks, block_size, head_dim) of [num_kv_heads, num_blocks,
    block_size, head_dim] pages."""
    check_rank("k_pages", k_pages, 4)
    if jnp.shape(v_pages) != jnp.shape(k_pages):
        raise ValueError(f"v_pages shape {jnp.shape(v_pages)} != k_pages shape "
                         f"{jnp.shape(k_pages)}")
    if jnp.result_type(k_pages) != jnp.result_type(v_pages):
        raise ValueError(f"v_pages dtype {jnp.result_type(v_pages)} != k_pages dtype "
                         f"{jnp.result_type(k_pages)}")
    if min(jnp.shape(k_pages)) < 1:
        raise ValueError(f"k_pages has an empty dimension: {jnp.shape(k_pages)}")
    return tuple(jnp.shape(k_pages))


def check_scales(k_pages, k_scales, v_scales, *, interpret=True):
    """Quantized pages (int8, float8_e4m3fn) come with f32 scales shaped like the pages minus
    head_dim, others with none. -> whether the pages are quantized. fp8 needs a GPU that casts it
    (sm_89 and newer); `interpret` runs on the CPU, which does."""
    pages_dtype = jnp.result_type(k_pages)
    if not quantization.is_quantized(pages_dtype):
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"k_scales/v_scales are for int8 or float8_e4m3fn pages, got "
                             f"{pages_dtype} pages")
        return False
    shape = tuple(jnp.shape(k_pages))[:3]
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales is None:
            raise ValueError(f"{pages_dtype} pages need {name} f32{list(shape)}, got None")
        if tuple(jnp.shape(scales)) != shape or jnp.result_type(scales) != jnp.float32:
            raise ValueError(f"{name} must be f32{list(shape)} (the pages minus head_dim), got "
                             f"{jnp.result_type(scales)}{list(jnp.shape(scales))}")
    if pages_dtype == jnp.float8_e4m3fn and not interpret:
        arch = targets.gpu_arch()
        if targets._arch_number(arch) < 89:
            raise ValueError(f"float8_e4m3fn pages need sm_89 or newer to cast, got {arch}; "
                             "int8 works on every GPU")
    return True


def check_attention(q, k_pages, v_pages, block_tables, seq_lens, out=None, k_scales=None,
                    v_scales=None, interpret=True):
    """-> (num_heads, num_kv_heads, head_dim) after checking q [rows, num_heads, head_dim] against
    the pages (of q's dtype, or quantized with scales), block tables and seq_lens."""
    check_rank("q", q, 3)
    _, num_heads, head_dim = jnp.shape(q)
    num_kv_heads, _, _, kv_head_dim = check_pages(k_pages, v_pages)
    dtype = jnp.result_type(q)
    quantized = check_scales(k_pages, k_scales, v_scales, interpret=interpret)
    if dtype not in DTYPES or not (quantized or jnp.result_type(k_pages) == dtype):
        raise ValueError(f"q must be one of {[str(d) for d in DTYPES]} and the pages of q's dtype "
                         f"or int8/float8_e4m3fn, got q {dtype}, pages {jnp.result_type(k_pages)}")
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != pages head_dim {kv_head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported (1..{MAX_HEAD_DIM})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_rank("block_tables", block_tables, 2)
    num_seqs = jnp.shape(block_tables)[0]
    check_int("block_tables", block_tables, jnp.shape(block_tables))
    check_int("seq_lens", seq_lens, (num_seqs,))
    if out is not None and (jnp.shape(out) != jnp.shape(q) or jnp.result_type(out) != dtype):
        raise ValueError(f"out must be {dtype}{list(jnp.shape(q))} like q, got "
                         f"{jnp.result_type(out)}{list(jnp.shape(out))}")
    return num_heads, num_kv_heads, head_dim


def _is_number(x, kind):
    """Static Python/numpy numbers (they become compile-time constants), not bools or arrays."""
    return isinstance(x, kind) and not isinstance(x, bool)


def check_options(sm_scale, soft_cap, sliding_window):
    if sm_scale is not None and not _is_number(sm_scale, numbers.Real):
        raise ValueError(f"sm_scale must be a Python float, got {sm_scale!r}")
    if soft_cap is not None and (not _is_number(soft_cap, numbers.Real) or soft_cap <= 0):
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
    if sliding_window is not None and (not _is_number(sliding_window, numbers.Integral)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def check_tuning(tuning, defaults, pow2=()):
    """Known keys only, positive ints; keys in `pow2` must be powers of two (Triton tiles)."""
    unknown = sorted(set(tuning) - set(defaults))
    if unknown:
        raise ValueError(f"unknown tuning options {unknown}; known: {sorted(defaults)}")
    merged = {**defaults, **tuning}
    for key, value in merged.items():
        if not _is_number(value, numbers.Integral) or value < 1:
            raise ValueError(f"tuning option {key} must be a positive int, got {value!r}")
        if key in pow2 and value & (value - 1):
            raise ValueError(f"tuning option {key} must be a power of two, got {value}")
    return {key: int(value) for key, value in merged.items()}
