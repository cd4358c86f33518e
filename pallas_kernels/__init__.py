"""Pallas paged-attention kernels (GPU via Triton, CPU via interpret mode) and their jnp references.

KV layout per layer: [num_kv_heads, num_blocks, block_size, head_dim]; block 0 is the null block."""
from pallas_kernels.kv_cache import copy_blocks_reference, write_kv_reference
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

__all__ = [
    "copy_blocks_reference",
    "paged_attention_reference",
    "ragged_paged_attention_reference",
    "write_kv_reference",
]
