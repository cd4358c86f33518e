"""Pallas paged-attention kernels (GPU via Triton, CPU via interpret mode) and their jnp references.

KV layout per layer: [num_kv_heads, num_blocks, block_size, head_dim]; block 0 is the null block.
`tpu_layout` adapts jax's own TPU kernel and its interleaved K/V layout to the same contract."""
from pallas_kernels.kv_cache import copy_blocks, copy_blocks_reference, write_kv, write_kv_reference
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from pallas_kernels.tpu_layout import (copy_blocks_tpu, kv_pages_shape, ragged_paged_attention_tpu,
                                       write_kv_tpu)

__all__ = [
    "copy_blocks",
    "copy_blocks_reference",
    "copy_blocks_tpu",
    "kv_pages_shape",
    "paged_attention",
    "paged_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "write_kv",
    "write_kv_reference",
    "write_kv_tpu",
]
