"""`EngineArgs`: the engine's parameters, declared once (vLLM's `vllm/engine/arg_utils.py`).

`LLM(model, **kwargs)`, `LLMEngine(model, tokenizer, **kwargs)`, the server and
`scripts/generate.py` all take them from here: the keyword names, their defaults and the checks
that need no model; `add_cli_args` makes the flags (`--block-size`, `--no-async-scheduling`, ...)
and `create_engine_config` sizes the engine for a model (engine/config.py: the KV budget).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax.numpy as jnp

from models import lora, quantize
from pallas_kernels import targets, triton_call
from paged_jax import attention
from paged_jax.engine import config as config_lib
from paged_jax.engine import spec_config
from paged_jax.worker import model_runner, sharding

DTYPES = ("float32", "bfloat16")


def _arg(default, kind, help, *, cli=True):
    """A field with its flag's type and help (`kind` None: a bool, given as --x / --no-x). Values
    are checked by __post_init__, not by argparse, so a bad one is one line naming it."""
    return dataclasses.field(default=default, metadata=dict(kind=kind, help=help, cli=cli))


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    block_size: int = _arg(16, int, "tokens per KV block (a power of two)")
    num_blocks: int | None = _arg(None, int, "KV blocks per layer, the null block included (default: what "
                                              "the memory budget holds)")
    gpu_memory_utilization: float | None = _arg(None, float, "the fraction of the device this engine may use: "
                                                             "weights, activation peak and KV (default 0.9)")
    kv_cache_memory_fraction: float | None = _arg(None, float, "if given, the KV gets this fraction of what "
                                                               "the weights leave (wins over the above)")
    max_num_seqs: int | None = _arg(None, int, "sequences running at once (default: 16 on CPU, 256 on a device)")
    max_num_batched_tokens: int | None = _arg(None, int, "tokens per prefill step (default: 512 on CPU, 8192)")
    max_model_len: int | None = _arg(None, int, "the longest sequence (default: the model's, cut to the pool)")
    num_decode_steps: int = _arg(8, int, "decode steps per device call (the K-step loop)")
    long_prefill_token_threshold: int = _arg(0, int, "chunk prompts longer than this (0: max_num_batched_tokens)")
    enable_prefix_caching: bool = _arg(True, None, "share the KV blocks of common prompt prefixes")
    attention_backend: str = _arg("auto", str, "auto, reference, pallas (Triton), pallas_mosaic, "
                                               "pallas-interpret, pallas_mosaic-interpret or tpu")
    seed: int = _arg(0, int, "seeds requests that carry no seed of their own")
    dtype: str | None = _arg(None, str, "the weights' dtype when loading a checkpoint (default: the "
                                        "checkpoint's)")
    quantization: str | None = _arg(None, str, "weight-only quantization of the model's matmul weights: int8 "
                                                "(a scale per output channel; models/quantize.py)")
    tensor_parallel_size: int = _arg(1, int, "devices the model's heads are split over")
    kv_cache_dtype: str = _arg("auto", str, "auto (the model's dtype), int8 or fp8_e4m3 (quantized pages)")
    preemption_mode: str = _arg("recompute", str, "recompute (vLLM V1) or swap (to host memory)")
    swap_space: float = _arg(4, float, "GiB of host memory for swapped blocks and the host prefix cache")
    enable_host_prefix_cache: bool = _arg(False, None, "keep the prefix cache's evicted blocks in that host "
                                                       "memory, copied back on a hit")
    async_scheduling: bool = _arg(True, None, "plan the next call while the device runs this one")
    speculative_config: dict | None = _arg(None, str, 'speculative decoding, vLLM\'s JSON: {"method": "ngram", '
                                                      '"num_speculative_tokens": 4, "prompt_lookup_max": 4} or '
                                                      '{"method": "draft_model", "model": PATH, '
                                                      '"num_speculative_tokens": 4}')
    enable_lora: bool = _arg(False, None, "serve LoRA adapters, each request its own (lora_request)")
    max_loras: int = _arg(1, int, "LoRA adapters one call runs: the device's adapter slots")
    max_lora_rank: int = _arg(16, int, "the largest LoRA rank a slot holds")
    max_cpu_loras: int | None = _arg(None, int, "LoRA adapters kept loaded in host memory (default: max_loras)")
    log_stats: bool = _arg(True, None, "print the KV cache's size at start", cli=False)

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "num_decode_steps", "tensor_parallel_size", "max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        t = self.long_prefill_token_threshold
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {t!r}")
        if self.dtype not in (None, *DTYPES):
            raise ValueError(f"dtype must be one of {DTYPES} (or None: the checkpoint's), got {self.dtype!r}")
        quantize.check(self.quantization)
        if self.preemption_mode not in config_lib.PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {config_lib.PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        s = self.swap_space
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {s!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        for name in ("enable_prefix_caching", "enable_host_prefix_cache", "async_scheduling", "enable_lora",
                     "log_stats"):
            if getattr(self, name) not in (True, False):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        # A dict (or --speculative-config's JSON text) becomes the checked SpeculativeConfig.
        object.__setattr__(self, "speculative_config", spec_config.SpeculativeConfig.parse(self.speculative_config))
        if self.enable_host_prefix_cache and not self.enable_prefix_caching:
            raise ValueError("enable_host_prefix_cache=True needs enable_prefix_caching=True (it keeps the "
                             "prefix cache's evicted blocks)")
        if self.enable_host_prefix_cache and not s > 0:
            raise ValueError(f"enable_host_prefix_cache=True needs swap_space > 0 GiB to hold its blocks, "
                             f"got swap_space={s!r}")

    # -- the command line ------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per field (`--block-size`; a bool as `--x` / `--no-x`), defaulting to the field's."""
        group = parser.add_argument_group("engine", "the engine's parameters (paged_jax.engine.arg_utils)")
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if not meta["cli"]:
                continue
            flag = "--" + f.name.replace("_", "-")
            help = f"{meta['help']} (default: {f.default})"
            if meta["kind"] is None:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
            else:
                group.add_argument(flag, type=meta["kind"], default=f.default, help=help)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineArgs:
        """The fields from parsed flags (ValueError naming a bad one), `overrides` winning."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    def kwargs(self) -> dict:
        """The fields as keyword arguments (`LLM(model, **args.kwargs())`), each value as it is:
        `dataclasses.asdict` would turn the speculative config back into a dict and copy its model."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # -- sizing ----------------------------------------------------------------------------------

    def create_mesh(self, mesh=None):
        """The tensor-parallel mesh: `mesh` if given (its "model" axis must agree with
        tensor_parallel_size unless that is 1), else one of tensor_parallel_size devices (None for 1)."""
        tp = self.tensor_parallel_size
        if mesh is not None:
            if tp not in (1, mesh.shape.get(sharding.AXIS)):
                raise ValueError(f"tensor_parallel_size={tp} disagrees with the mesh's {sharding.AXIS!r} axis "
                                 f"of size {mesh.shape.get(sharding.AXIS)}")
        elif tp != 1:
            mesh = sharding.make_mesh(tp)
        if mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1:
            sharding.same_programs_in_every_process()
        return mesh

    def create_engine_config(self, model, mesh=None, draft_model=None) -> config_lib.EngineConfig:
        """The engine's sizes for `model` (its attention backend, KV dtype and pool), as vLLM's
        `create_engine_config`; `mesh` as create_mesh returned it; `draft_model`: speculative
        decoding's draft, whose K/V every block holds too (ValueError naming what does not match)."""
        c = model.config
        if self.dtype is not None and jnp.dtype(self.dtype) != jnp.dtype(c.dtype):
            raise ValueError(f"dtype={self.dtype!r} applies when loading a checkpoint; this model is "
                             f"{jnp.dtype(c.dtype).name}: build the model object in the dtype you want")
        backend = attention.resolve_backend(self.attention_backend, dtype=c.dtype, head_dim=c.head_dim,
                                            block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype)
        if backend == "reference" and self.attention_backend == "auto" and targets.platform() == "gpu":
            refusal = attention.mosaic_refusal(c.dtype, c.head_dim, self.block_size, self.kv_cache_dtype)
            print(f"paged-jax: no Pallas kernel takes this model on this GPU, so attention runs the jnp "
                  f"reference (Mosaic GPU: {refusal}; {triton_call.UNAVAILABLE})", file=sys.stderr, flush=True)
        kv_dtype = attention.check_kv_cache_dtype(self.kv_cache_dtype, backend, c.dtype)
        draft_bytes = 0 if draft_model is None else self.draft_bytes_per_block(c, draft_model.config, backend)
        speculating = spec_config.engine_fields(self.speculative_config)
        return config_lib.resolve(
            c, block_size=self.block_size, num_blocks=self.num_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            activation_bytes=functools.partial(model_runner.activation_bytes, model, backend=backend,
                                               block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
                                               draft_model=draft_model, **speculating),
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, num_decode_steps=self.num_decode_steps,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_prefix_caching=self.enable_prefix_caching, attention_backend=backend, kv_dtype=kv_dtype,
            kv_shards=sharding.tensor_parallel_size(mesh), sliding_window=getattr(c, "kv_window", None),
            kv_cache_dtype=self.kv_cache_dtype, preemption_mode=self.preemption_mode, swap_space=self.swap_space,
            enable_host_prefix_cache=self.enable_host_prefix_cache, draft_bytes_per_block=draft_bytes,
            lora=self.lora_config(c), **speculating)

    def lora_config(self, model_config) -> config_lib.LoRAConfig | None:
        if not self.enable_lora:
            return None
        return config_lib.LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras,
                                     lora.LoRAWeights.nbytes_for(model_config, self.max_loras, self.max_lora_rank))

    def draft_bytes_per_block(self, target, draft, backend: str) -> int:
        """A draft model's K/V bytes per block, once it is checked against the target: the same
        vocabulary, the same attention backend, and no longer a window than the target's (the pool
        frees the blocks before the target's window)."""
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config draft model's vocab_size {draft.vocab_size} differs from the "
                             f"target's {target.vocab_size}: a draft must share the target's vocabulary")
        window, draft_window = getattr(target, "kv_window", None), getattr(draft, "kv_window", None)
        if window is not None and (draft_window is None or draft_window > window):
            raise ValueError(f"speculative_config draft model's attention window {draft_window} reaches past the "
                             f"target's sliding window {window}, whose blocks the pool frees")
        draft_backend = attention.resolve_backend(self.attention_backend, dtype=draft.dtype, head_dim=draft.head_dim,
                                                  block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype)
        if draft_backend != backend:
            raise ValueError(f"speculative_config draft model resolves attention_backend {draft_backend!r}, the "
                             f"target {backend!r}: both run in the same calls")
        kv_dtype = attention.check_kv_cache_dtype(self.kv_cache_dtype, backend, draft.dtype)
        return attention.bytes_per_block(draft.num_layers, draft.num_kv_heads, self.block_size, draft.head_dim,
                                         kv_dtype, layout=attention.cache_layout(backend))
