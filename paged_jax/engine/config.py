"""Engine sizes: defaults per platform and the KV-cache budget that sets the number of blocks."""
from __future__ import annotations

import dataclasses
import sys

import jax

from paged_jax import attention

# On CPU there are no device memory stats to read: the KV cache gets this many bytes.
CPU_KV_CACHE_BYTES = 256 * 2**20
DEFAULT_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default
PREEMPTION_MODES = ("recompute", "swap")
TOKEN_BYTES = 4  # n-gram speculation's token pages: an int32 token id per KV slot


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (models/lora.py): the device's slots, their rank, the adapters kept
    loaded on the host, and the slots' bytes on the device (out of the KV budget)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    nbytes: int


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
    kv_cache_dtype: str = "auto"  # or "int8", "fp8_e4m3": quantized pages with their scales
    preemption_mode: str = "recompute"  # or "swap": a victim's blocks go to host memory
    swap_space: float = 0.0  # GiB of host memory for swapped blocks and the host prefix cache
    enable_host_prefix_cache: bool = False  # evicted cached blocks are kept in host memory
    num_speculative_tokens: int = 0  # proposals a row verifies per call (speculative decoding), 0: off
    # n-gram speculation: (prompt_lookup_min, prompt_lookup_max) of the device's lookup of drafts
    # planned ahead, whose token pages (TOKEN_BYTES a slot on every device, beside its K/V) count in
    # bytes_per_block (worker/ngram_proposer.py); None otherwise
    prompt_lookup: tuple[int, int] | None = None
    lora: LoRAConfig | None = None  # None: no adapters

    @property
    def uses_host_memory(self) -> bool:
        return self.preemption_mode == "swap" or self.enable_host_prefix_cache

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def describe(self) -> str:
        total = self.num_blocks * self.bytes_per_block
        return (f"paged-jax KV cache: {self.num_blocks} blocks of {self.block_size} tokens, "
                f"{self.bytes_per_block / 2**10:.1f} KiB per block, {total / 2**20:.1f} MiB; "
                f"longest context that fits: {self.max_model_len} tokens; backend {self.attention_backend}"
                + ("" if self.kv_cache_dtype == "auto" else f"; kv_cache_dtype {self.kv_cache_dtype}"))


def kv_budget_bytes(*, gpu_memory_utilization=None, kv_cache_memory_fraction=None, activation_bytes=None,
                    memory_stats=None, unplaced_bytes=0) -> int:
    """Bytes for the KV cache.

    On a device with memory stats (GPU, TPU), vLLM's `gpu_memory_utilization` (default 0.9): this
    engine may use that fraction of the whole device memory, weights (already on the device),
    activation peak (`activation_bytes()`, measured from the compiled step) and KV together; the KV
    pool gets the rest. `kv_cache_memory_fraction`, when given, wins: that fraction of the memory the
    weights leave free, activations not counted. On CPU (no stats) the device is a fixed
    CPU_KV_CACHE_BYTES, of which the KV gets either fraction. `unplaced_bytes`: weights the engine
    puts on the device after sizing the KV (LoRA slots), counted as in use."""
    for name, value in (("gpu_memory_utilization", gpu_memory_utilization),
                        ("kv_cache_memory_fraction", kv_cache_memory_fraction)):
        if value is not None and not 0.0 < value <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    if memory_stats is None:
        device = jax.local_devices()[0]
        memory_stats = device.memory_stats() if device.platform != "cpu" else None
    if not memory_stats or "bytes_limit" not in memory_stats:
        return int(CPU_KV_CACHE_BYTES * (kv_cache_memory_fraction or gpu_memory_utilization or DEFAULT_UTILIZATION))
    total, in_use = memory_stats["bytes_limit"], memory_stats.get("bytes_in_use", 0) + unplaced_bytes
    if kv_cache_memory_fraction is not None:
        return int((total - in_use) * kv_cache_memory_fraction)
    utilization = gpu_memory_utilization or DEFAULT_UTILIZATION
    activations = activation_bytes() if activation_bytes is not None else 0
    budget = int(utilization * total - in_use - activations)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} allows {utilization * total / 2**30:.2f} GiB, but the "
                         f"weights take {in_use / 2**30:.2f} GiB and the activation peak "
                         f"{activations / 2**30:.2f} GiB: nothing is left for the KV cache")
    return budget


def resolve(model_config, *, block_size, num_blocks, gpu_memory_utilization=None, kv_cache_memory_fraction=None,
            activation_bytes=None, max_num_seqs,
            max_num_batched_tokens, max_model_len, num_decode_steps, long_prefill_token_threshold,
            enable_prefix_caching, attention_backend, kv_dtype, kv_shards=1, sliding_window=None,
            kv_cache_dtype="auto", preemption_mode="recompute", swap_space=4,
            enable_host_prefix_cache=False, memory_stats=None, draft_bytes_per_block=0,
            num_speculative_tokens=0, prompt_lookup=None, lora=None) -> EngineConfig:
    """`kv_shards`: devices the KV heads are split over (tensor parallelism); the budget is per
    device, so each block costs a device 1 / kv_shards of its bytes. `sliding_window`: the window every
    layer shares, which bounds the blocks a sequence holds (and so what the pool can use), not its length. `activation_bytes(num_tokens,
    max_num_seqs, max_model_len)` measures the activation peak of the largest step (called only on a
    device with memory stats). `kv_dtype`: the pages' dtype (int8/fp8 for `kv_cache_dtype` "int8" /
    "fp8_e4m3", whose per-token scales count in each block's bytes). `memory_stats`: the device's
    (`bytes_limit`, `bytes_in_use`) when it is not the local one (a compile-only GPU); None reads them
    from the local device. `draft_bytes_per_block`: a draft model's K/V in each block (speculative
    decoding: its pages share the target's block ids), counted in the block's bytes, as n-gram
    speculation's token pages are (`prompt_lookup`: see EngineConfig; replicated, so each shard
    holds them whole). `lora`: LoRAConfig or None."""
    # The values alone were checked by EngineArgs; what follows depends on the model and the mesh.
    if preemption_mode == "swap" and kv_shards > 1:
        raise ValueError(f"preemption_mode='swap' with tensor parallelism ({kv_shards} shards) is not built")
    if enable_host_prefix_cache and kv_shards > 1:
        raise ValueError(f"enable_host_prefix_cache with tensor parallelism ({kv_shards} shards) is not built")
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
    bytes_per_block = attention.bytes_per_block(model_config.num_layers, model_config.num_kv_heads,
                                                block_size, model_config.head_dim, kv_dtype,
                                                layout=attention.cache_layout(attention_backend))
    bytes_per_block += draft_bytes_per_block + (0 if prompt_lookup is None else TOKEN_BYTES * block_size * kv_shards)
    step_tokens = max(max_num_batched_tokens, num_decode_steps or 8)
    per_seq = blocks_per_seq(max_model_len, block_size, sliding_window, step_tokens)
    useful = max_num_seqs * per_seq + 1  # more could never be used
    if num_blocks is None:
        budget = kv_budget_bytes(
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_fraction=kv_cache_memory_fraction,
            activation_bytes=activation_bytes and (lambda: activation_bytes(max_num_batched_tokens, max_num_seqs,
                                                                            max_model_len)),
            memory_stats=memory_stats, unplaced_bytes=lora.nbytes if lora else 0)
        num_blocks = min(useful, budget * kv_shards // bytes_per_block)
    if num_blocks < 2:
        raise ValueError(f"the KV cache holds {num_blocks} blocks of {bytes_per_block} bytes; "
                         "at least 2 are needed: raise the budget or lower block_size")
    if chosen_len is None and sliding_window is None:  # a length the user chose stays; requests
        max_model_len = min(max_model_len, (num_blocks - 1) * block_size)  # that outgrow the pool fail alone
    return EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                        num_decode_steps=num_decode_steps or 8,
                        long_prefill_token_threshold=long_prefill_token_threshold,
                        enable_prefix_caching=enable_prefix_caching,
                        attention_backend=attention_backend, bytes_per_block=bytes_per_block,
                        kv_cache_dtype=kv_cache_dtype, preemption_mode=preemption_mode,
                        swap_space=float(swap_space), enable_host_prefix_cache=enable_host_prefix_cache,
                        num_speculative_tokens=num_speculative_tokens, prompt_lookup=prompt_lookup, lora=lora)


def blocks_per_seq(longest: int, block_size: int, sliding_window: int | None = None, step_tokens: int = 0) -> int:
    """The most blocks a sequence of up to `longest` tokens holds at once: all of its blocks, or with
    a sliding window those one step reads or writes. A step adding m <= `step_tokens` tokens after c
    computed ones holds blocks (c - window + 1) // block_size .. (c + m - 1) // block_size (the
    scheduler frees the ones before, vLLM's remove_skipped_blocks)."""
    whole = -(-longest // block_size)
    if sliding_window is None:
        return whole
    return min(whole, -(-(sliding_window - 1 + step_tokens) // block_size) + 1)


def announce(config: EngineConfig) -> None:
    print(config.describe(), file=sys.stderr, flush=True)
