"""Gemma 3's text model (Hugging Face `Gemma3ForCausalLM`, model_type `gemma3_text`: Gemma 3 1B,
and the language model of the 4B-27B checkpoints; transformers' models/gemma3/modeling_gemma3.py)
on Gemma 2's blocks (models/gemma2.py). What it changes:

- five sliding layers to one global (`layer_types`; a transformers-4 config.json gives
  `sliding_window_pattern`, 6 by default): the layer scan steps over groups of six;
- two RoPE bases: sliding layers turn at `rope_local_base_freq` (10,000), global ones at
  `rope_theta` (1,000,000) with a linear `rope_scaling` (positions divided by 8 on the 4B-27B);
- q and k are normalised per head before RoPE (Qwen3's place, Gemma's (1 + w) RMSNorm);
- no soft caps (the config fields stay, null by default).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from models.gemma2 import Gemma2, Gemma2Config, gemma_fields, positive
from models.layers import rope_tables
from models.llama_config import hf_common_fields, rope_frequencies

SLIDING_WINDOW_PATTERN = 6  # transformers' default: every sixth layer attends globally
# transformers' Gemma3TextConfig defaults for the fields read here: the 4B-27B checkpoints' text_config
# gives only what differs from them.
_HF_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                    tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=2,
                    eos_token_id=1, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=None,
                    final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh")
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")


@dataclasses.dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    architectures: ClassVar[dict[str, str]] = {"gemma3_text": "Gemma3ForCausalLM"}
    model_type: str = "gemma3_text"
    rope_theta: float = 1_000_000.0  # the global layers' base
    rope_local_base_freq: float = 10_000.0  # the sliding layers' base
    rope_linear_factor: float = 1.0  # the global layers' positions are divided by it (HF's "linear")
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def _check_family(self):
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_layers, SLIDING_WINDOW_PATTERN))
        super()._check_family()
        for name in ("rope_local_base_freq", "rope_linear_factor"):
            if not positive(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            raise ValueError("gemma3_text scales RoPE by rope_linear_factor, not rope_scaling")

    @property
    def qk_norm(self) -> bool:
        return True

    @classmethod
    def from_hf_config(cls, hf: dict, *, dtype=None) -> Gemma3Config:
        hf = {**_HF_DEFAULTS, **hf}
        layer_types = hf.get("layer_types") or default_layer_types(
            hf["num_hidden_layers"], hf.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN))
        common = hf_common_fields({k: v for k, v in hf.items() if k not in _ROPE_KEYS}, dtype)
        return cls(**{**common, **_rope_fields(hf)}, **gemma_fields(hf, "gemma3_text"),
                   layer_types=tuple(layer_types))

    def to_hf_config(self) -> dict:
        scaling = None if self.rope_linear_factor == 1.0 else {"rope_type": "linear", "factor": self.rope_linear_factor}
        return {**super().to_hf_config(), "rope_local_base_freq": self.rope_local_base_freq, "rope_scaling": scaling}


def default_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """transformers' rule: layer i attends globally when (i + 1) is a multiple of the pattern."""
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"sliding_window_pattern must be a positive int, got {pattern!r}")
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _rope_fields(hf: dict) -> dict:
    """The two bases and the global layers' linear factor from a transformers-4 config.json
    (rope_theta, rope_local_base_freq, rope_scaling) or a transformers-5 one (rope_parameters per
    layer type)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (gemma3_text): only 'linear' is implemented")
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"unsupported RoPE on the sliding layers (gemma3_text): {local}")
    return dict(rope_theta=float(full.get("rope_theta", 1_000_000.0)),
                rope_local_base_freq=float(local.get("rope_theta", 10_000.0)),
                rope_linear_factor=float(full.get("factor", 1.0)) if kind == "linear" else 1.0)


class Gemma3(Gemma2):
    def rope_tables(self, positions):  # i32[...] -> ((cos, sin) global, (cos, sin) sliding)
        c = self.config
        return (rope_tables(rope_frequencies(c.rope_theta, c.head_dim) / c.rope_linear_factor, positions),
                rope_tables(rope_frequencies(c.rope_local_base_freq, c.head_dim), positions))

    def layer_rope(self, tables, window: int | None):
        return tables[0] if window is None else tables[1]
