"""Gemma 2 (Hugging Face `Gemma2ForCausalLM`, transformers' models/gemma2/modeling_gemma2.py) on
Llama's blocks and paged forward: what it changes is listed in shared/notes/model-families.md.

- every other layer attends through a sliding window (`layer_types`), the others globally: the
  layer scan steps over sliding/global pairs, each with its static window (models.layers.scan_layers);
- attention scores are scaled by `query_pre_attn_scalar ** -0.5` and soft-capped
  (`attn_logit_softcapping`, the kernels' `soft_cap`); the final logits are soft-capped too;
- four norms per layer (before and after attention, before and after the MLP), each an RMSNorm that
  scales by (1 + w) in f32; a GeGLU MLP (tanh-approximated gelu); embeddings times sqrt(hidden).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import gated_mlp, self_attention
from models.llama import Llama, LlamaLayers
from models.llama_config import LlamaConfig, hf_common_fields

LAYER_TYPES = ("sliding_attention", "full_attention")
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
# transformers' Gemma2Config defaults for the fields read here: a config.json may leave them out.
_HF_DEFAULTS = dict(tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-6,
                    bos_token_id=2, eos_token_id=1, query_pre_attn_scalar=256, sliding_window=4096,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    hidden_activation="gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class Gemma2Config(LlamaConfig):
    architectures: ClassVar[dict[str, str]] = {"gemma2": "Gemma2ForCausalLM"}
    model_type: str = "gemma2"
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = 4096  # on the "sliding_attention" layers only
    query_pre_attn_scalar: float = 256  # scores are scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = 50.0  # cap * tanh(score / cap); None: no cap
    final_logit_softcapping: float | None = 30.0
    # One of LAYER_TYPES per layer; None: HF's default, even layers sliding (stored as that tuple).
    layer_types: tuple[str, ...] | None = None

    def _check_family(self):
        types = self.layer_types
        if types is None:
            types = tuple(LAYER_TYPES[i % 2] for i in range(self.num_layers))
        object.__setattr__(self, "layer_types", tuple(types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}: each layer is one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        if not positive(self.query_pre_attn_scalar):
            raise ValueError(f"query_pre_attn_scalar must be a positive number, got {self.query_pre_attn_scalar!r}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None and not positive(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number or None, got {getattr(self, name)!r}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def sm_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    @property
    def attn_soft_cap(self) -> float | None:
        return self.attn_logit_softcapping

    @classmethod
    def from_hf_config(cls, hf: dict, *, dtype=None) -> Gemma2Config:
        hf = {**_HF_DEFAULTS, **hf}
        return cls(**hf_common_fields(hf, dtype), **gemma_fields(hf, "gemma2"), layer_types=hf.get("layer_types"))

    def to_hf_config(self) -> dict:
        hf = super().to_hf_config()
        del hf["hidden_act"], hf["mlp_bias"]  # Gemma2Config has neither
        return {**hf, "hidden_activation": SUPPORTED_ACTIVATIONS[0], "layer_types": list(self.layer_types),
                "query_pre_attn_scalar": self.query_pre_attn_scalar,
                "attn_logit_softcapping": self.attn_logit_softcapping,
                "final_logit_softcapping": self.final_logit_softcapping}


def gemma_fields(hf: dict, model_type: str) -> dict:
    """What Gemma 2 and 3 read alike from a config.json (with the family's defaults filled in)."""
    if hf["hidden_activation"] not in SUPPORTED_ACTIVATIONS:  # HF's Gemma reads this, not hidden_act
        raise ValueError(f"hidden_activation={hf['hidden_activation']!r} ({model_type}) is not supported; "
                         f"supported: {SUPPORTED_ACTIVATIONS}")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"use_bidirectional_attention: true ({model_type}) is not supported: the paged "
                         "cache is causal")
    return {name: hf[name] for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                                        "sliding_window")} | {"attention_bias": hf.get("attention_bias", False)}


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def rms_norm_1p(x, weight, eps):  # x [..., hidden]; weight [hidden]
    """Gemma's RMSNorm: normalise and scale by (1 + w) both in f32, then cast (HF's Gemma2RMSNorm;
    Llama's casts before scaling, so the two round differently in bf16)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class Gemma2Layers(LlamaLayers):
    # HF's input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm
    norms = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
    norm_init = 0.0  # a zero weight is the identity: the norm scales by 1 + w


class Gemma2(Llama):
    layers_cls = Gemma2Layers

    def embed_tokens(self, tokens):  # i32[...] -> [..., hidden_size]
        # HF's normalizer: sqrt(hidden) as an f32 tensor cast to the embedding dtype (55.5, not
        # 55.4256, for hidden 3072 in bf16), then the product in that dtype.
        x = super().embed_tokens(tokens)
        return x * jnp.asarray(np.float32(self.config.hidden_size**0.5)).astype(x.dtype)

    def decoder_layer(self, x, w, cos, sin, attention, attn_state):
        """Llama.decoder_layer's contract; the attention and MLP outputs are normalised before
        each residual add."""
        eps = self.config.rms_norm_eps
        with jax.named_scope("attention"):
            o, attn_state = self_attention(rms_norm_1p(x, w["attn_norm"], eps), w, cos, sin, attention,
                                           attn_state, eps, norm=rms_norm_1p)  # Gemma 3's q/k norms
            x = x + rms_norm_1p(o, w["post_attn_norm"], eps)
        with jax.named_scope("mlp"):
            h = gated_mlp(rms_norm_1p(x, w["mlp_norm"], eps), w, functools.partial(jax.nn.gelu, approximate=True))
            x = x + rms_norm_1p(h, w["post_mlp_norm"], eps)
        return x, attn_state

    def logits(self, x):  # x [..., hidden] -> f32[..., vocab]
        with jax.named_scope("lm_head"):
            logits = self.lm_head_logits(rms_norm_1p(x, self.norm[...], self.config.rms_norm_eps))
            cap = self.config.final_logit_softcapping
            return logits if cap is None else cap * jnp.tanh(logits / cap)
