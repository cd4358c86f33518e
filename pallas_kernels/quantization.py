"""A quantized KV cache: int8 or fp8 (e4m3) pages with one f32 scale per (token, KV head).

Scales live beside the pages in the same block layout, `[num_kv_heads, num_blocks, block_size]`
(the pages' shape minus head_dim), indexed by the same block ids, so a block is still the unit
that is written, copied, forked and swapped. `quantize` is the one definition of the rounding:
the `write_kv` kernel runs it in registers and the jnp reference runs it in XLA, so both store the
same bytes. The attention kernels dequantize in registers: keys are cast to the query dtype for
q.k and the logits multiplied by the key scales; the probabilities are multiplied by the value
scales before p.v (jax's Pallas GPU paged kernel does the same, per token and KV head).

Error. A row x (one token, one KV head) with amax = max|x| has scale s = amax / QMAX and
  int8:     |x - dequantize(x)| <= s / 2                   = amax / 254 per element,
  fp8_e4m3: |x - dequantize(x)| <= 2**-4 |x| + 2**-10 s     (3 mantissa bits; 2**-10 s below the
                                                           smallest normal, 2**-6 s),
both <= REL_ERROR * amax. Through attention (sm_scale c, query q, keys k_j, values v_j): each
logit moves by at most E = c * |q|_1 * max_j REL_ERROR * amax(k_j) (a soft cap only shrinks the
move), so each probability by a factor within [exp(-2E), exp(2E)], and each output element by at
most (exp(2E) - 1) * max_j |v_j|_inf + max_j REL_ERROR * amax(v_j)."""
from __future__ import annotations

import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # vLLM's kv_cache_dtype names
STORAGE = {"int8": jnp.dtype(jnp.int8), "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn)}
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}  # largest finite value
REL_ERROR = {jnp.dtype(jnp.int8): 0.5 / 127, jnp.dtype(jnp.float8_e4m3fn): 2**-4 + 2**-10 / 448}
SCALE_DTYPE = jnp.dtype(jnp.float32)


def storage_dtype(kv_cache_dtype: str, model_dtype):
    """-> the dtype the pages are stored in: the model's for "auto", else int8 or float8_e4m3fn."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; supported: "
                         f"{list(KV_CACHE_DTYPES)}")
    return jnp.dtype(model_dtype) if kv_cache_dtype == "auto" else STORAGE[kv_cache_dtype]


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QMAX


def bytes_per_token_head(head_dim: int, dtype) -> int:
    """Bytes one token's K (or V) of one KV head takes in the cache, its scale included."""
    dtype = jnp.dtype(dtype)
    return head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if is_quantized(dtype) else 0)


def quantize(x, dtype):  # x [..., head_dim] -> (q [..., head_dim] of dtype, scale f32[...])
    """Symmetric, one scale per row: the row's largest magnitude maps to QMAX. An all-zero row
    gets scale 0 (and dequantizes to zeros). Plain jnp, so it also runs inside a Pallas kernel."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    inv = jnp.where(amax > 0, qmax / jnp.where(amax > 0, amax, 1.0), 0.0)
    y = x * inv[..., None]
    if dtype == jnp.int8:
        y = jnp.floor(y + 0.5)  # round half up: Triton has no round-to-nearest primitive here
    return jnp.clip(y, -qmax, qmax).astype(dtype), amax * (1.0 / qmax)


def dequantize(q, scale):  # q [..., head_dim], scale f32[...] -> f32[..., head_dim]
    return q.astype(jnp.float32) * scale[..., None]
