"""Writing new K/V into the pages, and copying whole blocks (copy-on-write after a fork)."""
from __future__ import annotations

import jax.numpy as jnp


def write_kv_reference(
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; block_id * block_size + offset, -1 = skip
):
    num_blocks, block_size = k_pages.shape[1:3]
    block = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)  # out of range: dropped
    offset = slot_mapping % block_size
    k_pages = k_pages.at[:, block, offset].set(k.swapaxes(0, 1).astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[:, block, offset].set(v.swapaxes(0, 1).astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages


def copy_blocks_reference(
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    src,  # i32[n]; -1 = skip
    dst,  # i32[n]; -1 = skip
):
    num_blocks = k_pages.shape[1]
    ok = (src >= 0) & (dst >= 0)
    src = jnp.where(ok, src, 0)
    dst = jnp.where(ok, dst, num_blocks)  # out of range: dropped
    return (k_pages.at[:, dst].set(k_pages[:, src], mode="drop"),
            v_pages.at[:, dst].set(v_pages[:, src], mode="drop"))
