"""Llama 3 (Hugging Face `LlamaForCausalLM`'s family) in Flax NNX, reading and writing the paged KV cache.
Qwen2 and Qwen3 are the same blocks plus q/k/v biases or per-head q/k norms, Mistral plus a sliding
window (`ARCHITECTURES`); Gemma 2 (models/gemma2.py) subclasses the config and the model.

One forward serves prefill, chunked prefill and decode: a ragged batch of tokens, each layer writes
its new K/V at `md.slot_mapping` and attends through `paged_jax.attention.attend`. The KV cache is an
argument and a return value, never an `nnx.Variable`, so the engine can donate it. Layers are stacked
on a leading axis and run under `jax.lax.scan`, so compile time does not grow with depth.

Weights are laid out for Megatron-style tensor parallelism: q/k/v/o keep heads on their own axis
(shard `wq`/`wk`/`wv` on heads, `wo` on heads, a reduction after it), the MLP is gate/up (shard on
intermediate) and down (shard on intermediate, reduce after).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import causal_attention, gated_mlp, rms_norm, scan_layers, self_attention
from pallas_kernels.quantization import storage_dtype
from paged_jax.attention import AttentionMetadata, KVCache, attend

SUPPORTED_DTYPES = ("float32", "bfloat16")
# Hugging Face's dtype names for what we compute in; float16 runs as bfloat16 (same bytes, JAX's
# accelerators prefer it, and it does not overflow where float16 activations can).
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}
# config.json's model_types built from these blocks -> HF architecture. What a family changes that
# its config.json does not state (shared/notes/model-families.md) is derived from model_type below.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    architectures: ClassVar[dict[str, str]] = ARCHITECTURES  # the model_types this class builds
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None, or the llama3 dict (rope_type "llama3", factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); kept as sorted (key, value) pairs so the config hashes:
    # it is static data in the model's graphdef, a jit cache key.
    rope_scaling: Any = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k, v and o (HF Llama's and Qwen3's field)
    max_position_embeddings: int = 131072
    bos_token_id: int | None = 128000
    eos_token_id: Any = 128001  # int or a tuple of ints
    dtype: str = "float32"  # params and activations; norms and softmax accumulate in f32
    model_type: str = "llama"
    # Mistral's: a query at position p sees keys at (p - sliding_window, p] in every layer; None: all.
    sliding_window: int | None = None

    def __post_init__(self):
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            # Older HF configs name the type "type", some carry both keys.
            kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
            scaling.pop("type", None)
            if kind != "llama3":
                raise ValueError(f"unsupported rope_scaling type {kind!r}: only 'llama3' is implemented")
            missing = {"factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"} - set(scaling)
            if missing:
                raise ValueError(f"llama3 rope_scaling lacks {sorted(missing)}: {self.rope_scaling}")
            object.__setattr__(self, "rope_scaling", tuple(sorted({**scaling, "rope_type": kind}.items())))
        if isinstance(self.eos_token_id, (list, tuple)):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.model_type not in self.architectures:
            raise ValueError(f"unsupported model_type {self.model_type!r}: only {sorted(self.architectures)} "
                             "are implemented")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        self._check_family()

    def _check_family(self):
        # HF's Llama and Qwen classes ignore a sliding_window (Qwen2's use_sliding_window is refused
        # on load): only Mistral's would round-trip through to_hf_config.
        if self.sliding_window is not None and self.model_type != "mistral":
            raise ValueError(f"sliding_window={self.sliding_window} is for model_type 'mistral' only, "
                             f"got {self.model_type!r}")

    @property
    def qkv_bias(self) -> bool:  # Qwen2 always biases q, k, v (not o)
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
        return self.model_type == "qwen3"

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: it attends to the whole sequence)."""
        return (self.sliding_window,) * self.num_layers

    @property
    def kv_window(self) -> int | None:
        """The window every layer shares, or None when any layer attends globally. A query at
        position p reads keys at (p - kv_window, p] only, so once a sequence's next query is at p,
        blocks wholly at or before p - kv_window are read by no layer again (the engine may free them)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def sm_scale(self) -> float:  # the attention scores' scale
        return self.head_dim**-0.5

    @property
    def attn_soft_cap(self) -> float | None:  # cap * tanh(score / cap) on the scaled scores; Gemma 2's
        return None

    @classmethod
    def from_hf_config(cls, hf: dict, *, dtype=None) -> LlamaConfig:
        """From a Hugging Face `config.json` dict (transformers 4 or 5 style)."""
        model_type = hf.get("model_type", "llama")
        if hf.get("use_sliding_window"):
            raise ValueError(f"use_sliding_window: true ({model_type}, sliding_window="
                             f"{hf.get('sliding_window')}) is not supported yet")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
            raise ValueError("unsupported Llama variant: hidden_act must be 'silu' and mlp_bias false, "
                             f"got {hf.get('hidden_act')!r}, {hf.get('mlp_bias')!r}")
        # Qwen configs carry a sliding_window that they do not use (use_sliding_window false).
        window = hf.get("sliding_window") if model_type == "mistral" else None
        return cls(**hf_common_fields(hf, dtype), attention_bias=hf.get("attention_bias", False),
                   model_type=model_type, sliding_window=window)

    def to_hf_config(self) -> dict:
        """The transformers-4 style `config.json` (read by transformers 4 and 5, and by vLLM)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        return {
            "architectures": [self.architectures[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": scaling,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": False, "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": eos, "torch_dtype": self.dtype,
            "sliding_window": self.sliding_window,  # explicit: MistralConfig's default is 4096, not None
        }


def hf_common_fields(hf: dict, dtype) -> dict:
    """The fields every family reads alike from an HF `config.json` dict."""
    # transformers 5 folds rope_theta and the scaling into `rope_parameters`; 4 keeps them apart.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if not rope or rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    saved = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype is None and saved not in _HF_DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {saved!r}; pass dtype= explicitly")
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        dtype=dtype or _HF_DTYPES[saved])


_LLAMA3_SCALING = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)
_LLAMA3 = dict(vocab_size=128256, intermediate_size=8192, num_kv_heads=8, rms_norm_eps=1e-5,
               rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000,
               eos_token_id=128001, dtype="bfloat16")
PRESETS = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, num_layers=16, num_heads=32, head_dim=64,
                         tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_SCALING, factor=32.0)),
    "llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, num_layers=28, num_heads=24, head_dim=128,
                         tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_SCALING, factor=32.0)),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, head_dim=128, rope_scaling=dict(_LLAMA3_SCALING, factor=8.0)),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
                 bos_token_id=1, eos_token_id=2, dtype="float32"),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """A named shape (`PRESETS`), with any field overridden: `preset("tiny", num_layers=4)`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return LlamaConfig(**{**PRESETS[name], **overrides})


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:  # f32[head_dim // 2]
    """RoPE frequencies, with Llama 3.1's scaling: long wavelengths slowed by `factor`, short ones
    kept, a smooth blend between (Meta's llama-models `apply_scaling`, HF's `_compute_llama3_parameters`)."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d)
    if config.rope_scaling is None:
        return inv_freq.astype(np.float32)
    s = dict(config.rope_scaling)
    old_len, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


class LlamaLayers(nnx.Module):
    """Every decoder layer's weights, stacked on a leading `num_layers` axis for the layer scan."""

    norms = ("attn_norm", "mlp_norm")  # before attention, before the MLP
    norm_init = 1.0  # the weight of an identity norm: RMSNorm scales by w (Gemma's by 1 + w)

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c, dtype = config, jnp.dtype(config.dtype)
        n, d, f = c.num_layers, c.hidden_size, c.intermediate_size
        normal = nnx.initializers.normal(0.02)

        # Every parameter is [num_layers, *shape]: wq [L, hidden, heads, head_dim], wo [L, heads,
        # head_dim, hidden], w_gate [L, hidden, intermediate], w_down [L, intermediate, hidden], ...
        def weight(*shape):
            return nnx.Param(normal(rngs.params(), (n, *shape), dtype))

        def const(fill, *shape):
            return nnx.Param(jnp.full((n, *shape), fill, dtype))

        for name in self.norms:
            setattr(self, name, const(self.norm_init, d))
        self.wq = weight(d, c.num_heads, c.head_dim)
        self.wk = weight(d, c.num_kv_heads, c.head_dim)
        self.wv = weight(d, c.num_kv_heads, c.head_dim)
        self.wo = weight(c.num_heads, c.head_dim, d)
        if c.qkv_bias:
            self.bq = const(0.0, c.num_heads, c.head_dim)
            self.bk = const(0.0, c.num_kv_heads, c.head_dim)
            self.bv = const(0.0, c.num_kv_heads, c.head_dim)
        if c.attention_bias:
            self.bo = const(0.0, d)
        if c.qk_norm:
            self.q_norm = const(1.0, c.head_dim)
            self.k_norm = const(1.0, c.head_dim)
        self.w_gate = weight(d, f)
        self.w_up = weight(d, f)
        self.w_down = weight(f, d)
        self.names = self.norms + ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down") + tuple(
            name for name in ("bq", "bk", "bv", "bo", "q_norm", "k_norm") if hasattr(self, name))

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked weights as a plain dict: what `lax.scan` slices one layer at a time."""
        return {name: getattr(self, name)[...] for name in self.names}


class Llama(nnx.Module):
    layers_cls = LlamaLayers  # a family with other per-layer weights (Gemma 2) names its own

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype, normal = jnp.dtype(config.dtype), nnx.initializers.normal(0.02)  # HF's initializer_range
        self.embed = nnx.Param(normal(rngs.params(), (config.vocab_size, config.hidden_size), dtype))
        self.layers = self.layers_cls(config, rngs=rngs)
        self.norm = nnx.Param(jnp.full((config.hidden_size,), self.layers_cls.norm_init, dtype))
        # Tied: the head reads `embed` ([vocab, hidden]) transposed; untied: its own [hidden, vocab].
        self.lm_head = None if config.tie_word_embeddings else nnx.Param(
            normal(rngs.params(), (config.hidden_size, config.vocab_size), dtype))

    def _rope_tables(self, positions):  # i32[...] -> (f32[..., head_dim // 2], same)
        inv_freq = jnp.asarray(rope_inv_freq(self.config))  # a constant of the config, built at trace time
        angles = positions[..., None].astype(jnp.float32) * inv_freq
        return jnp.cos(angles), jnp.sin(angles)

    def embed_tokens(self, tokens):  # i32[...] -> [..., hidden_size]
        with jax.named_scope("embed"):
            return self.embed[...][tokens]

    def decoder_layer(
        self,
        x,  # [..., hidden_size]
        w,  # dict of one layer's weights: LlamaLayers' shapes without the leading num_layers axis
        cos,  # f32[..., head_dim // 2]
        sin,  # f32[..., head_dim // 2]
        attention,  # (q, k, v, attn_state) -> (out, attn_state)
        attn_state,  # the paged cache, or None for the dense path
    ):
        """One pre-norm block -> (x, attn_state); attention is the only part that differs between the
        paged and the dense forward."""
        eps = self.config.rms_norm_eps
        with jax.named_scope("attention"):
            o, attn_state = self_attention(rms_norm(x, w["attn_norm"], eps), w, cos, sin, attention,
                                           attn_state, eps)
            x = x + o
        with jax.named_scope("mlp"):
            x = x + gated_mlp(rms_norm(x, w["mlp_norm"], eps), w, jax.nn.silu)
        return x, attn_state

    def run_layers(
        self,
        x,  # [..., hidden_size]
        positions,  # i32[...]
        attention,  # (q, k, v, attn_state, layer, sliding_window) -> (out, attn_state)
        attn_state,  # carried through the scan: the paged cache, or None
    ):
        """The layer scan (models.layers.scan_layers) -> (x, attn_state)."""
        cos, sin = self._rope_tables(positions)

        def layer(x, w, attention, state):
            return self.decoder_layer(x, w, cos, sin, attention, state)

        return scan_layers(layer, x, self.layers.arrays(), self.config.layer_windows, attention, attn_state)

    def lm_head_logits(self, h):  # h [..., hidden], normalised -> f32[..., vocab]
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", h, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", h, self.lm_head[...], preferred_element_type=jnp.float32)

    def logits(self, x):  # x [..., hidden] -> f32[..., vocab]
        with jax.named_scope("lm_head"):
            return self.lm_head_logits(rms_norm(x, self.norm[...], self.config.rms_norm_eps))

    def __call__(
        self,
        tokens,  # i32[num_tokens]
        positions,  # i32[num_tokens]
        cache: KVCache,
        md: AttentionMetadata,
        logits_indices,  # i32[num_logits]; rows wanting logits (each sequence's last token)
        *,
        backend: str = "reference",
        mesh=None,
    ):
        """Ragged paged forward -> (f32[num_logits, vocab], cache): prefill, chunked prefill, decode.
        `mesh`: run attention per tensor-parallel shard (see paged_jax.worker.sharding)."""
        c = self.config

        def paged(q, k, v, cache, layer, sliding_window):
            return attend(q, k, v, cache, layer, md, backend=backend, sm_scale=c.sm_scale,
                          soft_cap=c.attn_soft_cap, sliding_window=sliding_window, mesh=mesh)

        x, cache = self.run_layers(self.embed_tokens(tokens), positions, paged, cache)
        return self.logits(x[logits_indices]), cache

    def dense_logits(self, tokens):  # i32[batch, seq] -> f32[batch, seq, vocab]
        """Plain causal forward without a cache: differentiable (training) and the tests' reference."""
        c = self.config

        def dense(q, k, v, state, layer, sliding_window):
            return causal_attention(q, k, v, sm_scale=c.sm_scale, soft_cap=c.attn_soft_cap,
                                    sliding_window=sliding_window), state

        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x, _ = self.run_layers(self.embed_tokens(tokens), positions, dense, None)
        return self.logits(x)

    def init_cache(self, num_blocks: int, block_size: int, *, layout: str = "paged",
                   kv_cache_dtype: str = "auto") -> KVCache:
        """An empty cache: `num_blocks` pool blocks per layer, in the layout the attention backend
        reads (`paged_jax.attention.cache_layout(backend)`), in the model's dtype
        (`kv_cache_dtype` "auto") or quantized ("int8", "fp8_e4m3")."""
        c = self.config
        return KVCache.create(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                              storage_dtype(kv_cache_dtype, c.dtype), layout=layout)


@functools.partial(jax.jit, static_argnames=("backend", "mesh"), donate_argnames=("cache",))
def forward(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens,  # i32[num_tokens]
    positions,  # i32[num_tokens]
    cache: KVCache,
    md: AttentionMetadata,
    logits_indices,  # i32[num_logits]
    backend: str = "reference",
    mesh=None,
):
    """The jitted entry point: `graphdef, state = nnx.split(model)` once, then call this per step.
    Same arguments and result as `Llama.__call__`; the cache is donated and updated in place."""
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, cache, md, logits_indices, backend=backend, mesh=mesh)
