"""Llama 3 (Hugging Face `LlamaForCausalLM`'s family) in Flax NNX, reading and writing the paged KV cache.
Qwen2 and Qwen3 are the same blocks plus q/k/v biases or per-head q/k norms, Mistral plus a sliding
window (`ARCHITECTURES`); Gemma 2 (models/gemma2.py) subclasses the config and the model.
The config, presets and RoPE frequencies are models/llama_config.py's, re-exported here.

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

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import (COMPILER_OPTIONS, HALF_ALGORITHMS, causal_attention, gated_mlp, rms_norm, rope_tables,
                           scan_layers, self_attention)
from models.llama_config import (ARCHITECTURES, PRESETS, SUPPORTED_DTYPES, LlamaConfig, hf_common_fields, preset,
                                 rope_attention_factor, rope_inv_freq)
from models.lora import LoRAInputs
from models.quantize import head_logits
from pallas_kernels.quantization import storage_dtype
from paged_jax.attention import AttentionMetadata, KVCache, attend

# The config's names are imported from here as well as from models.llama_config.
__all__ = ["ARCHITECTURES", "PRESETS", "SUPPORTED_DTYPES", "Llama", "LlamaConfig", "LlamaLayers", "forward",
           "fit_rope", "hf_common_fields", "preset", "rope_inv_freq"]


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
            self.q_norm = const(self.norm_init, c.head_dim)
            self.k_norm = const(self.norm_init, c.head_dim)
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

    def rope_tables(self, positions):  # i32[...] -> (f32[..., rotary_dim // 2], same)
        cos, sin = rope_tables(rope_inv_freq(self.config), positions)
        scale = rope_attention_factor(self.config)  # LongRoPE's; 1 otherwise
        return (cos, sin) if scale == 1.0 else (cos * scale, sin * scale)

    def layer_rope(self, tables, window: int | None):
        """The RoPE tables of a layer with this sliding window (Gemma 3's differ by window)."""
        return tables

    def embed_tokens(self, tokens):  # i32[...] -> [..., hidden_size]
        with jax.named_scope("embed"):
            rows = self.embed[...][tokens]
            scale = getattr(self, "embed_scale", None)  # int8 rows (models/quantize.py)
            if scale is None:
                return rows
            return (rows * scale[...][tokens][..., None]).astype(self.config.dtype)

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
        lora: LoRAInputs | None = None,  # adapters, the tokens' slots per token of x ([num_tokens, hidden])
    ):
        """The layer scan (models.layers.scan_layers) -> (x, attn_state)."""
        tables = self.rope_tables(positions)
        weights = self.layers.arrays()
        if lora is not None:  # each layer's slots are scanned with its weights; the tokens' mask is shared
            weights, mask = {**weights, **lora.weights.layer_arrays()}, lora.mask(x.dtype)

        def layer(x, w, attention, state, window):
            w = w if lora is None else {**w, "lora_mask": mask}
            return self.decoder_layer(x, w, *self.layer_rope(tables, window), attention, state)

        return scan_layers(layer, x, weights, self.config.layer_windows, attention, attn_state)

    def lm_head_logits(self, h):  # h [..., hidden], normalised -> f32[..., vocab]
        tied = self.lm_head is None
        head, scale = (self.embed, getattr(self, "embed_scale", None)) if tied else (
            self.lm_head, getattr(self, "lm_head_scale", None))
        if scale is not None:  # int8 (models/quantize.py)
            return head_logits(h, head[...], scale[...], tied=tied)
        spec = "...d,vd->...v" if tied else "...d,dv->...v"
        w = head[...]
        algorithm = HALF_ALGORITHMS.get(jnp.dtype(h.dtype)) if h.dtype == w.dtype else None
        return jnp.einsum(spec, h, w, preferred_element_type=jnp.float32, precision=algorithm)

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
        lora: LoRAInputs | None = None,
    ):
        """Ragged paged forward -> (f32[num_logits, vocab], cache): prefill, chunked prefill, decode.
        `mesh`: run attention per tensor-parallel shard (see paged_jax.worker.sharding); `lora`: the
        adapters' slots and each token's (models/lora.py)."""
        c = self.config

        def paged(q, k, v, cache, layer, sliding_window):
            return attend(q, k, v, cache, layer, md, backend=backend, sm_scale=c.sm_scale,
                          soft_cap=c.attn_soft_cap, sliding_window=sliding_window, mesh=mesh)

        x, cache = self.run_layers(self.embed_tokens(tokens), positions, paged, cache, lora)
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


@functools.partial(jax.jit, static_argnames=("backend", "mesh"), donate_argnames=("cache",),
                   compiler_options=COMPILER_OPTIONS)
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
    lora: LoRAInputs | None = None,
):
    """The jitted entry point: `graphdef, state = nnx.split(model)` once, then call this per step.
    Same arguments and result as `Llama.__call__`; the cache is donated and updated in place."""
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, cache, md, logits_indices, backend=backend, mesh=mesh, lora=lora)


def fit_rope(model: Llama, max_model_len: int) -> Llama:
    """`model` with LongRoPE's long factors in use when its sequences may outgrow the original
    context, its short ones otherwise: vLLM's rule, fixed for the engine's life (HF switches when a
    sequence crosses it, which leaves the keys cached before in the other RoPE). Others unchanged."""
    c = model.config
    scaling = dict(c.rope_scaling or ())
    if scaling.get("rope_type") != "longrope":
        return model
    long = max_model_len > scaling["original_max_position_embeddings"]
    if long == c.long_rope:
        return model
    fitted = nnx.merge(*nnx.split(model))  # the same arrays; the caller's model keeps its config
    fitted.config = dataclasses.replace(c, long_rope=long)
    return fitted
