"""The paged KV cache of a whole model and the attention dispatch the model calls once per layer.

All layers share one page array: layer `l` owns blocks `[l * num_blocks, (l + 1) * num_blocks)` of
`[num_kv_heads, num_layers * num_blocks, block_size, head_dim]`. The block pool hands out ids in
`[0, num_blocks)` and each layer adds its offset to the block tables and slot mapping, so a layer
scan carries the cache and every kernel reads its layer in place: slicing a per-layer cache out of
a stacked one inside `lax.scan` would copy the whole layer's KV on every step.

The layout is chosen when the cache is made: "paged" (above; the reference and Pallas backends)
or "tpu", the single `[num_layers * num_blocks, block_size, 2 * num_kv_heads, head_dim]` array with
K/V interleaved that jax's TPU ragged paged attention reads (same layer-major block numbering).

`kv_cache_dtype` "int8" / "fp8_e4m3" (vLLM's names) store "paged" pages quantized, with f32 scales
`[num_kv_heads, num_layers * num_blocks, block_size]` beside them (pallas_kernels/quantization.py):
every leaf has the block axis second, so copying a block is a tree_map over the cache.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import mosaic, quantization, targets, triton_call
from paged_jax.worker import sharding

# "pallas": Pallas Triton ("pallas_triton" names it too); "pallas_mosaic": attention on Pallas
# Mosaic GPU (Hopper), the cache writes and block copies XLA's (in place, unique indices), so it
# needs no Pallas Triton. "-interpret": the same kernels in their interpreters, on the CPU.
BACKENDS = ("reference", "pallas", "pallas_mosaic", "pallas-interpret", "pallas_mosaic-interpret",
            "tpu")
TRITON_BACKENDS = ("pallas", "pallas-interpret")
MOSAIC_BACKENDS = ("pallas_mosaic", "pallas_mosaic-interpret")
# Where "auto" prefers Mosaic GPU to Pallas Triton: the archs its kernels have run on (an H200,
# scripts/gpu_check.sh). Blackwell's (tcgen05) is compiled and interpreter-tested only: there
# "auto" takes it once Pallas Triton is gone.
MOSAIC_FIRST = ("sm_90",)
LAYOUTS = ("paged", "tpu")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """What one forward over a ragged token batch needs to read and write the cache."""

    slot_mapping: jax.Array  # i32[num_tokens]; block_id * block_size + offset, -1 for padding tokens
    block_tables: jax.Array  # i32[num_seqs, max_blocks_per_seq]
    seq_lens: jax.Array  # i32[num_seqs]; tokens in the cache once this batch is written; 0 = padding
    query_start_loc: jax.Array  # i32[num_seqs + 1]; sequence s owns tokens [qsl[s], qsl[s+1])
    # Every sequence has exactly one query token (token s belongs to sequence s): the decode kernel.
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    # "paged": [num_kv_heads, num_layers * num_blocks, block_size, head_dim] each; None on "tpu"
    k_pages: jax.Array | None
    v_pages: jax.Array | None
    num_layers: int = dataclasses.field(metadata=dict(static=True))
    # "tpu" only: [num_layers * num_blocks, block_size, 2 * num_kv_heads, head_dim], K/V interleaved
    kv_pages: jax.Array | None = None
    layout: str = dataclasses.field(default="paged", metadata=dict(static=True))
    # int8/fp8 "paged" pages only: f32[num_kv_heads, num_layers * num_blocks, block_size] each
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

    @classmethod
    def create(cls, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=jnp.float32,
               layout="paged"):
        """`layout`: "paged", or "tpu" for attention_backend "tpu" (see `cache_layout`). `dtype`
        int8 or float8_e4m3fn (`quantization.storage_dtype`) makes a quantized "paged" cache."""
        quantized = quantization.is_quantized(dtype)
        if layout == "tpu":
            if quantized:
                raise ValueError(f"a {jnp.dtype(dtype)} KV cache has no 'tpu' layout: jax's TPU "
                                 "ragged_paged_attention takes no per-token scales")
            shape = pk.kv_pages_shape(num_layers * num_blocks, block_size, num_kv_heads, head_dim)
            return cls(None, None, num_layers, jnp.zeros(shape, dtype), layout)
        if layout != "paged":
            raise ValueError(f"KV cache layout must be one of {LAYOUTS}, got {layout!r}")
        shape = (num_kv_heads, num_layers * num_blocks, block_size, head_dim)
        scales = [None, None]
        if quantized:
            scales = [jnp.zeros(shape[:3], quantization.SCALE_DTYPE) for _ in range(2)]
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), num_layers, None, layout,
                   *scales)

    @property
    def num_blocks(self) -> int:
        """Blocks per layer: the size of the block pool that indexes this cache."""
        if self.layout == "tpu":
            return self.kv_pages.shape[0] // self.num_layers
        return self.k_pages.shape[1] // self.num_layers

    @property
    def block_axis(self) -> int:
        """The axis that indexes (layer, block) pairs, layer-major, in every leaf of this layout."""
        return 0 if self.layout == "tpu" else 1

    @property
    def block_size(self) -> int:
        return self.kv_pages.shape[1] if self.layout == "tpu" else self.k_pages.shape[2]

    @property
    def bytes_per_block(self) -> int:
        """KV bytes one pool block holds across all layers, K and V (and their scales)."""
        if self.layout == "tpu":
            _, bs, kv_heads, d = self.kv_pages.shape
            return self.num_layers * bs * kv_heads * d * self.kv_pages.dtype.itemsize
        kvh, _, bs, d = self.k_pages.shape
        return bytes_per_block(self.num_layers, kvh, bs, d, self.k_pages.dtype)


def bytes_per_block(num_layers, num_kv_heads, block_size, head_dim, dtype, layout="paged") -> int:
    """KV bytes of one pool block across all layers, K and V, with their scales if quantized; the
    "tpu" layout stores head_dim padded to the TPU's lanes (pk.kv_pages_shape)."""
    if layout == "tpu":
        head_dim = pk.kv_pages_shape(1, 1, 1, head_dim)[3]
    return (2 * num_layers * num_kv_heads * block_size
            * quantization.bytes_per_token_head(head_dim, dtype))


def check_kv_cache_dtype(kv_cache_dtype: str, backend: str, model_dtype):
    """-> the page dtype for `kv_cache_dtype` on the resolved attention `backend`, or ValueError
    naming it and the ones this backend reads."""
    dtype = quantization.storage_dtype(kv_cache_dtype, model_dtype)
    readable, where = list(quantization.KV_CACHE_DTYPES), jax.default_backend()
    if backend == "tpu":  # its kernel scales K/V per tensor, not per (token, KV head)
        readable = ["auto"]
    elif backend == "pallas" and targets._arch_number(targets.gpu_arch()) < 89:
        readable, where = ["auto", "int8"], targets.gpu_arch()  # Triton casts fp8 on sm_89+ only
    if kv_cache_dtype not in readable:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} cannot be read by attention backend "
                         f"{backend!r} on {where}; supported here: {readable}")
    return dtype


def cache_layout(backend: str) -> str:
    """The KVCache layout an attention backend reads (pass it to `KVCache.create`)."""
    return "tpu" if resolve_backend(backend) == "tpu" else "paged"


def copy_blocks(cache: KVCache, src, dst, *, backend: str = "reference") -> KVCache:
    """Copy pool blocks `src` -> `dst` (i32[n], -1 = skip) in every layer (copy-on-write). The
    Pallas backends use the copy kernel; a "tpu" cache is copied in its own layout."""
    offsets = cache.num_blocks * jnp.arange(cache.num_layers, dtype=jnp.int32)[:, None]
    src = jnp.where(src >= 0, src[None, :] + offsets, -1).reshape(-1)
    dst = jnp.where(dst >= 0, dst[None, :] + offsets, -1).reshape(-1)
    if cache.layout == "tpu":
        return dataclasses.replace(cache, kv_pages=pk.copy_blocks_tpu(cache.kv_pages, src, dst))
    if backend in TRITON_BACKENDS:
        k, v = pk.copy_blocks(cache.k_pages, cache.v_pages, src, dst,
                              interpret=backend == "pallas-interpret")
    else:
        k, v = pk.copy_blocks_reference(cache.k_pages, cache.v_pages, src, dst)
    if cache.k_scales is not None:  # a few bytes per block: XLA's scatter is enough
        ks, vs = pk.copy_blocks_reference(cache.k_scales, cache.v_scales, src, dst)
        return dataclasses.replace(cache, k_pages=k, v_pages=v, k_scales=ks, v_scales=vs)
    return dataclasses.replace(cache, k_pages=k, v_pages=v)


def attend(
    q,  # [num_tokens, num_heads, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]; this batch's new keys
    v,  # [num_tokens, num_kv_heads, head_dim]
    cache: KVCache,
    layer,  # i32[] (traced inside the layer scan)
    md: AttentionMetadata,
    *,
    backend: str = "reference",
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
    mesh=None,
):
    """Write this layer's new K/V at the slot mapping, then attend through the pages -> (out, cache).

    With a `mesh` (tensor parallelism), q/k/v arrive split over heads and the cache over KV heads:
    each device runs the kernel on its own heads under `shard_map`, with the metadata replicated."""
    kwargs = dict(backend=backend, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if mesh is None:
        return _attend_local(q, k, v, cache, layer, md, **kwargs)
    heads = P(None, sharding.AXIS, None)
    specs = sharding.cache_specs(cache)
    local = jax.shard_map(functools.partial(_attend_local, **kwargs), mesh=mesh,
                          in_specs=(heads, heads, heads, specs, P(), jax.tree.map(lambda _: P(), md)),
                          out_specs=(heads, specs), check_vma=False)
    return local(q, k, v, cache, layer, md)


def _attend_local(q, k, v, cache: KVCache, layer, md: AttentionMetadata, *, backend, sm_scale, soft_cap,
                  sliding_window):
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if (backend == "tpu") != (cache.layout == "tpu"):
        raise ValueError(f"attention backend {backend!r} cannot read a {cache.layout!r} KV cache: "
                         f"make it with KVCache.create(..., layout=cache_layout({backend!r}))")
    offset = layer * cache.num_blocks
    slots = jnp.where(md.slot_mapping >= 0, md.slot_mapping + offset * cache.block_size, -1)
    tables = md.block_tables + offset
    kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    scales = {}
    if cache.k_scales is not None:
        scales = dict(k_scales=cache.k_scales, v_scales=cache.v_scales)
    if backend == "tpu":
        kv_pages = pk.write_kv_tpu(cache.kv_pages, k, v, slots)
        qsl = md.query_start_loc
        if md.decode_only:
            qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
        out = pk.ragged_paged_attention_tpu(q, kv_pages, tables, md.seq_lens, qsl, **kwargs)
        return out, dataclasses.replace(cache, kv_pages=kv_pages)
    if backend != "reference":
        kwargs["interpret"] = backend.endswith("-interpret")
    if backend in TRITON_BACKENDS:
        pages = pk.write_kv(cache.k_pages, cache.v_pages, k, v, slots, **scales,
                            interpret=kwargs["interpret"])
    else:
        pages = pk.write_kv_reference(cache.k_pages, cache.v_pages, k, v, slots, **scales)
    k_pages, v_pages = pages[:2]
    if scales:
        scales = dict(k_scales=pages[2], v_scales=pages[3])
    kwargs.update(scales)
    if backend == "reference":
        decode, ragged = pk.paged_attention_reference, pk.ragged_paged_attention_reference
    elif backend in MOSAIC_BACKENDS:
        decode, ragged = mosaic.paged_attention_mosaic, mosaic.ragged_paged_attention_mosaic
    else:
        decode, ragged = pk.paged_attention, pk.ragged_paged_attention
    if md.decode_only:
        out = decode(q, k_pages, v_pages, tables, md.seq_lens, **kwargs)
    else:
        out = ragged(q, k_pages, v_pages, tables, md.seq_lens, md.query_start_loc, **kwargs)
    return out, dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages, **scales)


def resolve_backend(backend: str = "auto", *, dtype=None, head_dim=None, block_size=None,
                    kv_cache_dtype="auto", platform=None) -> str:
    """`auto`: on a GPU, Pallas Mosaic GPU ("pallas_mosaic") on Hopper when this jax has it and
    the model's `dtype`, `head_dim`, `block_size` and `kv_cache_dtype` are ones it takes (the first
    three must be given), else Pallas Triton ("pallas"), else (a jax that dropped Pallas Triton)
    Mosaic GPU on Blackwell where it takes the model, else the jnp references; jax's TPU kernel on
    TPU; jnp references elsewhere. "pallas_triton" is "pallas".
    `platform`: the one built for (default jax's default backend; a deviceless GPU build passes "gpu"
    with its compile-only device as jax's default device)."""
    if backend == "auto":
        platform = platform or jax.default_backend()
        if platform == "gpu":
            mosaic_takes_it = mosaic_refusal(dtype, head_dim, block_size, kv_cache_dtype) is None
            if mosaic_takes_it and (targets.gpu_arch() in MOSAIC_FIRST or not triton_call.AVAILABLE):
                return "pallas_mosaic"
            return "pallas" if triton_call.AVAILABLE else "reference"
        return {"tpu": "tpu"}.get(platform, "reference")
    resolved = "pallas" if backend == "pallas_triton" else backend
    if resolved not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto', 'pallas_triton' or one of {BACKENDS}, "
                         f"got {backend!r}")
    if resolved in MOSAIC_BACKENDS and not mosaic.AVAILABLE:
        raise ValueError(f"attention_backend {backend!r}: {mosaic.UNAVAILABLE}")
    if resolved in TRITON_BACKENDS and not triton_call.AVAILABLE:
        raise ValueError(f"attention_backend {backend!r}: {triton_call.UNAVAILABLE}")
    return resolved


def mosaic_refusal(dtype, head_dim, block_size, kv_cache_dtype="auto") -> str | None:
    """-> None when the Pallas Mosaic GPU kernels take this model on this GPU, else why not."""
    # Hopper (WGMMA) and Blackwell (tcgen05); Ampere lacks TMA barriers and both
    arch = targets.gpu_arch()
    if arch not in mosaic.ARCHS:
        return f"Hopper (sm_90) and Blackwell (sm_100) only, this GPU is {arch}"
    if None in (dtype, head_dim, block_size):
        return "the model's dtype, head_dim and block_size were not given"
    kv_dtype = quantization.storage_dtype(kv_cache_dtype, dtype)
    return mosaic.supports(dtype, head_dim, block_size, kv_dtype, arch)
