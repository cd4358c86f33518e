"""The paged KV cache of a whole model and the attention dispatch the model calls once per layer.

All layers share one page array: layer `l` owns blocks `[l * num_blocks, (l + 1) * num_blocks)` of
`[num_kv_heads, num_layers * num_blocks, block_size, head_dim]`. The block pool hands out ids in
`[0, num_blocks)` and each layer adds its offset to the block tables and slot mapping, so a layer
scan carries the cache and every kernel reads its layer in place: slicing a per-layer cache out of
a stacked one inside `lax.scan` would copy the whole layer's KV on every step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels as pk

BACKENDS = ("reference", "pallas", "pallas-interpret")


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
    k_pages: jax.Array  # [num_kv_heads, num_layers * num_blocks, block_size, head_dim]
    v_pages: jax.Array  # [num_kv_heads, num_layers * num_blocks, block_size, head_dim]
    num_layers: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def create(cls, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=jnp.float32):
        shape = (num_kv_heads, num_layers * num_blocks, block_size, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), num_layers)

    @property
    def num_blocks(self) -> int:
        """Blocks per layer: the size of the block pool that indexes this cache."""
        return self.k_pages.shape[1] // self.num_layers

    @property
    def block_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def bytes_per_block(self) -> int:
        """KV bytes one pool block holds across all layers, K and V."""
        kvh, _, bs, d = self.k_pages.shape
        return 2 * self.num_layers * kvh * bs * d * self.k_pages.dtype.itemsize


def copy_blocks(cache: KVCache, src, dst) -> KVCache:
    """Copy pool blocks `src` -> `dst` (i32[n], -1 = skip) in every layer (copy-on-write)."""
    offsets = cache.num_blocks * jnp.arange(cache.num_layers, dtype=jnp.int32)[:, None]
    src = jnp.where(src >= 0, src[None, :] + offsets, -1).reshape(-1)
    dst = jnp.where(dst >= 0, dst[None, :] + offsets, -1).reshape(-1)
    k, v = pk.copy_blocks_reference(cache.k_pages, cache.v_pages, src, dst)
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
):
    """Write this layer's new K/V at the slot mapping, then attend through the pages -> (out, cache)."""
    offset = layer * cache.num_blocks
    slots = jnp.where(md.slot_mapping >= 0, md.slot_mapping + offset * cache.block_size, -1)
    k_pages, v_pages = pk.write_kv_reference(cache.k_pages, cache.v_pages, k, v, slots)
    cache = dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages)
    tables = md.block_tables + offset
    kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if backend == "reference":
        if md.decode_only:
            out = pk.paged_attention_reference(q, k_pages, v_pages, tables, md.seq_lens, **kwargs)
        else:
            out = pk.ragged_paged_attention_reference(q, k_pages, v_pages, tables, md.seq_lens,
                                                      md.query_start_loc, **kwargs)
    elif backend in ("pallas", "pallas-interpret"):
        kwargs["interpret"] = backend == "pallas-interpret"
        if md.decode_only:
            out = pk.paged_attention(q, k_pages, v_pages, tables, md.seq_lens, **kwargs)
        else:
            out = pk.ragged_paged_attention(q, k_pages, v_pages, tables, md.seq_lens,
                                            md.query_start_loc, **kwargs)
    else:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    return out, cache


def resolve_backend(backend: str = "auto") -> str:
    """`auto`: Pallas through Triton on GPU, the jnp references elsewhere."""
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    return backend
