"""Engine sizes: defaults per platform and the KV-cache budget that sets the number of blocks."""
from __future__ import annotations

import dataclasses
import sys

import jax

# On CPU there are no device memory stats to read: the KV cache gets this many bytes.
CPU_KV_CACHE_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    block_size: int
    num_blocks: int  # per layer, the null block included
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_decode_steps: int
    long_prefill_token_threshold: int
    enable_prefix_caching: bool
    attention_backend: str
    bytes_per_block: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def describe(self) -> str:
        total = self.num_blocks * self.bytes_per_block
        return (f"paged-jax KV cache: {self.num_blocks} blocks of {self.block_size} tokens, "
                f"{self.bytes_per_block / 2**10:.1f} KiB per block, {total / 2**20:.1f} MiB; "
                f"longest context that fits: {self.max_model_len} tokens; backend {self.attention_backend}")


def _check_positive(**values):
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def kv_budget_bytes(fraction: float) -> int:
    """Bytes for the KV cache: `fraction` of the device memory left after the weights (read from
    the device's memory stats), or a fixed budget on CPU."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction!r}")
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * fraction)
    return int(CPU_KV_CACHE_BYTES * fraction)


def resolve(model_config, *, block_size, num_blocks, kv_cache_memory_fraction, max_num_seqs,
            max_num_batched_tokens, max_model_len, num_decode_steps, long_prefill_token_threshold,
            enable_prefix_caching, attention_backend, kv_dtype, kv_shards=1) -> EngineConfig:
    """`kv_shards`: devices the KV heads are split over (tensor parallelism); the budget is per
    device, so each block costs a device 1 / kv_shards of its bytes."""
    _check_positive(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                    num_decode_steps=num_decode_steps)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    on_cpu = jax.default_backend() == "cpu"
    max_num_seqs = max_num_seqs or (16 if on_cpu else 256)
    max_num_batched_tokens = max_num_batched_tokens or (512 if on_cpu else 8192)
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                         f"max_num_seqs ({max_num_seqs}): every running sequence decodes each step")
    limit = model_config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    chosen_len = max_model_len
    max_model_len = max_model_len or min(limit, 4096 if on_cpu else limit)
    bytes_per_block = (2 * model_config.num_layers * model_config.num_kv_heads * block_size
                       * model_config.head_dim * jax.numpy.dtype(kv_dtype).itemsize)
    useful = max_num_seqs * -(-max_model_len // block_size) + 1  # more could never be used
    if num_blocks is None:
        num_blocks = min(useful, kv_budget_bytes(kv_cache_memory_fraction) * kv_shards // bytes_per_block)
    if num_blocks < 2:
        raise ValueError(f"the KV cache holds {num_blocks} blocks of {bytes_per_block} bytes; "
                         "at least 2 are needed: raise the budget or lower block_size")
    if chosen_len is None:  # a length the user chose stays; requests that outgrow the pool fail alone
        max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
    return EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                        num_decode_steps=num_decode_steps or 8,
                        long_prefill_token_threshold=long_prefill_token_threshold,
                        enable_prefix_caching=enable_prefix_caching,
                        attention_backend=attention_backend, bytes_per_block=bytes_per_block)


def announce(config: EngineConfig) -> None:
    print(config.describe(), file=sys.stderr, flush=True)
